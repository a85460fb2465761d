"""The 16-bit dense transforms: fp16 with a power-of-two scale per chunk, and bf16.

Both halve the payload and keep every value. They scale by powers of two only, so the
scaling itself is exact and the one rounding is the float32 -> 16-bit cast (IEEE
round-to-nearest-even, the same on every machine).
"""

from __future__ import annotations

import math

import numpy as np

from p2ptrain.codecs._codec import Scratch, check_domain, tensor_of
from p2ptrain.errors import CodecError

_F16 = np.dtype("<f2")
_U16 = np.dtype("<u2")
# fp16 scale exponent range: absmax <= 2**127 gives s >= 15 - 128; s is capped at 126 so
# that 2**-s is a normal float32 (a subnormal multiplier would change under DAZ).
_S_MIN, _S_MAX = -113, 126


class FP16:
    """fp16 with a per-chunk power-of-two scale ``2**s``, ``s`` in params.

    ``s`` maps the chunk's absmax into [2**14, 2**15), far from fp16's overflow (65504)
    and 2**29 above its smallest subnormal, so 1e30 and 1e-30 chunks keep full precision.

    Error bound, per value: ``|x - y| <= 2**-11 * |x| + 2**-39 * absmax + 2**-149``
    (absmax of the chunk; the last term only matters for float32 subnormals).
    """

    name = "fp16"
    params = {"s": int}

    def __init__(self) -> None:
        self._tmp = Scratch()

    def max_raw(self, n: int) -> int:
        return 2 * n

    def raw_size(self, n: int, params: dict) -> int:
        if not _S_MIN <= params["s"] <= _S_MAX:
            raise CodecError(f"fp16 scale exponent {params['s']} out of range")
        return 2 * n

    def encode_raw(self, x: np.ndarray) -> tuple[dict, np.ndarray]:
        buf = np.empty(2 * x.size, np.uint8)
        if x.size == 0:
            return {"s": 0}, buf
        absmax = max(float(x.max()), -float(x.min()))
        check_domain(self.name, absmax)
        s = 0 if absmax == 0 else min(15 - math.frexp(absmax)[1], _S_MAX)
        # float32 multiply by 2**s is exact here; the cast to fp16 is the one rounding. Two
        # passes of torch's (``tensor_of``): numpy's float32 -> fp16 cast runs 10x slower.
        # (Not torch's one multiply into fp16: it rounds x to fp16 first.)
        import torch

        scaled = torch.mul(tensor_of(x), 2.0**s, out=tensor_of(self._tmp.take(x.size)))
        tensor_of(buf.view(_F16)).copy_(scaled)
        return {"s": s}, buf

    def decode_raw(self, n: int, params: dict, raw, out: np.ndarray) -> None:
        # Widened (exact), then scaled in place: numpy's fp16 -> float32 cast runs 10x slower.
        tensor_of(out).copy_(tensor_of(np.frombuffer(raw, _F16, n))).mul_(2.0 ** -params["s"])


class BF16:
    """bf16: the top 16 bits of each float32, rounded to nearest even. No params.

    bf16 has float32's exponent range, so no scale is needed.
    Error bound, per value: ``|x - y| <= 2**-8 * |x| + 2**-134``.
    """

    name = "bf16"
    params: dict = {}

    def max_raw(self, n: int) -> int:
        return 2 * n

    def raw_size(self, n: int, params: dict) -> int:
        return 2 * n

    def encode_raw(self, x: np.ndarray) -> tuple[dict, np.ndarray]:
        buf = np.empty(2 * x.size, np.uint8)
        if x.size == 0:
            return {}, buf
        check_domain(self.name, max(float(x.max()), -float(x.min())))
        # torch's cast (``tensor_of``), round to nearest even, 6x numpy's bit arithmetic. |x| <= 2**127
        # keeps the rounding's carry out of the exponent's all-ones (inf/NaN) pattern.
        import torch

        tensor_of(buf.view(np.int16)).view(torch.bfloat16).copy_(tensor_of(x))
        return {}, buf

    def decode_raw(self, n: int, params: dict, raw, out: np.ndarray) -> None:
        h = np.frombuffer(raw, _U16, n)
        np.left_shift(h, 16, out=out.view(np.uint32), dtype=np.uint32)

