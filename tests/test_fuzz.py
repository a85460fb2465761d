"""Every parser that reads the network after the handshake, fuzzed with one rule (h11's): it
succeeds or raises the remote-fault error (``RemoteProtocolError`` and its subtypes), nothing
else, and allocates nothing past its limit. A ``TypeError`` from a peer's bytes reached the
cluster's actor, which stops the whole peer on anything but a ``RemoteProtocolError``.

Parsers: the frame decoder (fed a byte at a time and in random splits), the handshake (both
ends, with and without a secret: it admits on the honest transcript only), beacons, the round
messages (parsed, then handled by a round machine), the other frame headers (ring chunks, state
transfer, keepalives, parameter sketches), codec payloads (decode and decode_add), snapshots
(mutated from valid ones) and their parts.

A few hundred examples each in the normal run; ``P2PTRAIN_FUZZ_EXAMPLES=N`` for a longer one, and
``bench/fuzz.py`` for a million inputs a parser (its targets run briefly here too). A finding of
either becomes a test below.
"""

from __future__ import annotations

import os
import struct

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import _fuzz_targets  # (bench/, on the path: conftest)

from p2ptrain.cluster import roundmsg as M
from p2ptrain.cluster import snapshot, statesync
from p2ptrain.codecs import parse_codec
from p2ptrain.collective.chunk_header import chunk_header, check_chunk_header
from p2ptrain.collective.ring import Transfer
from p2ptrain.errors import GroupError, RemoteProtocolError
from p2ptrain.net import beacon, wire

pytestmark = pytest.mark.timeout(300)

EXAMPLES = int(os.environ.get("P2PTRAIN_FUZZ_EXAMPLES", "300"))
# The deadline catches an input that blocks (a loop that a length drives, a decompression bomb);
# it is loose because this machine's cores are shared.
FUZZ = settings(max_examples=EXAMPLES, deadline=5000, suppress_health_check=[HealthCheck.too_slow])

# Any value msgpack can carry, as a peer could send it.
SCALARS = (st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats(allow_nan=True)
           | st.text(max_size=8) | st.binary(max_size=8))
VALUES = st.recursive(SCALARS, lambda x: st.lists(x, max_size=4) | st.dictionaries(st.text(max_size=4), x, max_size=4),
                      max_leaves=6)


def through_msgpack(value):
    """What a peer's header becomes on our side (lists for tuples, str/bytes as sent)."""
    return msgpack.unpackb(msgpack.packb(value, use_bin_type=True), raw=False)


def mutate(data: bytes, edits) -> bytes:
    """Flip, cut or insert bytes at the drawn places."""
    out = bytearray(data)
    for kind, pos, value in edits:
        if kind == 0 and out:
            out[pos % len(out)] ^= value or 1
        elif kind == 1:
            del out[pos % (len(out) + 1):]
        else:
            out[pos % (len(out) + 1):pos % (len(out) + 1)] = bytes([value])
    return bytes(out)


EDITS = st.lists(st.tuples(st.integers(0, 2), st.integers(0, 1 << 20), st.integers(0, 255)), max_size=4)


# -- the frame decoder ---------------------------------------------------------------------------
HEADERS = st.fixed_dictionaries({"t": st.sampled_from([wire.CHUNK, wire.STATE, wire.PING, "propose", "x"])},
                                optional={"r": st.integers(0, 2**63), "v": VALUES})
FRAMES = st.lists(st.tuples(HEADERS, st.binary(max_size=300)), min_size=1, max_size=4)


def split_points(data: bytes, cuts) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    return [data[a:b] for a, b in zip(points, points[1:])]


class Allocations:
    def __init__(self):
        self.sizes = []

    def __call__(self, header, size):
        self.sizes.append(size)
        return memoryview(bytearray(size))


def decode_in_pieces(pieces, max_payload):
    allocate = Allocations()
    dec = wire.FrameDecoder(max_payload=max_payload, allocate=allocate)
    frames = []
    def seen(got):  # (headers as bytes: a NaN in one is not equal to itself)
        return [(msgpack.packb(f.header, use_bin_type=True), bytes(f.payload)) for f in got]

    try:
        for piece in pieces:
            frames += seen(dec.feed(piece))
    except wire.FrameError:  # (the frames completed before it in that piece are still there)
        frames += seen(dec.pop_frames()) + ["error"]
    assert all(0 < s <= max_payload for s in allocate.sizes), (allocate.sizes, max_payload)
    return frames


@FUZZ
@given(FRAMES, st.lists(st.integers(0, 1 << 16), max_size=8), EDITS, st.integers(1, 400))
def test_frame_decoder_yields_the_same_frames_however_the_bytes_are_split(frames, cuts, edits, max_payload):
    """Valid frames, then the same stream mutated: frames or a FrameError, the same in random
    pieces as a byte at a time, and no payload buffer past ``max_payload``."""
    data = b"".join(wire.frame_bytes(h, p) for h, p in frames)
    whole = decode_in_pieces([data], max_payload)
    if all(len(p) <= max_payload for _, p in frames):
        assert whole == [(msgpack.packb(h, use_bin_type=True), p) for h, p in frames]
    bad = mutate(data, edits)
    expected = decode_in_pieces([bad], max_payload)
    assert decode_in_pieces(split_points(bad, cuts), max_payload) == expected
    assert decode_in_pieces([bad[i:i + 1] for i in range(len(bad))], max_payload) == expected


@FUZZ
@given(st.binary(max_size=64), st.integers(0, 2**16 - 1), st.integers(0, 2**64 - 1), VALUES)
def test_frame_decoder_on_forged_prefixes_and_headers(tail, header_len, payload_len, value):
    """A valid magic and version with any lengths, and a msgpack header of any shape."""
    body = msgpack.packb(value, use_bin_type=True)[:wire.MAX_HEADER_BYTES]
    for data in (wire.PREFIX.pack(wire.MAGIC, wire.PROTOCOL_VERSION, 0, header_len, payload_len) + tail,
                 wire.PREFIX.pack(wire.MAGIC, wire.PROTOCOL_VERSION, 0, len(body), payload_len % 64) + body + tail):
        decode_in_pieces([data], 1 << 12)


# -- beacons -------------------------------------------------------------------------------------
BEACON = beacon.Beacon(cluster="lab", peer_id="p" * 16, port=7000, device="cuda", round=12, state="synced")


@FUZZ
@given(st.sampled_from([None, b"secret"]), st.sampled_from([None, b"secret", b"other"]), EDITS)
def test_mutated_beacons_are_refused_with_the_remote_fault_error_or_accepted(sent_with, read_with, edits):
    data = mutate(beacon.encode_beacon(BEACON, sent_with), edits)
    try:
        beacon.decode_beacon(data, read_with)
    except RemoteProtocolError:
        pass
    seen = beacon.BeaconFilter(cluster="lab", peer_id="me", secret=read_with)
    seen.accept(data, "192.0.2.1", 0.0)  # never raises
    seen.take_log_lines(100.0)


@FUZZ
@given(st.dictionaries(st.sampled_from(["v", "c", "id", "p", "d", "r", "s", "x"]), VALUES, max_size=8),
       st.sampled_from([None, b"secret"]))
def test_beacon_bodies_of_any_shape(fields, secret):
    body = msgpack.packb({"v": wire.PROTOCOL_VERSION, **fields}, use_bin_type=True)
    if len(body) > 1300:
        return
    data = struct.pack("<4sH", beacon.MAGIC, len(body)) + body
    try:
        beacon.decode_beacon(data, secret)
    except RemoteProtocolError:
        pass
    beacon.BeaconFilter(cluster="lab", peer_id="me", secret=secret).accept(data, "192.0.2.1", 0.0)


# -- round messages: parsed, then handled -----------------------------------------------------------
TYPES = sorted(M._SCHEMA)
IDS = st.sampled_from(["a", "b", "c", "z"])


def round_field(name):
    """Mostly plausible values (so that the machine's handling is reached), sometimes anything."""
    plausible = {
        "r": st.integers(-1, 40), "b": st.tuples(st.integers(0, 5), IDS).map(list),
        "view": st.lists(IDS, min_size=1, max_size=4, unique=True).map(sorted),
        "drop": st.lists(IDS, max_size=3), "missing": st.none() | st.lists(IDS, max_size=3),
        "version": st.integers(0, 40), "total": st.integers(0, 500), "samples": st.integers(0, 100),
        "digest": st.binary(min_size=16, max_size=16), "checksum": st.none() | st.binary(max_size=16),
        "ok": st.booleans(), "synced": st.booleans(), "re": st.booleans(), "end": st.none() | st.integers(0, 40),
        "reason": st.text(max_size=10), "why": st.text(max_size=10), "void": st.none() | st.sampled_from(sorted(M.VOID)),
        "round": st.integers(-1, 40), "members": st.integers(0, 5), "min_id": IDS,
        "promised": st.none() | st.tuples(st.integers(0, 5), IDS).map(list),
    }.get(name, VALUES)
    return st.one_of(plausible, plausible, plausible, VALUES)


@st.composite
def round_messages(draw):
    t = draw(st.sampled_from(TYPES))
    names = [name for name, _ in M._SCHEMA[t][1]]
    msg = {"t": t}
    for name in names:
        if draw(st.integers(0, 9)):  # (now and then a field is missing)
            msg[name] = draw(round_field(name))
    if draw(st.integers(0, 9)) == 0:
        msg[draw(st.text(max_size=4))] = draw(VALUES)
    return through_msgpack(msg)


@FUZZ
@given(round_messages())
def test_round_messages_parse_or_raise_the_remote_fault_error(msg):
    try:
        M.parse(msg)
    except RemoteProtocolError:
        pass


@FUZZ
@given(st.lists(st.tuples(st.sampled_from(["b", "c", "z"]), round_messages()), min_size=1, max_size=12),
       st.integers(0, 3))
def test_a_round_machine_handles_any_message_from_a_linked_peer_or_refuses_it(messages, ticks):
    """A member of a running cluster fed forged round messages (a hostile insider's): each is
    handled or refused with the remote-fault error, and the machine keeps answering ticks."""
    import sys
    sys.path.insert(0, os.path.dirname(__file__))
    from roundnet import Net

    net = Net("abc")
    net.found()
    net.run(0.3)
    a = net.m["a"]
    for sender, msg in messages:
        try:
            a.on_message(sender, msg, net.clock("a"))
        except RemoteProtocolError:
            pass
        for _ in range(ticks):
            net.now += 0.1
            a.on_tick(net.clock("a"))


# -- the other frame headers: ring chunks, state transfer, keepalives, sketches --------------------
@FUZZ
@given(st.dictionaries(st.sampled_from(["t", "op", "g", "c", "n", "z", "p", "raw", "k"]), VALUES, max_size=9),
       st.booleans())
def test_chunk_headers_of_any_shape(header, may_be_raw):
    valid = chunk_header(3, Transfer(1, 2, 0, 100, True, 1), 100, "int8", {"s": 1}, False)
    for h in (through_msgpack(header), through_msgpack({**valid, **header})):
        try:
            check_chunk_header(h, "b", 3, Transfer(1, 2, 0, 100, True, 1), 100, "int8", may_be_raw)
        except (RemoteProtocolError, GroupError):  # (GroupError: another shape or codec, the user's to fix)
            pass


class FakeMesh:
    def __init__(self):
        self.sent = []

    def post(self, *args):
        self.sent.append(args)


FINGERPRINT = [("w", (4, 3), "float32", True), ("b", (3,), "float32", True)]


@FUZZ
@given(st.dictionaries(st.sampled_from(["t", "k", "id", "only", "i", "n", "size", "sync", "checksum", "why"]),
                       VALUES, max_size=10),
       st.sampled_from([statesync.ASK, statesync.PART, statesync.REFUSE, statesync.MODEL, "x", None]),
       st.binary(max_size=64) | VALUES.map(lambda v: msgpack.packb(v, use_bin_type=True)))
def test_state_frames_of_any_shape(header, kind, payload):
    """A STATE frame from a linked peer: asks, parts, refusals and fingerprints of any shape."""
    transfer = statesync.StateTransfer(FakeMesh(), FINGERPRINT, on_ask=lambda *a: None,
                                       on_foreign=lambda *a: None)
    transfer.refuse = lambda *a, **k: None  # (its answer is sent by a task: the I/O side)
    h = through_msgpack({**header, "t": wire.STATE, **({"k": kind} if kind is not None else {})})
    try:
        transfer.on_frame("b", wire.Frame(h, memoryview(payload)))
    except RemoteProtocolError:
        pass
    try:
        assembly = statesync.Assembly(h, limit=1 << 16)
        assembly.add(h, memoryview(payload))
    except RemoteProtocolError:
        pass


def test_a_state_part_with_an_unhashable_id_is_refused_as_the_peers_fault():
    """(found by the fuzzer) a part's id that msgpack decodes as a list raised TypeError."""
    transfer = statesync.StateTransfer(FakeMesh(), FINGERPRINT, on_ask=lambda *a: None,
                                       on_foreign=lambda *a: None)
    with pytest.raises(RemoteProtocolError):
        transfer.on_frame("b", wire.Frame({"t": wire.STATE, "k": statesync.PART, "id": [1]}, memoryview(b"")))


# -- codecs ----------------------------------------------------------------------------------------
SPECS = ["none", "fp16", "bf16", "int8", "topk:0.01", "fp16+nozstd", "int8+nozstd", "topk:0.5+nozstd"]


for _spec in SPECS:  # (compiled kernels are built at the first call: not inside a timed example)
    _enc = parse_codec(_spec).encode(np.ones(8, np.float32))
    parse_codec(_spec).decode_add(_enc.params, _enc.tobytes(), np.zeros(8, np.float32), np.empty(8, np.float32))


@FUZZ
@given(st.sampled_from(SPECS), st.integers(0, 600), VALUES, st.binary(max_size=2000), EDITS,
       st.sampled_from(["garbage", "mutated", "mutated, any params"]))
def test_codec_payloads_decode_and_decode_add_or_raise_codec_error(spec, n, any_params, garbage, edits, source):
    """Garbage, or a valid chunk mutated (with its params or any): decode and decode_add (the
    ring's reduce-scatter path) succeed or raise CodecError, with no floating-point trap."""
    codec = parse_codec(spec)
    params, payload = through_msgpack(any_params), garbage
    if source != "garbage":
        enc = codec.encode(np.random.default_rng(n).standard_normal(n).astype(np.float32))
        payload = mutate(enc.tobytes(), edits)
        if source == "mutated":
            params = through_msgpack(dict(enc.params))
    out, dst = np.empty(n, np.float32), np.zeros(n, np.float32)
    for call in (lambda: codec.decode(params, payload, out),
                 lambda: codec.decode_add(params, payload, dst, np.empty(n, np.float32))):
        try:
            with np.errstate(all="raise"):
                call()
        except RemoteProtocolError:
            pass


# -- snapshots -------------------------------------------------------------------------------------
valid_snapshot = _fuzz_targets.valid_snapshot  # (the fuzz bench's honest snapshot)


SNAPSHOT = valid_snapshot()


@FUZZ
@given(EDITS)
def test_mutated_snapshots_unpack_or_raise_the_remote_fault_error(edits):
    try:
        snapshot.unpack(mutate(SNAPSHOT, edits))
    except RemoteProtocolError:
        pass


@FUZZ
@given(st.one_of(VALUES, st.fixed_dictionaries({"state": VALUES, "tensors": st.lists(VALUES, max_size=3)})),
       st.binary(max_size=64))
def test_snapshot_metadata_of_any_shape(meta, data):
    """The metadata is msgpack a peer wrote: any shape, tensor tables that lie about the bytes."""
    body = msgpack.packb(meta, use_bin_type=True)
    try:
        snapshot.unpack(struct.pack("<I", len(body)) + body + data)
    except RemoteProtocolError:
        pass


def test_a_snapshot_tensor_entry_with_an_unhashable_dtype_is_the_peers_fault():
    """(found by the fuzzer) a dtype that msgpack decodes as a list raised TypeError."""
    body = msgpack.packb({"state": {}, "tensors": [[["float32"], [1], 4]]}, use_bin_type=True)
    with pytest.raises(RemoteProtocolError):
        snapshot.unpack(struct.pack("<I", len(body)) + body + b"\0" * 4)


def test_a_signalling_nan_in_a_bf16_chunk_is_no_floating_point_trap_in_decode_add():
    """(found by bench/fuzz.py) a bf16 value 0x7f81 decodes to a signalling NaN, whose add raised
    FloatingPointError under a caller's np.seterr(all="raise") (and warned otherwise)."""
    codec = parse_codec("bf16+nozstd")
    enc = codec.encode(np.ones(8, np.float32))
    payload = bytearray(enc.tobytes())
    payload[0:2] = b"\x81\x7f"
    dst = np.zeros(8, np.float32)
    with np.errstate(all="raise"):
        codec.decode_add(dict(enc.params), bytes(payload), dst, np.empty(8, np.float32))
    assert np.isnan(dst[0]) and (dst[1:] == 1).all()


def test_a_signalling_nan_in_a_peers_parameter_sketch_is_no_floating_point_trap():
    """(found by bench/fuzz.py --coverage) a sketch whose sum of squares is a signalling NaN raised
    FloatingPointError in ``compare`` under a caller's np.seterr(all="raise") (and warned otherwise);
    it is a replica as far as can be."""
    from p2ptrain.cluster import drift

    mine = drift.param_sketch([torch.ones(50, 20), torch.ones(20)])
    theirs = drift.decode(mine).copy()
    theirs[0, 0] = 1.0  # (its bit sum: not identical)
    theirs[0, 2:3] = np.array([0x7FF0000000000001], np.uint64).view("<f8")
    with np.errstate(all="raise"):
        d = drift.compare(mine, theirs.tobytes())
    assert d.relative == float("inf") and d.group == 0 and d.beyond


@pytest.mark.timeout(10)
def test_feeding_a_held_decoder_returns_instead_of_spinning():
    """(found by bench/fuzz.py) ``feed`` on a decoder held before admission (a frame announced
    a payload) looped for ever on the empty buffer it was given; a link stops reading there."""
    dec = wire.FrameDecoder(admitted=False)
    assert dec.feed(wire.pack_header({"t": wire.CHUNK}, 10) + b"x" * 10) == [] and dec.held


# -- the handshake --------------------------------------------------------------------------------
INFO = {"port": 7000, "settings": {"compression": "int8", "staleness": 1}, "model": b"m" * 16}


def handshake_end(pid, secret):
    return _fuzz_targets.handshake_end(pid, secret, INFO)


def honest_transcript(secret):
    """What an honest dialer sends to the listener, and the listener to it."""
    return _fuzz_targets.honest_transcript(secret, INFO)


def proven(header):
    """The fields the proofs cover, with their types (the hello's ``info`` is not among them)."""
    return [(type(header.get(k)), header.get(k)) for k in ("t", "v", "cluster", "id", "nonce", "auth", "mac")]


HANDSHAKE_FIELDS = st.dictionaries(st.sampled_from(["t", "v", "cluster", "id", "nonce", "auth", "info", "mac", "x"]),
                                   VALUES | st.binary(min_size=32, max_size=32), max_size=8)


@FUZZ
@given(st.booleans(), st.sampled_from([None, b"secret"]), EDITS,
       st.lists(st.tuples(st.integers(0, 4), HANDSHAKE_FIELDS), max_size=3))
def test_the_handshake_admits_on_the_honest_transcript_only_or_raises_the_remote_fault_error(
        dialer, secret, edits, forged):
    """Either end, fed the other's honest messages mutated as bytes, with forged headers (any
    fields) put among them: each step answers or raises ``RemoteProtocolError`` (a FrameError
    from the bytes, a HandshakeError from the end), and with a secret it admits only when what
    the proofs cover is what the honest peer sent."""
    to_listener, to_dialer = honest_transcript(secret)
    honest = to_dialer if dialer else to_listener
    headers = [f.header for f in wire.FrameDecoder(admitted=False).feed(b"".join(wire.frame_bytes(h) for h in honest))]
    data = mutate(b"".join(wire.frame_bytes(h) for h in headers), edits)
    hs = handshake_end("d" if dialer else "l", secret)
    hs.start(dialer=dialer)
    got = []
    try:
        received = wire.FrameDecoder(admitted=False).feed(data)
        steps = [f.header for f in received]
        for where, fields in forged:
            steps.insert(where % (len(steps) + 1), through_msgpack({**fields, "t": fields.get("t", wire.HELLO)}))
        for header in steps:
            if hs.done:
                break
            got.append(header)
            hs.receive(header)
    except RemoteProtocolError:
        pass
    if hs.done and secret is not None:
        assert [proven(h) for h in got] == [proven(h) for h in honest[:len(got)]]


def test_the_long_fuzz_runs_every_parser_briefly():
    """``bench/fuzz.py``'s targets, 300 inputs each: its list stays the parsers', and none finds anything."""
    import fuzz

    reports = [fuzz.fuzz(t, 300, 60.0, seed=1, hang=None) for t in fuzz.targets()]
    assert [r["name"] for r in reports] == fuzz.TARGET_NAMES
    assert all(r["tried"] == 300 for r in reports)
    assert [r["findings"] for r in reports if r["findings"]] == []
