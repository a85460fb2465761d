"""int8: blockwise absmax quantization, one float32 scale per block of 256 values.

Blocks keep one outlier from flattening a whole chunk to zero: only its own 256
neighbours share its scale. Payload: ``ceil(n/256)`` little-endian float32 scales, then
``n`` int8 codes. No params of its own (the block size is fixed by the codec).
"""

from __future__ import annotations

import numpy as np

from p2ptrain.codecs import _int8_kernels
from p2ptrain.codecs._codec import MAX_ABS, Scratch, check_domain, tensor_of
from p2ptrain.errors import CodecError

BLOCK = 256
_F4 = np.dtype("<f4")
# The smallest scale: keeps 1/scale finite and the scale a normal float32, so blocks of
# zeros or of subnormals quantize like any other (at a 2**-127 absolute error floor).
_MIN_SCALE = np.float32(2.0**-126)
_NO_RESIDUAL = np.empty(0, np.float32)  # (the encode kernel's out where no residual is asked for)
# The largest scale an honest encoder can send (absmax <= 2**127); decoding with it
# cannot overflow float32.
_MAX_SCALE = np.float32(MAX_ABS) / np.float32(127)
_ABS = 0x7FFFFFFF  # clears the sign bit of a float32 read as int32


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
        self._tmp = Scratch()
        _int8_kernels.warm()  # (now, not in a round: see there)

    @property
    def compiled(self) -> bool:  # (``Codec.compiled``)
        return _int8_kernels.load() is not None

    def max_raw(self, n: int) -> int:
        return n + 4 * _blocks(n)

    def raw_size(self, n: int, params: dict) -> int:
        return self.max_raw(n)

    @property
    def encodes_residual(self) -> bool:
        """``encode_raw(x, residual)`` writes the residual in the codes' pass: with the kernels
        only (``Codec`` encodes, then ``residual_raw``, where it is False)."""
        return self.compiled

    def encode_raw(self, x: np.ndarray, residual: np.ndarray | None = None) -> tuple[dict, np.ndarray]:
        """The payload; with ``residual`` (as long as ``x``, apart from it; only where
        ``encodes_residual``), ``x - decode`` there too, as ``residual_raw`` would write it."""
        n = x.size
        full = n // BLOCK * BLOCK
        buf, scales, codes = _new_payload(n)
        if n == 0:
            return {}, buf
        kernels = _int8_kernels.load()
        if kernels is not None:
            if not kernels.encode(x, scales, codes, *_residual_out(residual)):
                check_domain(self.name, float("nan"))  # (raises: NaN, inf or too large)
            return {}, buf
        # torch's kernels (``tensor_of``): numpy's per-block max reduces each 256-value row alone.
        import torch

        xs, tmp = tensor_of(x), tensor_of(self._tmp.take(n))
        # One float32 scratch array serves for |x| (to find each block's absmax) and then
        # for x / scale before rounding. |x| is taken as integer bits: they order as |x|
        # does (NaN above inf above the rest), and an integer max is quicker than a float one.
        mag = torch.bitwise_and(xs.view(torch.int32), _ABS, out=tmp.view(torch.int32))
        nfull = full // BLOCK
        peaks = tensor_of(scales.view(np.int32))
        torch.amax(mag[:full].view(nfull, BLOCK), 1, out=peaks[:nfull])
        if full < n:
            torch.amax(mag[full:], 0, out=peaks[nfull])
        check_domain(self.name, float(scales.max()))
        np.divide(scales, np.float32(127), out=scales)
        np.maximum(scales, _MIN_SCALE, out=scales)
        inv = tensor_of(np.divide(np.float32(1), scales))
        torch.mul(xs[:full].view(nfull, BLOCK), inv[:nfull, None], out=tmp[:full].view(nfull, BLOCK))
        if full < n:
            torch.mul(xs[full:], inv[nfull], out=tmp[full:])
        # |x / scale| <= 127 * (1 + 2**-22) < 127.5, so the codes fit int8 without clipping.
        # Rounded in place (half to even, as np.rint), then cast (exact: whole numbers).
        tmp.round_()
        tensor_of(codes).copy_(tmp)
        return {}, buf

    def decode_raw(self, n: int, params: dict, raw, out: np.ndarray) -> None:
        if n == 0:
            return
        kernels = _int8_kernels.load()
        if kernels is not None:
            return _refuse_unless(kernels.decode(*_payload(n, raw), out, False))
        scales, codes = _checked(*_payload(n, raw))
        nb, full = _blocks(n), n // BLOCK * BLOCK
        nfull = full // BLOCK
        # The codes widened into ``out`` first (exact), then scaled in place by torch: the same
        # float32 products as one multiply of int8 by float32, which numpy runs 3x slower.
        np.copyto(out, codes, casting="unsafe")
        dst, scale = tensor_of(out), tensor_of(scales)
        dst[:full].view(nfull, BLOCK).mul_(scale[:nfull, None])
        if full < n:
            dst[full:].mul_(scale[nfull])

    def add_raw(self, n: int, params: dict, raw, dst: np.ndarray) -> None:
        """``dst += decoded`` (decoded first, then added: the same floats as ``decode_raw``
        into a scratch array and ``np.add``), in one pass where the kernels are in use."""
        kernels = _int8_kernels.load()
        if kernels is None:
            scratch = self._tmp.take(n)
            self.decode_raw(n, params, raw, scratch)
            np.add(dst, scratch, out=dst)
        elif n:
            _refuse_unless(kernels.decode(*_payload(n, raw), dst, True))

    @property
    def fuses_add_encode(self) -> bool:
        """``add_encode_raw`` is one pass: with the kernels only (``Codec.add_encode``)."""
        return self.compiled

    def add_encode_raw(self, n: int, params: dict, raw, dst: np.ndarray, residual: np.ndarray | None,
                       final: bool) -> tuple[dict, np.ndarray]:
        """The payload of ``dst`` plus ``raw``'s values (with ``residual``: what it drops, there),
        and with ``final`` ``dst`` replaced by its decoded values, in one pass (the kernels only:
        ``fuses_add_encode``). A bad received scale refuses the chunk before anything is
        written (CodecError); a sum that cannot be encoded raises as ``encode_raw`` does."""
        buf, scales, codes = _new_payload(n)
        if n == 0:
            return {}, buf
        done = _int8_kernels.load().add_encode(*_payload(n, raw), dst, scales, codes, *_residual_out(residual), final)
        _refuse_unless(done != 0)
        if done < 0:
            check_domain(self.name, float("nan"))  # (raises: NaN, inf or too large)
        return {}, buf

    def residual_raw(self, params: dict, raw, x: np.ndarray, out: np.ndarray) -> None:
        """``out = x - decoded`` (decoding then subtracting), in one pass where the kernels are in use."""
        kernels = _int8_kernels.load()
        if kernels is None:
            self.decode_raw(x.shape[0], params, raw, out)
            np.subtract(x, out, out=out)
        elif x.shape[0]:
            kernels.residual(x, *_checked(*_payload(x.shape[0], raw)), out)


def _new_payload(n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A fresh payload buffer for ``n`` values, and its scales and codes as views of it."""
    nb = _blocks(n)
    buf = np.empty(4 * nb + n, np.uint8)
    return buf, buf[: 4 * nb].view(_F4), buf[4 * nb :].view(np.int8)


def _residual_out(residual: np.ndarray | None) -> tuple[np.ndarray, bool]:
    """The kernels' (out, residual) arguments for an optional residual."""
    return (_NO_RESIDUAL, False) if residual is None else (residual, True)


def _payload(n: int, raw) -> tuple[np.ndarray, np.ndarray]:
    """A payload's (scales, codes) for ``n`` values, not checked yet (the decode kernel checks
    the scales as it reads them; elsewhere ``_checked``)."""
    nb = _blocks(n)
    scales = np.frombuffer(raw, _F4, nb)
    if not scales.flags.aligned:  # (a payload at an odd offset: numba would compile for it anew)
        scales = scales.copy()
    return scales, np.frombuffer(raw, np.int8, n, offset=4 * nb)


def _checked(scales: np.ndarray, codes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    # NaN fails both comparisons, so NaN, inf, negative and oversized scales are refused.
    _refuse_unless(scales.min() >= 0 and scales.max() <= _MAX_SCALE)
    return scales, codes


def _refuse_unless(scales_ok: bool) -> None:
    if not scales_ok:
        raise CodecError("int8 block scale is NaN, infinite, negative or too large")
