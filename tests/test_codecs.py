"""Codecs: error bounds, determinism, grammar, params schema, error feedback.

Malformed payloads and the decoder fuzzer are in test_codecs_malformed.py.
"""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from p2ptrain.codecs import CODEC_CHOICES, Codec, Encoded, encodable, parse_codec, residual_of
from p2ptrain.errors import CodecError, ConfigError, NotFiniteError

LOSSY = ["fp16", "bf16", "int8", "topk:0.01", "topk:0.3", "topk:1"]
ALL = ["none"] + LOSSY + [s + "+nozstd" for s in LOSSY] + ["int8+zstd:5"]
KINDS = ["normal", "t2", "tiny", "huge", "mixed", "spike", "zeros", "const", "subnormal", "edge"]
FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def make_chunk(n: int, kind: str, seed: int) -> np.ndarray:
    """Chunks of the shapes gradients take, and of the extremes a codec must survive."""
    rng = np.random.default_rng(seed)
    g = rng.standard_normal(n)
    if kind == "t2":
        g = rng.standard_t(2, n) * 1e-3
    elif kind == "tiny":
        g *= 1e-30
    elif kind == "huge":
        g *= 1e30
    elif kind == "mixed":
        g *= 10.0 ** rng.uniform(-30, 30, n)
    elif kind == "spike":
        g *= 1e-6
        if n:
            g[rng.integers(n)] = 1e6
    elif kind == "zeros":
        g[:] = 0.0
    elif kind == "const":
        g[:] = -0.25
    elif kind == "subnormal":
        g *= 1e-42
    elif kind == "edge":  # up to the 2**127 limit of the lossy codecs
        g = rng.uniform(-1, 1, n) * 2.0**127
    return g.astype(np.float32)


LENGTHS = st.sampled_from([0, 1, 2, 255, 256, 257, 511, 4097, 70_000])
chunks = st.one_of(
    st.builds(make_chunk, LENGTHS, st.sampled_from(KINDS), st.integers(0, 2**32 - 1)),
    arrays(
        np.float32,
        st.integers(0, 600),
        elements=st.floats(-(2.0**127), 2.0**127, width=32, allow_subnormal=True),
    ),
)


def roundtrip(codec: Codec, x: np.ndarray) -> tuple[Encoded, np.ndarray]:
    enc = codec.encode(x)
    out = np.full(x.size, np.nan, np.float32)
    codec.decode(enc.params, enc.tobytes(), out)
    return enc, out


def topk_expected(x: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest |x|, ties to the lowest index, computed independently."""
    order = np.lexsort((np.arange(x.size), -np.abs(x.astype(np.float64))))
    return np.sort(order[:k])


def check_bound(spec: str, x: np.ndarray, y: np.ndarray) -> None:
    """Assert exactly the error bound each codec's docstring states."""
    x64, err = x.astype(np.float64), np.abs(x.astype(np.float64) - y.astype(np.float64))
    absmax = float(np.abs(x64).max()) if x.size else 0.0
    base = spec.split("+")[0]
    if base == "none":
        assert np.array_equal(x.view(np.uint32), y.view(np.uint32))
    elif base == "fp16":
        assert np.all(err <= 2.0**-11 * np.abs(x64) + 2.0**-39 * absmax + 2.0**-149)
    elif base == "bf16":
        assert np.all(err <= 2.0**-8 * np.abs(x64) + 2.0**-134)
    elif base == "int8":
        pad = -x.size % 256
        blocks = np.concatenate([np.abs(x64), np.zeros(pad)]).reshape(-1, 256)
        amax = np.repeat(blocks.max(axis=1), 256)[: x.size]
        assert np.all(err <= (1 + 2.0**-12) * np.maximum(amax / 254, 2.0**-127))
    else:
        codec = parse_codec(spec)
        k = codec._t.k(x.size)
        kept = topk_expected(x, k)
        assert np.array_equal(y[kept].view(np.uint32), x[kept].view(np.uint32))
        rest = np.ones(x.size, bool)
        rest[kept] = False
        assert np.all(y[rest] == 0)
        if k:
            assert np.all(np.abs(x64[rest]) <= np.abs(x64[kept]).min())
    assert np.all(np.isfinite(y))


# --- error bounds -----------------------------------------------------------------------


@pytest.mark.parametrize("spec", ALL)
@FAST
@given(x=chunks)
def test_roundtrip_within_stated_bound(spec, x):
    codec = parse_codec(spec)
    enc, y = roundtrip(codec, x)
    check_bound(spec, x, y)
    assert enc.nbytes == sum(len(b) for b in enc.buffers) <= codec.max_payload(x.size)


@pytest.mark.parametrize("ratio", ["0.01", "0.001", "0.3", "1"])
@FAST
@given(x=chunks)
def test_topk_keeps_exactly_k_largest(ratio, x):
    codec = parse_codec(f"topk:{ratio}")
    k = codec._t.k(x.size)
    assert k == (0 if x.size == 0 else max(1, int(np.ceil(float(ratio) * x.size - 1e-9))))
    assert np.array_equal(codec._t.select(x), topk_expected(x, k))


@pytest.mark.parametrize("pattern", ["sampled-big", "sampled-zero", "zeros", "few-values"])
@pytest.mark.parametrize("ratio", ["0.001", "0.01", "0.3", "0.7"])
def test_topk_exact_when_its_sample_misleads(pattern, ratio):
    n = 4096 * 10  # topk's threshold sampler reads every 10th value of such a chunk
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(n) * 1e-3).astype(np.float32)
    if pattern == "sampled-big":
        x[::10] = rng.uniform(1, 2, n // 10)
    elif pattern == "sampled-zero":
        x[::10] = 0
    elif pattern == "zeros":
        x[rng.random(n) < 0.995] = 0
    else:
        x = rng.integers(-3, 4, n).astype(np.float32)
    codec = parse_codec(f"topk:{ratio}")
    assert np.array_equal(codec._t.select(x), topk_expected(x, codec._t.k(n)))


@pytest.mark.parametrize("density", [0.0, 0.001, 0.005, 0.02])
@pytest.mark.parametrize("ratio", ["0.001", "0.01"])
def test_topk_mostly_zero_chunk_is_exact_and_sorts_only_candidates(density, ratio):
    # An embedding's gradient: few non-zero values. Exact either way; but gathering every
    # index (the all-candidates fallback) sorted the whole chunk, ~20x the usual time.
    from p2ptrain.codecs._topk import _bound, _candidates

    n = 1 << 17
    rng = np.random.default_rng(7)
    x = np.zeros(n, np.float32)
    rows = rng.random(n) < density
    x[rows] = rng.standard_normal(int(rows.sum()))
    t = parse_codec(f"topk:{ratio}")._t
    k = t.k(n)
    assert np.array_equal(t.select(x), topk_expected(x, k))
    mag = np.abs(x).view(np.uint32)
    cand = _candidates(mag, k, _bound(mag, k), np.empty(n, np.bool_))
    assert cand is not None and cand.size <= max(int(rows.sum()), k) + k


@pytest.mark.parametrize("density", [0.0, 0.001, 0.02, 0.5, 1.0])
@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 4097, 70_001])
def test_topk_sparse_nonzero_equals_numpy(n, density):
    from p2ptrain.codecs._topk import _nonzero

    mask = np.random.default_rng(n).random(n) < density
    got = _nonzero(mask)
    assert got.dtype == np.intp and np.array_equal(got, mask.nonzero()[0])


def test_topk_ties_go_to_lowest_index():
    x = np.array([1, -3, 3, 2, -3, 3], np.float32)
    _, y = roundtrip(parse_codec("topk:0.5"), x)
    assert y.tolist() == [0, -3, 3, 0, -3, 0]


def test_int8_outlier_only_spoils_its_own_block():
    x = np.full(1024, 1e-3, np.float32)
    x[700] = 1e6
    _, y = roundtrip(parse_codec("int8"), x)
    assert np.array_equal(np.delete(y, range(512, 768)), np.delete(x, range(512, 768)))


@pytest.mark.parametrize("spec", ["fp16", "bf16", "int8"])
@pytest.mark.parametrize("scale", [1e30, 1e-30, 1e-40])
def test_extreme_scales_neither_overflow_nor_flush(spec, scale):
    codec, x1 = parse_codec(spec), make_chunk(5000, "normal", 1)
    x = x1 * np.float32(scale)
    _, y = roundtrip(codec, x)
    check_bound(spec, x, y)
    if scale < 1e-38 and spec != "fp16":
        return  # float32 subnormals: bf16 keeps their top bits only, int8 has a 2**-127 floor
    _, y1 = roundtrip(codec, x1)
    rel = np.linalg.norm(y - x.astype(np.float64)) / np.linalg.norm(x.astype(np.float64))
    assert rel <= 1.5 * np.linalg.norm(y1 - x1.astype(np.float64)) / np.linalg.norm(x1)


# --- determinism and the Encoded shape --------------------------------------------------


@pytest.mark.parametrize("spec", ALL)
@settings(max_examples=25, deadline=None)
@given(x=chunks)
def test_deterministic_encode_and_decode(spec, x):
    a, b = parse_codec(spec), parse_codec(spec)
    e1, e2 = a.encode(x), a.encode(x.copy())
    assert e1.params == e2.params and e1.tobytes() == e2.tobytes()
    y1, y2 = np.empty_like(x), np.empty_like(x)
    a.decode(e1.params, e1.tobytes(), y1)
    b.decode(e2.params, memoryview(bytearray(e2.tobytes())), y2)  # another instance, another buffer type
    assert np.array_equal(y1.view(np.uint32), y2.view(np.uint32))


@pytest.mark.parametrize("base", ["fp16", "bf16", "int8", "topk:0.01"])
def test_zstd_is_transparent_and_decodable_by_any_level(base):
    x = make_chunk(70_000, "t2", 3)
    packed, plain = parse_codec(base + "+zstd:3"), parse_codec(base + "+nozstd")
    ep, eq = packed.encode(x), plain.encode(x)
    assert eq.params["z"] is False
    ys = []
    for enc in (ep, eq):
        for dec in (packed, plain, parse_codec(base)):
            ys.append(np.empty_like(x))
            dec.decode(enc.params, enc.tobytes(), ys[-1])
    assert all(np.array_equal(ys[0].view(np.uint32), y.view(np.uint32)) for y in ys)


def test_zstd_skipped_when_it_does_not_pay():
    x = np.random.default_rng(0).uniform(-1, 1, 70_000).astype(np.float32)
    enc = parse_codec("int8").encode(x)  # uniform codes: 8 bits of entropy, nothing to gain
    assert enc.params["z"] is False and enc.nbytes == parse_codec("int8").max_payload(x.size)
    enc = parse_codec("int8").encode(np.zeros(70_000, np.float32))
    assert enc.params["z"] is True and enc.nbytes < 0.05 * 70_000


@pytest.mark.parametrize("spec", ["int8", "fp16", "topk:0.05"])
def test_a_chunk_asked_without_zstd_goes_raw_and_decodes_to_the_same_values(spec):
    # (the ring's choice where its link keeps up: never a change in the maths)
    codec = parse_codec(spec)
    assert codec.compresses and not parse_codec(f"{spec}+nozstd").compresses and not parse_codec("none").compresses
    x = np.zeros(70_000, np.float32)
    x[::7] = np.random.default_rng(0).standard_normal(10_000).astype(np.float32)  # zstd shrinks it
    packed, raw = codec.encode(x), codec.encode(x, zstd=False)
    assert packed.params["z"] is True and raw.params["z"] is False and raw.nbytes > packed.nbytes
    y_packed, y_raw = np.empty_like(x), np.empty_like(x)
    codec.decode(packed.params, packed.tobytes(), y_packed)
    codec.decode(raw.params, raw.tobytes(), y_raw)
    assert np.array_equal(y_packed.view(np.uint32), y_raw.view(np.uint32))
    for zstd in (True, False):  # the sender's own decoded values and residual: the same bits too
        out, residual = np.empty_like(x), np.empty_like(x)
        assert codec.encode_decoded(x, out, zstd=zstd).params["z"] is zstd
        assert codec.encode_residual(x, residual, zstd=zstd).params["z"] is zstd
        assert np.array_equal(out.view(np.uint32), y_raw.view(np.uint32))
        assert np.array_equal(residual, x - y_raw)


@pytest.mark.parametrize("n", [60_000, 300_000])  # payloads below and above the probe size
def test_zstd_kept_only_when_it_saves_a_tenth(n):
    # int8 codes of Gaussian values save ~6% under zstd: not worth its CPU. Heavy-tailed
    # (Student-t, 2 dof) values save ~25%: kept.
    codec = parse_codec("int8")
    enc = codec.encode(make_chunk(n, "normal", 1))
    assert enc.params["z"] is False
    enc = codec.encode(make_chunk(n, "t2", 1))
    assert enc.params["z"] is True and enc.nbytes < 0.9 * codec.max_payload(n)


def sent_and_received(spec, x, enc):
    """What a receiver decodes from ``enc``, after checking that it is the chunk encode(x) sends."""
    codec = parse_codec(spec)
    assert enc.params == codec.encode(x).params and enc.tobytes() == codec.encode(x).tobytes()
    y = np.empty_like(x)
    codec.decode(enc.params, enc.tobytes(), y)
    return y


@pytest.mark.parametrize("spec", ALL)
@settings(max_examples=25, deadline=None)
@given(x=chunks)
def test_encode_decoded_gives_what_receivers_decode(spec, x):
    """The sender's own decoded values (no zstd round trip) are the receivers' bit for bit."""
    codec = parse_codec(spec)
    out = np.full(x.size, np.nan, np.float32)
    y = sent_and_received(spec, x, codec.encode_decoded(x, out))
    assert np.array_equal(out.view(np.uint32), y.view(np.uint32))
    inplace = x.copy()  # out may be x itself: the owner adopting its final sum
    enc = codec.encode_decoded(inplace, inplace)
    assert enc.tobytes() == codec.encode(x).tobytes()
    assert np.array_equal(inplace.view(np.uint32), y.view(np.uint32))


@pytest.mark.parametrize("spec", ALL)
@settings(max_examples=25, deadline=None)
@given(x=chunks)
def test_encode_residual_is_what_decoding_and_subtracting_leaves(spec, x):
    """Error feedback keeps x - decode(encode(x)), bit for bit (a sparse codec gets there by
    copying x and zeroing the kept values), and the chunk sent is encode(x)'s."""
    codec = parse_codec(spec)
    residual = np.full(x.size, np.nan, np.float32)
    y = sent_and_received(spec, x, codec.encode_residual(x, residual))
    with np.errstate(all="ignore"):
        expect = x - y
    assert np.array_equal(residual.view(np.uint32), expect.view(np.uint32))
    with pytest.raises(ConfigError):
        codec.encode_residual(x, x)  # (the residual must be apart from x)


@pytest.mark.parametrize("spec", ["none", "int8", "topk:0.1"])
def test_encode_decoded_refuses_a_bad_out(spec):
    codec, buf = parse_codec(spec), np.zeros(101, np.float32)
    x = buf[:100]
    for out in (buf[1:], np.zeros(99, np.float32), np.zeros(100, np.float64)):  # overlap, length, dtype
        with pytest.raises(ConfigError):
            codec.encode_decoded(x, out)
    frozen = np.zeros(100, np.float32)
    frozen.flags.writeable = False
    with pytest.raises(ConfigError):
        codec.encode_decoded(x, frozen)


def test_none_is_zero_copy_identity():
    codec = parse_codec("none")
    assert codec.lossless and codec.is_identity and codec.spec == "none"
    x = make_chunk(1000, "normal", 0)
    enc = codec.encode(x)
    assert enc.params == {} and len(enc.buffers) == 1 and enc.nbytes == codec.max_payload(1000) == 4000
    assert bytes(enc.buffers[0]) == x.astype("<f4").tobytes()
    x[0] = 42.0  # the buffer is a view of x: no copy was made
    assert np.frombuffer(enc.buffers[0], "<f4")[0] == 42.0
    x[1] = -0.0
    _, y = roundtrip(codec, x)
    assert np.array_equal(x.view(np.uint32), y.view(np.uint32))  # bit for bit
    for bad in (np.nan, np.inf, -np.inf):  # no peer's parameters take them: the round is left out
        x[1] = bad
        with pytest.raises(NotFiniteError):
            codec.encode(x)
    x[1] = 3e38  # (finite, however its square overflows)
    assert np.frombuffer(codec.encode(x).buffers[0], "<f4")[1] == np.float32(3e38)


@pytest.mark.parametrize("spec", LOSSY)
def test_params_survive_msgpack(spec):
    codec = parse_codec(spec)
    x = make_chunk(3000, "t2", 5)
    enc = codec.encode(x)
    params = msgpack.unpackb(msgpack.packb(enc.params))
    assert params == enc.params and not codec.lossless and not codec.is_identity
    y = np.empty_like(x)
    codec.decode(params, b"".join(enc.buffers), y)
    check_bound(spec, x, y)


@pytest.mark.parametrize("spec", LOSSY)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf, 2.0**127 * 1.5])
def test_lossy_codecs_refuse_nonfinite_input(spec, bad):
    x = make_chunk(1000, "normal", 0)
    x[617] = bad
    with pytest.raises(ConfigError, match="NaN, inf"):
        parse_codec(spec).encode(x)
    assert not encodable(x)  # (what the trainer asks of an aborted round's contribution)
    x[617] = 2.0**127
    assert encodable(x) and encodable(x[:0])
    parse_codec(spec).encode(x)  # (the edge itself is carried)


@pytest.mark.parametrize(
    "x",
    [np.zeros(4, np.float64), np.zeros((2, 2), np.float32), np.zeros(8, np.float32)[::2], [1.0, 2.0]],
)
def test_bad_arrays_from_our_caller_are_config_errors(x):
    codec = parse_codec("int8")
    with pytest.raises(ConfigError):
        codec.encode(x)
    enc = codec.encode(np.zeros(4, np.float32))
    with pytest.raises(ConfigError):
        codec.decode(enc.params, enc.tobytes(), x)


# --- grammar ----------------------------------------------------------------------------

VALID = {
    "none": "none",
    " NONE ": "none",
    "none+nozstd": "none",
    "fp16": "fp16+zstd:1",
    "bf16+nozstd": "bf16+nozstd",
    "int8": "int8+zstd:1",
    "INT8 + ZSTD : 3": "int8+zstd:3",
    "int8+zstd": "int8+zstd:1",
    "int8+zstd:19": "int8+zstd:19",
    "fp16+nozstd": "fp16+nozstd",
    "topk:0.01": "topk:0.01+zstd:1",
    "topk:0.0100+nozstd": "topk:0.01+nozstd",
    "topk:1e-3": "topk:0.001+zstd:1",
    "topk:.5+zstd:2": "topk:0.5+zstd:2",
    "topk:1": "topk:1+zstd:1",
    "topk:1.0": "topk:1+zstd:1",
}
INVALID = [
    "", "int9", "topk", "topk:", "topk:0", "topk:2", "topk:-0.1", "topk:nan", "topk:1e-12",
    "topk:0.01:3", "int8+zstd:99", "int8+zstd:0", "int8+zstd:-1", "int8+zstd:x", "int8+",
    "int8+lz4", "int8+zstd+nozstd", "none+zstd", "none+zstd:3", "fp16:3", "int8:256",
    "none:1", "+zstd", "int8+nozstd:1", "fp 16",
]


@pytest.mark.parametrize("spec, canonical", VALID.items())
def test_parse_valid_forms(spec, canonical):
    codec = parse_codec(spec)
    assert codec.spec == canonical
    assert parse_codec(codec.spec) == codec and hash(parse_codec(codec.spec)) == hash(codec)
    assert codec.lossless == codec.is_identity == (canonical == "none")


@pytest.mark.parametrize("spec", INVALID + [None, 8])
def test_parse_invalid_forms_list_the_choices(spec):
    with pytest.raises(ConfigError) as info:
        parse_codec(spec)
    message = str(info.value)
    assert CODEC_CHOICES in message and "\n" not in message
    assert isinstance(info.value, ValueError)


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.text(max_size=24), st.from_regex(r"(none|fp16|bf16|int8|topk)[:+ ].{0,12}", fullmatch=True)))
def test_fuzz_parse_returns_a_codec_or_raises_config_error(spec):
    try:
        codec = parse_codec(spec)
    except ConfigError as e:
        assert CODEC_CHOICES in str(e) and "\n" not in str(e)
    else:
        assert parse_codec(codec.spec) == codec and codec.spec.isascii()


def test_choices_name_every_form():
    for word in ("none", "fp16", "bf16", "int8", "topk:RATIO", "+zstd[:LEVEL]", "+nozstd"):
        assert word in CODEC_CHOICES


def test_topk_k_is_exact_for_decimal_ratios():
    # 0.07 * 100 is 7.000000000000001 in binary floating point; k must still be 7.
    assert parse_codec("topk:0.07")._t.k(100) == 7
    assert parse_codec("topk:0.001")._t.k(1) == 1
    assert parse_codec("topk:0.001")._t.k(1001) == 2


# --- error feedback ---------------------------------------------------------------------


@pytest.mark.parametrize("spec", ["int8", "topk:0.01", "fp16", "bf16"])
def test_error_feedback_conserves_mass(spec):
    codec, rng, n, rounds = parse_codec(spec), np.random.default_rng(7), 10_000, 50
    residual = np.zeros(n, np.float32)
    applied_fb = np.zeros(n)
    applied_plain = np.zeros(n)
    total = np.zeros(n)
    largest = 0.0
    for _ in range(rounds):
        g = (rng.standard_t(3, n) * 10.0 ** rng.uniform(-3, 0)).astype(np.float32)
        total += g
        x = g + residual
        largest = max(largest, float(np.abs(x).max()))
        enc = codec.encode(x)
        applied = np.empty(n, np.float32)
        codec.decode(enc.params, enc.tobytes(), applied)
        applied_fb += applied
        residual_of(codec, x, enc, residual)
        assert np.array_equal(residual, x - applied)
        applied_plain += roundtrip(codec, g)[1]  # the same round without feedback
    # Left: float32 rounding of g + residual, one half-ulp of the largest x per round.
    tol = rounds * largest * 2.0**-23
    err_fb = np.abs(applied_fb + residual - total).max()
    err_plain = np.abs(applied_plain - total).max()
    assert err_fb <= tol
    assert err_plain > 10 * tol  # without feedback the same check fails: the test has teeth


def test_residual_of_is_zero_for_none_and_accepts_split_buffers():
    x = make_chunk(777, "t2", 2)
    out = np.full(777, np.nan, np.float32)
    codec = parse_codec("none")
    assert not residual_of(codec, x, codec.encode(x), out).any()
    codec = parse_codec("int8")
    enc = codec.encode(x)
    raw = enc.tobytes()
    split = Encoded(enc.params, [memoryview(raw)[:100], memoryview(raw)[100:]], enc.nbytes)
    y = np.empty_like(x)
    codec.decode(enc.params, raw, y)
    assert np.array_equal(residual_of(codec, x, split, out), x - y)


def test_codec_error_is_remote_fault():
    with pytest.raises(CodecError):
        parse_codec("int8").decode({"z": False}, b"\0", np.empty(5, np.float32))


@pytest.mark.parametrize("spec", ["none", "fp16", "bf16", "int8", "int8+nozstd", "topk:0.01", "topk:0.3+nozstd"])
def test_decode_add_equals_decode_then_add(spec):
    """The reduce-scatter hop's fused path gives the same floats as decode + add."""
    codec = parse_codec(spec)
    rng = np.random.default_rng(7)
    for n in (0, 1, 255, 4097):
        x = rng.standard_normal(n).astype(np.float32)
        dst = rng.standard_normal(n).astype(np.float32)
        enc = codec.encode(x)
        expected = np.empty(n, np.float32)
        codec.decode(enc.params, enc.tobytes(), expected)
        expected += dst
        codec.decode_add(enc.params, enc.tobytes(), dst, np.empty(n, np.float32))
        np.testing.assert_array_equal(dst, expected)


def test_decode_add_rejects_what_decode_rejects():
    codec = parse_codec("topk:0.1+nozstd")
    enc = codec.encode(np.arange(100, dtype=np.float32))
    bad = bytearray(enc.tobytes())
    bad[-1] = 0  # last index delta 0: a repeated index
    with pytest.raises(CodecError):
        codec.decode_add(enc.params, bytes(bad), np.zeros(100, np.float32), np.zeros(100, np.float32))


@pytest.mark.parametrize("spec", ALL)
@settings(max_examples=10, deadline=None)  # (the residual's and the decode's own tests run 25 each above)
@given(x=chunks)
def test_encode_final_keeps_the_residual_and_adopts_the_decoded_values(spec, x):
    """A segment's owner with error feedback: the residual is x - decode(encode(x)) and x becomes
    what every receiver decodes, bit for bit as decoding, subtracting and copying back would
    leave them (the ring's way before ``encode_final``), and the chunk sent is encode(x)'s."""
    codec = parse_codec(spec)
    final, residual = x.copy(), np.full(x.size, np.nan, np.float32)
    y = sent_and_received(spec, x, codec.encode_final(final, residual))
    with np.errstate(all="ignore"):
        expect = x - y
    assert np.array_equal(residual.view(np.uint32), expect.view(np.uint32))
    assert np.array_equal(final.view(np.uint32), y.view(np.uint32))
    with pytest.raises(ConfigError):
        codec.encode_final(final, final)  # (the residual must be apart from x)
    frozen = x.copy()
    frozen.flags.writeable = False
    with pytest.raises(ConfigError):
        codec.encode_final(frozen, residual)  # (x is written: the decoded values)
