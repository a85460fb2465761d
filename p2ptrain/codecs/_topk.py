"""top-k: keep the k largest-magnitude values of a chunk, exactly, with their indices.

k = max(1, ceil(RATIO * n)) for n > 0 (0 for n = 0), computed from the exact decimal
RATIO, so sender and receiver always agree on k without it being sent. Payload: k
little-endian float32 values in index order, then k index deltas (``idx[i] - idx[i-1]``,
with ``idx[-1] = -1``, so every delta is >= 1) as uint8, uint16 or uint32, the narrowest
that fits; the width is the one param, ``w``.
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np

from p2ptrain.codecs import _topk_kernels
from p2ptrain.codecs._codec import check_domain
from p2ptrain.errors import CodecError, ConfigError

_F4 = np.dtype("<f4")
_ABS = np.uint32(0x7FFFFFFF)
_SAMPLE = 4096  # values sampled to find a low bound for the top-k cut ...
_RUN = 4  # ... in runs of this many neighbours (a quarter of the cache lines to fetch)
_DEEPER = 8  # where a bound let fewer than k through: once more, this many times as deep in the sample
_DELTA = {1: np.dtype("u1"), 2: np.dtype("<u2"), 4: np.dtype("<u4")}


class TopK:
    """Top-k by magnitude; ties on |x| go to the lowest index. Param ``w``: delta width.

    Error bound: kept values are exact (``y[i] == x[i]``), every other ``y[i]`` is 0, and
    every dropped value is no larger in magnitude than the smallest kept one, so
    ``|x - y| <= min over kept |x|`` per value (the k-th largest |x| of the chunk).

    Selection makes three passes over the chunk (|x| as bits, a compare against a bound
    taken from a sample, the indices above it) into scratch arrays kept between calls
    (an instance serves one thread at a time); the rest works on the few candidates.
    """

    name = "topk"
    params = {"w": int}

    def __init__(self, ratio: Fraction):
        if not 0 < ratio <= 1:
            raise ValueError("topk ratio must be in (0, 1]")
        self.ratio = ratio
        self._num, self._den = ratio.numerator, ratio.denominator  # Fraction's are properties
        self._mag = np.empty(0, np.uint32)
        self._mask = np.empty(0, np.bool_)
        self._idx = np.empty(0, np.intp)  # (the compiled pass's candidates: ``_topk_kernels``, ...
        self._cmag = np.empty(0, np.uint32)  # ... and their |x| bits)
        _topk_kernels.warm()  # (now, not in a round)

    @property
    def compiled(self) -> bool:  # (``Codec.compiled``)
        return _topk_kernels.load() is not None

    def k(self, n: int) -> int:
        if n == 0:
            return 0
        return max(1, -(-self._num * n // self._den))

    def max_raw(self, n: int) -> int:
        return 8 * self.k(n)

    def raw_size(self, n: int, params: dict) -> int:
        if params["w"] not in _DELTA:
            raise CodecError(f"topk index width {params['w']} is not 1, 2 or 4")
        return (4 + params["w"]) * self.k(n)

    encodes_residual = True  # (``encode_raw(x, residual)``: the residual made on the way, ``Codec``)

    def select(self, x: np.ndarray, copy: np.ndarray | None = None) -> np.ndarray:
        """Sorted indices of the k largest |x| (ties to the lowest index). With ``copy`` (float32,
        as long as ``x``, apart from it): ``x`` copied there too, in the same pass where it can be."""
        n, k = x.size, self.k(x.size)
        copied = copy is None
        if k == n:
            if not copied:
                np.copyto(copy, x)
            return np.arange(n)
        # |x| as integer bits: the same order as |x| for finite floats, NaN and inf above
        # them all, and exact ties.
        bits = x.view(np.uint32)
        bound = _bound(bits, k)
        kernels = _topk_kernels.load()
        cand = mag = sub = None
        if kernels is not None and bound:  # (one compiled pass; a bound of 0: numpy's rule for zeros)
            if self._idx.size < n:
                self._idx, self._cmag = np.empty(n, np.intp), np.empty(n, np.uint32)
            if copied:
                count = kernels.above(bits, np.uint32(bound), self._idx, self._cmag)
            else:
                count = kernels.above_copy(bits, np.uint32(bound), self._idx, self._cmag, copy.view(np.uint32))
                copied = True
            if count < k:  # (the sample's bound was too high: rare, and one more pass, not a sort of all)
                bound = _bound(bits, k, _DEEPER)
                count = kernels.above(bits, np.uint32(bound), self._idx, self._cmag) if bound else 0
            if k <= count <= n // 2:  # (else all are candidates, as ``_candidates`` says)
                cand, sub = self._idx[:count], self._cmag[:count]
        if cand is None:
            if self._mag.size < n:
                self._mag, self._mask = np.empty(n, np.uint32), np.empty(n, np.bool_)
            mag = np.bitwise_and(bits, _ABS, out=self._mag[:n])
            if kernels is None or not bound:
                cand = _candidates(mag, k, bound, self._mask[:n])
        if sub is None:
            sub = mag if cand is None else np.bitwise_and(bits[cand], _ABS)
        # np.sort, not np.partition: partition gets ~50x slower when one value (zero, in
        # sparse gradients) fills much of the array, and cand is small in the usual case.
        cut = np.sort(sub)[sub.size - k]
        take = sub > cut
        short = k - int(np.count_nonzero(take))
        if short:
            take[(sub == cut).nonzero()[0][:short]] = True
        chosen = take.nonzero()[0]
        if not copied:
            np.copyto(copy, x)
        return chosen if cand is None else cand[chosen]

    def encode_raw(self, x: np.ndarray, residual: np.ndarray | None = None) -> tuple[dict, np.ndarray]:
        """The payload; with ``residual`` (as long as ``x``, apart from it), ``x - decode`` written
        there too: x itself with the kept values zeroed (they are exact), x copied as it is read."""
        k = self.k(x.size)
        if k == 0:
            if residual is not None:
                np.copyto(residual, x)
            return {"w": 1}, np.empty(0, np.uint8)
        if x.size >= 1 << 32:
            raise ConfigError("topk chunks must hold fewer than 2**32 values")
        idx = self.select(x, residual)
        vals = x[idx]
        # A non-finite or huge value would be among the kept ones: checking them suffices.
        check_domain(self.name, float(np.abs(vals).max()))
        deltas = np.empty(k, np.int64)
        deltas[0] = idx[0] + 1
        np.subtract(idx[1:], idx[:-1], out=deltas[1:])
        top = int(deltas.max())
        w = 1 if top < 1 << 8 else 2 if top < 1 << 16 else 4
        buf = np.empty((4 + w) * k, np.uint8)
        buf[: 4 * k].view(_F4)[:] = vals
        buf[4 * k :].view(_DELTA[w])[:] = deltas
        if residual is not None:
            residual[idx] = 0
        return {"w": w}, buf

    def decode_raw(self, n: int, params: dict, raw, out: np.ndarray) -> None:
        idx, vals = self._kept(n, params, raw)
        out.fill(0)
        out[idx] = vals

    def residual_raw(self, params: dict, raw, x: np.ndarray, out: np.ndarray) -> None:
        """``out = x - decode``: x itself, with the kept values zeroed (they are exact)."""
        np.copyto(out, x)
        out[self._kept(x.shape[0], params, raw)[0]] = 0

    def add_raw(self, n: int, params: dict, raw, dst: np.ndarray) -> None:
        """``dst += decoded`` touching only the kept values (indices are unique)."""
        idx, vals = self._kept(n, params, raw)
        dst[idx] += vals

    def _kept(self, n: int, params: dict, raw) -> tuple[np.ndarray, np.ndarray]:
        """Validated (indices, values) of a payload: strictly increasing, inside [0, n)."""
        k = self.k(n)
        if k == 0:
            return np.empty(0, np.int64), np.empty(0, _F4)
        vals = np.frombuffer(raw, _F4, k)
        deltas = np.frombuffer(raw, _DELTA[params["w"]], k, offset=4 * k)
        if deltas.min() < 1:
            raise CodecError("topk index repeated (delta 0)")
        idx = np.cumsum(deltas, dtype=np.int64)
        if idx[-1] > n:
            raise CodecError("topk index out of range")
        idx -= 1
        return idx, vals


def _bound(bits: np.ndarray, k: int, deeper: int = 1) -> int | None:
    """A low bound on the top k's |x| bits, from a sample spread over the chunk (``bits``: its
    values read as uint32): ~4 sigma (plus 16) lower than the sample says the cut is, ``deeper``
    times that rank where a first bound let too few through. None where the sample is too small
    to say (all values are then candidates). A large chunk is sampled in runs of ``_RUN``
    neighbours (one cache line fetched per run, not per value: 0.19 -> 0.05 ms a 512 K chunk
    from memory); neighbours alike make the bound looser or tighter than 4 sigma, which costs a
    larger sort or, rarely, a second pass (``select``), never a wrong selection."""
    n = bits.size
    runs = n // _RUN
    if runs > _SAMPLE:
        picked = bits[: runs * _RUN].reshape(runs, _RUN)[:: runs // (_SAMPLE // _RUN)].ravel()
    else:
        picked = bits[:: max(1, n // _SAMPLE)]
    sample = np.sort(np.bitwise_and(picked, _ABS))
    expect = sample.size * k / n
    rank = int(expect + 4 * expect**0.5 + 16) * deeper
    return int(sample[sample.size - rank]) if rank < sample.size else None


def _candidates(mag: np.ndarray, k: int, bound: int | None, mask: np.ndarray) -> np.ndarray | None:
    """Sorted indices of a small superset of the top k (None: all): mag at or above ``bound``
    (``_bound``).

    If too few values pass it anyway, all indices are candidates. Either way every value
    outside ranks below at least k inside, so the result is exact. A chunk that is mostly
    zeros (an embedding's gradient: only the rows of the batch's tokens) gets a bound of 0,
    which everything passes: its candidates are then the non-zeros, plus the first k indices
    when the non-zeros are fewer than k (those hold the lowest-index zeros that fill the top
    k). Sorting all of it cost ~20x more. ``mask`` is scratch of mag's length.
    """
    n = mag.size
    if bound is None:
        return None
    if bound:
        np.greater_equal(mag, bound, out=mask)
    elif np.count_nonzero(np.not_equal(mag, 0, out=mask)) < k:
        mask[:k] = True
    cand = _nonzero(mask)
    if k <= cand.size <= n // 2:  # past half, gathering costs more than it saves
        return cand
    return None


def _nonzero(mask: np.ndarray) -> np.ndarray:
    """``mask.nonzero()[0]`` for a sparse 1-D bool mask, about twice as fast.

    numpy's nonzero skips zero bytes eight at a time, a branch that a mask with ~2% of
    its values set at random mispredicts often (~0.4 ns per value). Here it runs on the
    mask packed to bits (one byte per 8 values), then on the bits of the non-zero bytes.
    """
    packed = np.packbits(mask, bitorder="little")
    at = np.not_equal(packed, 0).nonzero()[0]
    bits = np.unpackbits(packed[at], bitorder="little").view(np.bool_).nonzero()[0]
    return at[bits >> 3] * 8 + (bits & 7)
