"""Gradient codecs for the ring-allreduce: none, fp16, bf16, int8 (blockwise), top-k, + zstd.

Sans-I/O: codecs take float32 chunks and bytes and return bytes and floats; they open no
socket, read no clock and start no thread.

Theory of operation. ``parse_codec(spec)`` builds a ``Codec`` from a spec string (grammar
in ``_spec``; ``CODEC_CHOICES`` lists the forms). ``codec.encode(x)`` turns a 1-D float32
chunk into an ``Encoded``: small msgpack-able ``params`` for the frame header and a
payload. The receiver, which knows the chunk's length ``n`` from the ring schedule,
refuses payloads over ``codec.max_payload(n)`` before reading them, then calls
``codec.decode(params, payload, out)``. A sender that needs the decoded values itself
(error feedback, the ring's owner adopting its final sum) gets them from
``codec.encode_decoded(x, out)``, without decoding its own bytes. Nothing in a payload
or its params sizes an allocation without being checked against ``n``. Decoding is pure
IEEE float32 arithmetic, so the same bytes give bit-identical floats on every peer: the
ring relies on it when each segment's owner encodes the final sum once and everyone
decodes it.

Error bounds, per value (y decoded from x; absmax over the chunk, absmax_b over x's block
of 256), each stated again in its transform's docstring and checked as such by the tests:

    none   y == x, bit for bit
    fp16   |x - y| <= 2**-11 |x| + 2**-39 absmax + 2**-149     (power-of-two chunk scale)
    bf16   |x - y| <= 2**-8 |x| + 2**-134
    int8   |x - y| <= (1 + 2**-12) max(absmax_b / 254, 2**-127)   (float32 scale per block)
    topk   kept values exact, the rest 0; no dropped |x| exceeds a kept one

Lossy codecs take finite input with |x| <= 2**127 and raise NotFiniteError (a ConfigError) otherwise.
``residual_of`` gives the error-feedback residual.

Decoders validate structure (params, lengths, scales, indices, zstd frame sizes), not
each value; ``none`` refuses NaN and inf at encode too (``check_finite``), and the ring
refuses a final sum that comes holding them (``check_received``), whatever the codec.

Errors: a payload that fails validation raises ``CodecError`` (the peer's fault) and
nothing else; a bad spec, or a bad ``x``/``out`` from our own caller, ``ConfigError``.
"""

from __future__ import annotations

from p2ptrain.codecs._codec import Codec, Encoded, encodable
from p2ptrain.codecs._spec import CODEC_CHOICES, parse_codec
from p2ptrain.codecs.feedback import residual_of

__all__ = ["CODEC_CHOICES", "Codec", "Encoded", "encodable", "parse_codec", "residual_of"]
