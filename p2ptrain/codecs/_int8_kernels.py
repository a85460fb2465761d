"""int8's passes as compiled loops (numba), where numba is installed and ``P2PTRAIN_NUMBA`` is
not 0; ``load()`` returns None otherwise, and ``_int8`` runs torch's kernels instead.

Why. torch and numpy run each pass of a chunk as a call of their own: the int8 encode with its
residual was about a dozen of them (|x|, the block maxima, the scales, x / scale, the rounding,
the cast, the decode, the subtraction), each over the chunk or a tail of it, with ~10 us of
dispatch apiece. A ring chunk is 128 K values, so dispatch was half of it and the passes'
memory traffic the rest. Here each pass is one loop, compiled with fixed 256-value inner loops
that LLVM turns into SIMD code: measured on 2 cores (AMD EPYC) over 125,000 values, encode with
residual 0.27-0.35 -> 0.045-0.058 ms, decode 0.08-0.11 -> 0.029 ms, decode-and-add 0.12 ->
0.025 ms.

The same floats, bit for bit, as the torch passes (``tests/test_codecs_int8``): IEEE
float32 operations one at a time, in the same order (numba compiles without fast-math, so
nothing is fused into an FMA or reordered), rounding half to even (``np.rint``).

Compiled on first use (about 2 s) and cached beside this file (``cache=True``; numba falls
back to a user-wide cache directory where that is not writable); ``join`` loads them before
its peer opens (``warm``, as every int8 codec is made), so no round waits for the compiler.
"""

from __future__ import annotations

import numpy as np

from p2ptrain import jit

BLOCK = 256  # (``_int8.BLOCK``: the kernels' inner loops are this long)


def _warm(k) -> None:
    """Every kernel once, on tiny arrays (``jit.Kernels.warm``: every int8 codec calls it as it is
    made, ``parse_codec``: ``join`` at its start, a ``Peer`` as it is built)."""
    x = np.linspace(-1, 1, BLOCK + 3, dtype=np.float32)
    nb = -(-x.size // BLOCK)
    scales, codes, out = np.empty(nb, np.float32), np.empty(x.size, np.int8), np.empty_like(x)
    for with_residual in (False, True):
        k.encode(x, scales, codes, out, with_residual)
    k.residual(x, scales, codes, out)
    raw = bytes(scales.tobytes() + codes.tobytes())  # (received payloads are read-only views)
    for add in (False, True):
        k.decode(scales, codes, out, add)
        k.decode(np.frombuffer(raw, np.float32, nb), np.frombuffer(raw, np.int8, x.size, 4 * nb), out, add)
    got_scales, got_codes = np.frombuffer(raw, np.float32, nb), np.frombuffer(raw, np.int8, x.size, 4 * nb)
    for with_residual in (False, True):
        for final in (False, True):
            k.add_encode(got_scales, got_codes, out, np.empty(nb, np.float32), np.empty(x.size, np.int8),
                         np.empty_like(x), with_residual, final)


def _compile(numba):
    import types

    njit = jit.njit(numba)
    abs_bits = np.int32(0x7FFFFFFF)  # clears the sign bit of a float32 read as int32
    max_bits = np.int32(0x7F000000)  # 2**127's bits: above them, inf and NaN (``_codec.MAX_ABS``)
    min_scale = np.float32(2.0**-126)  # (``_int8._MIN_SCALE``)
    f127, one, zero = np.float32(127.0), np.float32(1.0), np.float32(0.0)
    max_scale = np.float32(2.0**127) / f127  # (``_int8._MAX_SCALE``: decoding with it cannot overflow)

    @njit
    def encode(x, scales, codes, out, residual):
        """Scales of every block and the codes; with ``residual``, what they drop, ``x - code *
        scale`` (as ``residual`` computes it), into ``out``. False where a value is NaN, inf or
        above 2**127 in magnitude (the codes are then garbage: they are the caller's fresh
        buffer). Without a residual, a block's codes come just after its largest |x|, while it
        is in the cache: one pass (16 M values in 128 K chunks on 2 cores: 7.3 ms against 8.9
        for two). With one, every block's largest |x| first, so that a refused chunk leaves
        ``out`` as it was, then the codes and what they drop, as two loops a block: two passes
        (15.0-15.4 ms against 17.2-17.3 with one loop and a branch; writing the codes in the first
        pass took 18.7). The scale and codes loops are written out in both passes: as functions
        of their own, even inlined by numba, they ran 15-90 % slower.
        |x| as integer bits orders as |x| does."""
        n = x.size
        full = n // BLOCK
        bits = x.view(np.int32)
        peaks = scales.view(np.int32)
        worst = np.int32(0)
        for b in range(full + (full * BLOCK < n)):
            lo = b * BLOCK
            hi = min(lo + BLOCK, n)
            m = np.int32(0)
            if hi - lo == BLOCK:
                block = bits[lo : lo + BLOCK]
                for j in range(BLOCK):
                    m = max(m, block[j] & abs_bits)
            else:
                for i in range(lo, hi):
                    m = max(m, bits[i] & abs_bits)
            worst = max(worst, m)
            peaks[b] = m
            if not residual:
                s = max(scales[b] / f127, min_scale)
                scales[b] = s
                inv = one / s
                if hi - lo == BLOCK:
                    xb, cb = x[lo : lo + BLOCK], codes[lo : lo + BLOCK]
                    for j in range(BLOCK):
                        cb[j] = np.int8(np.rint(xb[j] * inv))
                else:
                    for i in range(lo, hi):
                        codes[i] = np.int8(np.rint(x[i] * inv))
        if worst > max_bits:
            return False
        if not residual:
            return True
        for b in range(full + (full * BLOCK < n)):
            s = max(scales[b] / f127, min_scale)
            scales[b] = s
            inv = one / s
            lo = b * BLOCK
            hi = min(lo + BLOCK, n)
            if hi - lo == BLOCK:
                xb, cb, ob = x[lo : lo + BLOCK], codes[lo : lo + BLOCK], out[lo : lo + BLOCK]
                for j in range(BLOCK):
                    cb[j] = np.int8(np.rint(xb[j] * inv))
                for j in range(BLOCK):
                    ob[j] = xb[j] - np.float32(cb[j]) * s
            else:
                for i in range(lo, hi):
                    codes[i] = np.int8(np.rint(x[i] * inv))
                    out[i] = x[i] - np.float32(codes[i]) * s
        return True

    @njit
    def residual(x, scales, codes, out):
        """out = x - code * scale: what the encode dropped (as decoding then subtracting)."""
        n = out.size
        for b in range(scales.size):
            s, lo = scales[b], b * BLOCK
            if lo + BLOCK <= n:
                xb, ob, cb = x[lo : lo + BLOCK], out[lo : lo + BLOCK], codes[lo : lo + BLOCK]
                for j in range(BLOCK):
                    ob[j] = xb[j] - np.float32(cb[j]) * s
            else:
                for i in range(lo, n):
                    out[i] = x[i] - np.float32(codes[i]) * s

    @njit
    def decode(scales, codes, out, add):
        """out = code * scale, or with ``add``, out += code * scale (the product rounded first,
        as decoding then adding). False, ``out`` untouched, where a scale is NaN, infinite,
        negative or above ``max_scale`` (a garbled or hostile payload): checked here, in a
        loop over the scales alone, because numpy's min and max of them cost 8-10 us a chunk,
        a tenth of a loopback peer's CPU at 16 K-value chunks."""
        for b in range(scales.size):
            if not (scales[b] >= zero and scales[b] <= max_scale):  # (NaN fails both)
                return False
        n = out.size
        for b in range(scales.size):
            s, lo = scales[b], b * BLOCK
            if lo + BLOCK <= n:
                ob, cb = out[lo : lo + BLOCK], codes[lo : lo + BLOCK]
                if add:
                    for j in range(BLOCK):
                        ob[j] = ob[j] + np.float32(cb[j]) * s
                else:
                    for j in range(BLOCK):
                        ob[j] = np.float32(cb[j]) * s
            elif add:
                for i in range(lo, n):
                    out[i] = out[i] + np.float32(codes[i]) * s
            else:
                for i in range(lo, n):
                    out[i] = np.float32(codes[i]) * s
        return True

    @njit
    def add_encode(got_scales, got_codes, dst, scales, codes, out, residual, final):
        """A reduce-scatter hop: ``dst + got_code * got_scale`` (as ``decode`` adds) encoded into
        ``scales`` and ``codes`` (as ``encode`` does), with ``residual`` what that drops into
        ``out``, and with ``final`` (the sum is one of our own segments') ``dst`` replaced by the
        decoded sum (as ``decode`` writes it); without, ``dst`` is only read. The same floats as
        those calls, a block at a time while it is in the cache: 8 M values in 512 K chunks from
        memory, final, 10.3-11.3 -> 6.7-7.0 ms (12.8-13.4 -> 7.9-8.8 with the residual). Returns
        0, nothing written, where a received scale is bad (as ``decode``); -1 where the sum holds
        NaN, inf or a value above 2**127 (``dst`` may then hold garbage); else 1."""
        for b in range(got_scales.size):
            if not (got_scales[b] >= zero and got_scales[b] <= max_scale):  # (NaN fails both)
                return 0
        n = dst.size
        peaks = scales.view(np.int32)
        total = np.empty(BLOCK, np.float32)  # (one block of the sum, in the cache)
        total_bits = total.view(np.int32)
        worst = np.int32(0)
        for b in range(got_scales.size):
            lo = b * BLOCK
            hi = min(lo + BLOCK, n)
            got = got_scales[b]
            m = np.int32(0)
            if hi - lo == BLOCK:
                db, gb = dst[lo : lo + BLOCK], got_codes[lo : lo + BLOCK]
                for j in range(BLOCK):
                    total[j] = db[j] + np.float32(gb[j]) * got
                for j in range(BLOCK):
                    m = max(m, total_bits[j] & abs_bits)
            else:
                for i in range(lo, hi):
                    total[i - lo] = dst[i] + np.float32(got_codes[i]) * got
                    m = max(m, total_bits[i - lo] & abs_bits)
            worst = max(worst, m)
            peaks[b] = m
            s = max(scales[b] / f127, min_scale)
            scales[b] = s
            inv = one / s
            if hi - lo == BLOCK:
                db, cb, ob = dst[lo : lo + BLOCK], codes[lo : lo + BLOCK], out[lo : lo + BLOCK]
                for j in range(BLOCK):
                    cb[j] = np.int8(np.rint(total[j] * inv))
                if residual:
                    for j in range(BLOCK):
                        ob[j] = total[j] - np.float32(cb[j]) * s
                if final:
                    for j in range(BLOCK):
                        db[j] = np.float32(cb[j]) * s
            else:
                for i in range(lo, hi):
                    codes[i] = np.int8(np.rint(total[i - lo] * inv))
                    if residual:
                        out[i] = total[i - lo] - np.float32(codes[i]) * s
                    if final:
                        dst[i] = np.float32(codes[i]) * s
        return 1 if worst <= max_bits else -1

    return types.SimpleNamespace(encode=encode, decode=decode, residual=residual, add_encode=add_encode)


_KERNELS = jit.Kernels(_compile, _warm, "int8")
load, warm = _KERNELS.load, _KERNELS.warm  # (``jit.Kernels``: None / False where numba is not in use)
