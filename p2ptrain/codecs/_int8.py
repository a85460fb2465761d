"""int8: blockwise absmax quantization, one float32 scale per block of 256 values.

Blocks keep one outlier from flattening a whole chunk to zero: only its own 256
neighbours share its scale. Payload: ``ceil(n/256)`` little-endian float32 scales, then
``n`` int8 codes. No params of its own (the block size is fixed by the codec).
"""

from __future__ import annotations

import numpy as np

from p2ptrain.codecs._codec import MAX_ABS, check_domain
from p2ptrain.errors import CodecError

BLOCK = 256
_F4 = np.dtype("<f4")
# The smallest scale: keeps 1/scale finite and the scale a normal float32, so blocks of
# zeros or of subnormals quantize like any other (at a 2**-127 absolute error floor).
_MIN_SCALE = np.float32(2.0**-126)
# The largest scale an honest encoder can send (absmax <= 2**127); decoding with it
# cannot overflow float32.
_MAX_SCALE = np.float32(MAX_ABS) / np.float32(127)
_ABS = np.uint32(0x7FFFFFFF)


def _blocks(n: int) -> int:
    return -(-n // BLOCK)


class Int8:
    """int8 codes ``q = rint(x / scale)`` with ``scale = max(absmax_b / 127, 2**-126)`` per block.

    Error bound, per value in block b:
    ``|x - y| <= (1 + 2**-12) * max(absmax_b / 254, 2**-127)``
    (half a quantization step, plus float32 rounding of the scale and of ``q * scale``).
    """

    name = "int8"
    params: dict = {}

    def __init__(self) -> None:
        self._tmp = np.empty(0, np.float32)  # scratch kept between calls (one thread at a time)

    def max_raw(self, n: int) -> int:
        return n + 4 * _blocks(n)

    def raw_size(self, n: int, params: dict) -> int:
        return self.max_raw(n)

    def encode_raw(self, x: np.ndarray) -> tuple[dict, np.ndarray]:
        n = x.size
        nb, full = _blocks(n), n // BLOCK * BLOCK
        buf = np.empty(4 * nb + n, np.uint8)
        scales = buf[: 4 * nb].view(_F4)
        codes = buf[4 * nb :].view(np.int8)
        if n == 0:
            return {}, buf
        if self._tmp.size < n:
            self._tmp = np.empty(n, np.float32)
        # One float32 scratch array serves for |x| (to find each block's absmax) and then
        # for x / scale before rounding. |x| is taken as integer bits: they order as |x|
        # does (NaN above inf above the rest) and numpy's integer max runs ~2x its float max.
        tmp = self._tmp[:n]
        mag = np.bitwise_and(x.view(np.uint32), _ABS, out=tmp.view(np.uint32))
        nfull = full // BLOCK
        np.max(mag[:full].reshape(nfull, BLOCK), axis=1, out=scales[:nfull].view(np.uint32))
        if full < n:
            scales[nfull : nfull + 1].view(np.uint32)[0] = mag[full:].max()
        check_domain(self.name, float(scales.max()))
        np.divide(scales, np.float32(127), out=scales)
        np.maximum(scales, _MIN_SCALE, out=scales)
        inv = np.divide(np.float32(1), scales)
        np.multiply(x[:full].reshape(nfull, BLOCK), inv[:nfull, None], out=tmp[:full].reshape(nfull, BLOCK))
        if full < n:
            np.multiply(x[full:], inv[nfull], out=tmp[full:])
        # |x / scale| <= 127 * (1 + 2**-22) < 127.5, so the codes fit int8 without clipping.
        # Rounded in place, then cast (exact: whole numbers): 25 % quicker than one rint into int8.
        np.rint(tmp, out=tmp)
        np.copyto(codes, tmp, casting="unsafe")
        return {}, buf

    def decode_raw(self, n: int, params: dict, raw, out: np.ndarray) -> None:
        nb, full = _blocks(n), n // BLOCK * BLOCK
        if n == 0:
            return
        scales = np.frombuffer(raw, _F4, nb)
        # NaN fails both comparisons, so NaN, inf, negative and oversized scales are refused.
        if not (scales.min() >= 0 and scales.max() <= _MAX_SCALE):
            raise CodecError("int8 block scale is NaN, infinite, negative or too large")
        codes = np.frombuffer(raw, np.int8, n, offset=4 * nb)
        nfull = full // BLOCK
        # The codes widened into ``out`` first (exact), then scaled in place: the same products
        # as one multiply of int8 by float32, which numpy runs through a buffered cast (30 %
        # slower on large chunks).
        np.copyto(out, codes, casting="unsafe")
        blocks = out[:full].reshape(nfull, BLOCK)
        np.multiply(blocks, scales[:nfull, None], out=blocks)
        if full < n:
            np.multiply(out[full:], scales[nfull], out=out[full:])
