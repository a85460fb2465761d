"""Codecs fed hostile payloads: every one is refused with CodecError, and nothing else.

The fuzzers check one rule, h11-style: decode succeeds or raises CodecError.
"""

from __future__ import annotations

import functools
import itertools
import time

import numpy as np
import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from p2ptrain.codecs import parse_codec
from p2ptrain.errors import CodecError

SPECS = ["none", "fp16", "bf16", "int8", "topk:0.01", "topk:0.5", "fp16+nozstd", "int8+nozstd"]
LOSSY = [s for s in SPECS if s != "none"]


def encoded(spec: str, n: int = 3000, seed: int = 0, zeros: bool = False):
    codec = parse_codec(spec)
    x = np.zeros(n, np.float32) if zeros else np.random.default_rng(seed).standard_t(3, n).astype(np.float32)
    enc = codec.encode(x)
    return codec, dict(enc.params), enc.tobytes(), n


def refused(codec, params, payload, n):
    with pytest.raises(CodecError):
        codec.decode(params, payload, np.empty(n, np.float32))


def plain_payload(spec: str, n: int, zeros: bool = False) -> tuple[dict, bytearray]:
    """The uncompressed payload and params ({"z": False}) for hand-made corruption."""
    codec = parse_codec(spec.split("+")[0] + "+nozstd")
    x = np.zeros(n, np.float32) if zeros else np.random.default_rng(1).standard_t(3, n).astype(np.float32)
    enc = codec.encode(x)
    return dict(enc.params), bytearray(enc.tobytes())


# --- lengths ----------------------------------------------------------------------------


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("zeros", [False, True])  # zeros: zstd applied; random: maybe not
def test_truncated_and_extended_payloads(spec, zeros):
    codec, params, payload, n = encoded(spec, zeros=zeros)
    refused(codec, params, payload[:-1], n)
    refused(codec, params, payload[: len(payload) // 2], n)
    refused(codec, params, payload + b"\0", n)
    refused(codec, params, b"", n)
    refused(codec, params, payload, n + 1)  # the receiver's n, not the payload, rules
    if "topk" not in spec:  # topk payloads are valid for every n with the same k
        refused(codec, params, payload, n - 1)


@pytest.mark.parametrize("spec", SPECS)
def test_payload_over_max_payload_is_refused(spec):
    codec, params, _, n = encoded(spec)
    refused(codec, params, bytes(codec.max_payload(n) + 1), n)


# --- params -----------------------------------------------------------------------------


@pytest.mark.parametrize("spec", SPECS)
def test_params_missing_extra_wrong_type(spec):
    codec, params, payload, n = encoded(spec)
    for key in params:
        refused(codec, {k: v for k, v in params.items() if k != key}, payload, n)
        for wrong in (None, 1.0, "1", b"\1", [1], True if type(params[key]) is int else 1):
            refused(codec, {**params, key: wrong}, payload, n)
    refused(codec, {**params, "extra": 0}, payload, n)
    for not_a_dict in (None, [], list(params.items()), "z"):
        refused(codec, not_a_dict, payload, n)


@pytest.mark.parametrize("s", [-114, 127, 2**40, -(2**63)])
def test_fp16_scale_exponent_out_of_range(s):
    codec, params, payload, n = encoded("fp16")
    refused(codec, {**params, "s": s}, payload, n)


@pytest.mark.parametrize("w", [0, 3, 8, -1])
def test_topk_bad_index_width(w):
    codec, params, payload, n = encoded("topk:0.01")
    refused(codec, {**params, "w": w}, payload, n)


# --- values: scales, indices ------------------------------------------------------------


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf, -1.0, -1e-30, 1e37])
@pytest.mark.parametrize("block", [0, 5, 10])  # first, middle, the partial last block
def test_int8_bad_scales(bad, block):
    n = 2600  # 10 full blocks and a partial one
    params, raw = plain_payload("int8", n)
    np.frombuffer(raw, "<f4", 11)[block] = bad
    codec = parse_codec("int8")
    refused(codec, params, bytes(raw), n)
    refused(codec, {"z": True}, zstandard.ZstdCompressor().compress(bytes(raw)), n)
    dst = np.full(n, 3.0, np.float32)  # a reduce-scatter hop: nothing added before the refusal
    with pytest.raises(CodecError):
        codec.decode_add(params, bytes(raw), dst, np.empty(n, np.float32))
    assert (dst == 3.0).all()
    residual = np.full(n, 7.0, np.float32)  # a hop adding as it encodes: nothing written either
    for final, kept in itertools.product((False, True), (None, residual)):
        with pytest.raises(CodecError):
            codec.add_encode(params, bytes(raw), dst, kept, final)
        assert (dst == 3.0).all() and (residual == 7.0).all()


def topk_payload(indices, n, values=None, w=4):
    """A topk:0.01 payload for n values with the given (possibly invalid) indices."""
    indices = np.asarray(indices, np.int64)
    values = np.ones(indices.size, "<f4") if values is None else values
    deltas = np.diff(indices, prepend=-1).astype({1: "u1", 2: "<u2", 4: "<u4"}[w])
    return {"z": False, "w": w}, values.tobytes() + deltas.tobytes()


def test_topk_index_checks():
    codec, n = parse_codec("topk:0.01"), 300  # k = 3
    out = np.empty(n, np.float32)
    params, payload = topk_payload([3, 150, 299], n)
    codec.decode(params, payload, out)
    assert np.flatnonzero(out).tolist() == [3, 150, 299]
    for bad in ([3, 150, 300], [3, 150, 10**9], [0, 0, 5], [3, 150, 150], [5, 3, 7], [200, 100, 250]):
        for w in (2, 4):
            refused(codec, *topk_payload(bad, n, w=w), n)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(-5, 400), min_size=3, max_size=3), st.sampled_from([1, 2, 4]))
def test_topk_any_index_triple_is_decoded_exactly_or_refused(indices, w):
    codec, n = parse_codec("topk:0.01"), 300
    params, payload = topk_payload(indices, n, np.array([1, 2, 3], "<f4"), w)
    out = np.empty(n, np.float32)
    valid = all(0 <= i < n for i in indices) and indices == sorted(set(indices))
    wraps = max(np.diff(indices, prepend=-1)) >= 1 << (8 * w)
    if valid and not wraps:
        codec.decode(params, payload, out)
        assert np.flatnonzero(out).tolist() == indices and out[indices].tolist() == [1, 2, 3]
    elif not valid and w == 4:
        refused(codec, params, payload, n)
    else:  # narrow deltas wrap around: the result is some other valid set, or refused
        try:
            codec.decode(params, payload, out)
        except CodecError:
            pass


# --- zstd -------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _bomb() -> bytes:
    """One zstd frame of ~40 KiB that announces and holds 1 GiB of zeros."""
    cobj = zstandard.ZstdCompressor(level=3).compressobj(size=1 << 30)
    chunk = bytes(1 << 20)
    frame = b"".join(cobj.compress(chunk) for _ in range(1024)) + cobj.flush()
    assert zstandard.frame_content_size(frame) == 1 << 30 and len(frame) < 1 << 20
    return frame


@pytest.mark.parametrize("spec", LOSSY)
def test_zstd_bomb_is_refused_without_decompressing(spec):
    codec = parse_codec(spec)
    n = 3000
    bomb = _bomb()
    for key_w in ({}, {"w": 4}, {"s": 0}):
        params = {"z": True, **{k: v for k, v in key_w.items() if k in codec._keys}}
        if params.keys() != codec._keys.keys():
            continue
        start = time.perf_counter()
        refused(codec, params, bomb[:64], n)
        refused(codec, params, bomb, n)
        assert time.perf_counter() - start < 0.5
    # Small frames that announce no content size, or the wrong one, around a good payload.
    params, raw = plain_payload(spec, n, zeros=True)
    params["z"] = True
    unsized = zstandard.ZstdCompressor(write_content_size=False).compress(bytes(raw))
    refused(codec, params, unsized, n)
    refused(codec, params, zstandard.ZstdCompressor().compress(bytes(raw) + b"\0"), n)
    refused(codec, params, zstandard.ZstdCompressor().compress(bytes(raw[:-1])), n)
    ok = zstandard.ZstdCompressor().compress(bytes(raw))
    codec.decode(params, ok, np.empty(n, np.float32))  # the control: the good frame decodes
    refused(codec, params, ok + ok, n)  # two frames: extra data


@pytest.mark.parametrize("spec", LOSSY)
def test_zstd_flag_with_garbage_or_raw_bytes(spec):
    _, params, payload, n = encoded(spec.split("+")[0], zeros=True)
    codec = parse_codec(spec)  # a +nozstd instance decodes zstd payloads too
    assert params["z"] is True
    refused(codec, {**params, "z": True}, bytes(len(payload)), n)
    refused(codec, {**params, "z": True}, b"\x28\xb5\x2f\xfd" + bytes(20), n)  # magic, then junk
    refused(codec, {**params, "z": False}, payload, n)
    corrupt = bytearray(payload)
    corrupt[len(corrupt) // 2] ^= 0xFF
    try:
        codec.decode(params, bytes(corrupt), np.empty(n, np.float32))
    except CodecError:
        pass


# --- fuzzing ----------------------------------------------------------------------------

scalars = st.one_of(
    st.booleans(), st.integers(-(2**64), 2**64), st.floats(), st.text(max_size=3),
    st.binary(max_size=3), st.none(),
)
params_strategy = st.one_of(
    st.dictionaries(st.sampled_from(["z", "s", "w", "x"]), scalars, max_size=4),
    st.fixed_dictionaries({"z": st.booleans(), "s": st.integers(-200, 200)}),
    st.fixed_dictionaries({"z": st.booleans(), "w": st.sampled_from([1, 2, 4])}),
    st.fixed_dictionaries({"z": st.booleans()}),
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    spec=st.sampled_from(SPECS),
    n=st.integers(0, 700),
    params=params_strategy,
    payload=st.one_of(st.binary(max_size=3000), st.binary(max_size=64).map(lambda b: b * 40)),
    pack=st.booleans(),
)
def test_fuzz_decode_succeeds_or_raises_codec_error(spec, n, params, payload, pack):
    codec = parse_codec(spec)
    if pack:  # a valid zstd frame around random bytes, to reach the checks behind zstd
        payload = zstandard.ZstdCompressor().compress(payload)
    out = np.empty(n, np.float32)
    try:
        with np.errstate(all="raise"):  # hostile values must not raise FloatingPointError
            codec.decode(params, payload, out)
    except CodecError:
        pass


@settings(max_examples=300, deadline=None)
@given(
    spec=st.sampled_from(SPECS),
    seed=st.integers(0, 1000),
    zeros=st.booleans(),
    cut=st.integers(0, 10_000),
    flips=st.lists(st.tuples(st.integers(0, 10**6), st.integers(1, 255)), max_size=4),
)
def test_fuzz_mutated_valid_payloads(spec, seed, zeros, cut, flips):
    codec, params, payload, n = encoded(spec, n=700, seed=seed, zeros=zeros)
    data = bytearray(payload[: max(cut, len(payload) - cut % 3)])
    for pos, bits in flips:
        if data:
            data[pos % len(data)] ^= bits
    try:
        codec.decode(params, bytes(data), np.empty(n, np.float32))
    except CodecError:
        pass
