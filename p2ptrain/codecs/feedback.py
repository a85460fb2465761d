"""Error feedback: what a lossy codec dropped, to add to the sender's next contribution.

With feedback, each sender sends ``x = g + residual`` and keeps
``residual = x - decode(encode(x))``, so over rounds the applied updates sum to the
gradients computed (up to float rounding), whatever the codec drops.
"""

from __future__ import annotations

import numpy as np

from p2ptrain.codecs._codec import Codec, Encoded
from p2ptrain.errors import ConfigError


def residual_of(codec: Codec, x: np.ndarray, enc: Encoded, out: np.ndarray) -> np.ndarray:
    """Write ``x - codec.decode(enc)`` into ``out`` (float32, same length as ``x``) and return it.

    It decodes the very bytes of ``enc`` with the codec's own ``decode``, so the residual
    is bit-consistent with what every receiver applies. ``out`` may not overlap ``x``
    (ConfigError).
    For a lossless codec the residual is zero and callers may skip this call.
    """
    if np.may_share_memory(x, out) or getattr(x, "shape", None) != getattr(out, "shape", None):
        raise ConfigError("residual_of needs x and out of the same length, not overlapping")
    payload = enc.buffers[0] if len(enc.buffers) == 1 else b"".join(enc.buffers)
    codec.decode(enc.params, payload, out)
    np.subtract(x, out, out=out)
    return out
