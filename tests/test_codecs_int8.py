"""int8 gives, bit for bit, what a plain numpy reference gives.

The reference below is the codec written in the plainest way (one numpy call per step, each
an IEEE float32 operation). Any faster version must produce the same payload bytes and the
same decoded floats for every input, or peers running different versions would disagree.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from p2ptrain import jit
from p2ptrain.codecs import _int8_kernels, parse_codec
from p2ptrain.errors import ConfigError, NotFiniteError
from test_codecs import KINDS, make_chunk

BLOCK = 256
HAVE_NUMBA = _int8_kernels.load() is not None


@pytest.fixture(autouse=True, params=["numba", "torch"])
def passes(request, monkeypatch):
    """Every test here runs on both of int8's implementations: the compiled kernels
    (``_int8_kernels``, where numba is installed) and torch's passes."""
    if request.param == "torch":
        monkeypatch.setattr(_int8_kernels, "load", lambda: None)
    elif not HAVE_NUMBA:
        pytest.skip("numba is not installed (or P2PTRAIN_NUMBA=0): only torch's passes run")
    return request.param


def reference_encode(x: np.ndarray) -> bytes:
    n = x.size
    nb, full = -(-n // BLOCK), n // BLOCK * BLOCK
    scales = np.empty(nb, np.float32)
    mag = np.bitwise_and(x.view(np.uint32), np.uint32(0x7FFFFFFF))
    if full:
        scales[: full // BLOCK] = mag[:full].reshape(-1, BLOCK).max(axis=1).view(np.float32)
    if full < n:
        scales[-1] = mag[full:].max().view(np.float32)
    scales = np.maximum(scales / np.float32(127), np.float32(2.0**-126))
    inv = np.float32(1) / scales
    q = np.rint(x * np.repeat(inv, BLOCK)[:n]).astype(np.int8)
    return scales.astype("<f4").tobytes() + q.tobytes()


def reference_decode(n: int, payload: bytes) -> np.ndarray:
    nb = -(-n // BLOCK)
    scales = np.frombuffer(payload, "<f4", nb)
    codes = np.frombuffer(payload, np.int8, n, offset=4 * nb)
    return (codes.astype(np.float32) * np.repeat(scales, BLOCK)[:n]).astype(np.float32)


def assert_same_as_reference(x: np.ndarray) -> None:
    codec = parse_codec("int8+nozstd")
    enc = codec.encode(x)
    payload = enc.tobytes()
    assert payload == reference_encode(x)
    want = reference_decode(x.size, payload)
    for buf in (payload, memoryview(bytearray(payload))):  # read-only and writeable payloads
        got = np.full(x.size, np.nan, np.float32)
        codec.decode(enc.params, buf, got)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    out = np.empty_like(x)
    codec.encode_decoded(x, out)
    assert np.array_equal(out.view(np.uint32), want.view(np.uint32))
    dst = np.linspace(-3, 3, x.size, dtype=np.float32)
    expected = dst + want
    codec.decode_add(enc.params, payload, dst, np.empty_like(dst))
    assert np.array_equal(dst.view(np.uint32), expected.view(np.uint32))
    residual = np.full(x.size, np.nan, np.float32)
    assert codec.encode_residual(x, residual).tobytes() == payload
    assert np.array_equal(residual.view(np.uint32), (x - want).view(np.uint32))
    inplace = x.copy()  # (the ring's owner decodes its final sum over itself)
    assert codec.encode_decoded(inplace, inplace).tobytes() == payload
    assert np.array_equal(inplace.view(np.uint32), want.view(np.uint32))
    # A reduce-scatter hop adding what came as it encodes the sum (one pass with the kernels):
    # the sum's payload and what it drops, each as the reference makes them from the sum; at
    # the sum's owner (final) the decoded sum in place, elsewhere the values left as they were.
    total = np.linspace(-3, 3, x.size, dtype=np.float32) + want
    total_payload = reference_encode(total)
    total_decoded = reference_decode(x.size, total_payload)
    for final, residual in itertools.product((False, True), (None, np.full(x.size, np.nan, np.float32))):
        dst = np.linspace(-3, 3, x.size, dtype=np.float32)
        assert codec.add_encode(enc.params, payload, dst, residual, final).tobytes() == total_payload
        after = total_decoded if final else np.linspace(-3, 3, x.size, dtype=np.float32)
        assert np.array_equal(dst.view(np.uint32), after.view(np.uint32))
        if residual is not None:
            assert np.array_equal(residual.view(np.uint32), (total - total_decoded).view(np.uint32))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n", [1, 255, 256, 257, 4097, 70_000, 1 << 18])
def test_int8_matches_reference(kind, n):
    assert_same_as_reference(make_chunk(n, kind, n))


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])  # (x 2: both passes)
@given(x=arrays(np.float32, st.integers(1, 1300),
                elements=st.floats(-(2.0**127), 2.0**127, width=32, allow_subnormal=True)))
def test_int8_matches_reference_on_any_finite_values(x):
    assert_same_as_reference(x)


def test_int8_rounds_half_to_even_like_the_reference():
    # Blocks whose absmax is 127 make the scale 1: x / scale lands exactly on the halves.
    x = np.tile(np.array([127.0, -0.5, 0.5, 1.5, 2.5, -1.5, -2.5, 126.5], np.float32), 64)
    assert_same_as_reference(x)
    assert np.array_equal(np.frombuffer(reference_encode(x), np.int8, 8, offset=8),
                          [127, 0, 0, 2, 2, -2, -2, 126])


def test_int8_reads_a_read_only_input():
    x = make_chunk(1000, "normal", 3)
    x.flags.writeable = False
    assert_same_as_reference(x)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf, 3e38])
@pytest.mark.parametrize("where", [0, 300, 999])
def test_int8_refuses_nonfinite_anywhere(bad, where):
    x = np.ones(1000, np.float32)
    x[where] = bad
    with pytest.raises(ConfigError):
        parse_codec("int8").encode(x)


@pytest.mark.parametrize("bad", [np.nan, np.inf, 3e38])
def test_int8_refusal_leaves_the_values_and_the_residual_as_they_were(bad):
    x = make_chunk(1000, "normal", 4)
    x[700] = bad
    before, residual = x.copy(), np.full(1000, 7.0, np.float32)
    codec = parse_codec("int8")
    for call in (lambda: codec.encode_decoded(x, x), lambda: codec.encode_residual(x, residual)):
        with pytest.raises(ConfigError):
            call()
        assert np.array_equal(x.view(np.uint32), before.view(np.uint32))
        assert (residual == 7.0).all()


@pytest.mark.parametrize("bad", [np.nan, np.inf, 3e38])
def test_a_sum_that_int8_cannot_carry_is_refused_as_its_encode_is(bad):
    x = make_chunk(1000, "normal", 5)
    codec = parse_codec("int8")
    enc = codec.encode(x)
    dst = np.ones(1000, np.float32)
    dst[600] = bad
    with pytest.raises(NotFiniteError):
        codec.add_encode(enc.params, enc.tobytes(), dst, np.empty(1000, np.float32), final=True)


def test_int8_accepts_two_to_the_127_exactly():
    x = np.zeros(300, np.float32)
    x[3], x[299] = 2.0**127, -(2.0**127)
    assert_same_as_reference(x)


def test_the_kernels_are_in_use_where_numba_is_installed(passes):
    """A numba that imports but fails to compile logs a warning and falls back: here, where
    it is installed, the kernels must be what int8 runs."""
    pytest.importorskip("numba")
    if not jit.enabled():
        pytest.skip("P2PTRAIN_NUMBA=0")
    if passes == "numba":
        assert _int8_kernels.warm()
