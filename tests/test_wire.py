"""The frame codec: fed whole, byte by byte, and fuzzed; bad frames raise FrameError only."""


import msgpack
import pytest
from hypothesis import given, settings, strategies as st

from p2ptrain.net import wire
from p2ptrain.errors import FrameError


def prefix(header_len, payload_len, magic=wire.MAGIC, version=wire.PROTOCOL_VERSION, flags=0):
    return wire.PREFIX.pack(magic, version, flags, header_len, payload_len)


def test_round_trip_whole_and_byte_at_a_time():
    frames = [({"t": "chunk", "g": 1, "c": 2, "p": {"s": 0.5}}, b"x" * 1000),
              ({"t": "hello", "nonce": b"\0" * 32}, b""),
              ({"t": "bye"}, bytes(range(256)))]
    data = b"".join(wire.frame_bytes(h, p) for h, p in frames)
    got = wire.FrameDecoder().feed(data)
    assert [(f.header, bytes(f.payload)) for f in got] == frames
    dec = wire.FrameDecoder()
    one_by_one = []
    for i in range(len(data)):
        one_by_one += dec.feed(data[i:i + 1])
    assert [(f.header, bytes(f.payload)) for f in one_by_one] == frames
    assert dec.idle


def test_payload_goes_to_the_allocators_buffer():
    target = bytearray(8)
    dec = wire.FrameDecoder(allocate=lambda h, n: memoryview(target)[:n])
    (frame,) = dec.feed(wire.frame_bytes({"t": "chunk"}, b"abcdefgh"))
    assert target == b"abcdefgh" and frame.payload.obj is target


def test_encode_frame_passes_payload_views_uncopied():
    import numpy as np
    arr = np.arange(4, dtype=np.float32)
    bufs = wire.encode_frame({"t": "chunk"}, [memoryview(arr)])
    assert bufs[1].obj is arr


@pytest.mark.parametrize("data, match", [
    (prefix(10, 0, magic=b"HTTP"), "bad magic"),
    (prefix(10, 0, version=99), "version 99"),
    (prefix(10, 0, flags=1), "flags"),
    (prefix(0, 0), "header length"),
    (prefix(wire.MAX_HEADER_BYTES + 1, 0), "header length"),
    (prefix(10, 1 << 60), "exceeds the limit"),
    (prefix(3, 0) + b"\xc1\xc1\xc1", "undecodable"),
    (prefix(1, 0) + msgpack.packb(5), "not a map"),
    (prefix(len(msgpack.packb({"x": 1})), 0) + msgpack.packb({"x": 1}), "message type"),
])
def test_bad_frames_raise_frame_error(data, match):
    dec = wire.FrameDecoder()
    with pytest.raises(FrameError, match=match) as err:
        dec.feed(data)
    assert err.value.peer_version == (99 if match == "version 99" else None)  # the cause, for the reply
    with pytest.raises(FrameError):  # dead after an error
        dec.get_buffer()


def test_payload_limit_is_checked_before_allocation():
    calls = []
    dec = wire.FrameDecoder(max_payload=100, allocate=lambda h, n: calls.append(n) or memoryview(bytearray(n)))
    with pytest.raises(FrameError):
        dec.feed(wire.pack_header({"t": "chunk"}, 101))
    assert calls == []


def test_truncated_frame_is_not_idle():
    dec = wire.FrameDecoder()
    assert dec.feed(wire.frame_bytes({"t": "chunk"}, b"abc")[:-1]) == []
    assert not dec.idle


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_fuzz_random_bytes_parse_or_frame_error(data):
    try:
        wire.FrameDecoder().feed(data)
    except FrameError:
        pass


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=100), st.integers(0, 2**64 - 1))
def test_fuzz_valid_prefix_random_header(body, payload_len):
    data = prefix(max(1, len(body)), payload_len) + body
    try:
        wire.FrameDecoder(max_payload=1 << 20).feed(data)
    except FrameError:
        pass


def test_before_admission_a_frame_announcing_a_payload_is_held_at_its_prefix_unallocated():
    """A stranger's 16-byte prefix announcing 1 GiB allocated 1 GiB (issue 59): before the
    handshake admits a link nothing is read past such a prefix, and nothing is allocated."""
    calls = []
    dec = wire.FrameDecoder(allocate=lambda h, n: calls.append(n) or memoryview(bytearray(n)), admitted=False)
    hello = wire.frame_bytes({"t": "hello"})
    big = wire.pack_header({"t": "chunk"}, 1 << 30)
    assert [f.type for f in dec.feed(hello)] == ["hello"]  # (payload-less frames pass)
    buf = dec.get_buffer()
    buf[:wire.PREFIX_SIZE] = big[:wire.PREFIX_SIZE]
    dec.buffer_updated(wire.PREFIX_SIZE)
    assert dec.held and len(dec.get_buffer()) == 0 and calls == []


def test_a_held_frame_goes_on_once_admitted():
    dec = wire.FrameDecoder(admitted=False)
    data = wire.frame_bytes({"t": "welcome"}) + wire.frame_bytes({"t": "chunk", "i": 1}, b"abc")
    got = []
    while data and not dec.held:  # (as a transport does: as much as the decoder has room for)
        buf = dec.get_buffer()
        n = min(len(buf), len(data))
        buf[:n], data = data[:n], data[n:]
        dec.buffer_updated(n)
        got += dec.pop_frames()
    assert [f.type for f in got] == ["welcome"] and dec.held
    dec.admit()
    assert not dec.held
    (chunk,) = dec.feed(data)
    assert chunk.header["i"] == 1 and bytes(chunk.payload) == b"abc"


def test_an_admitted_decoder_limits_as_before():
    dec = wire.FrameDecoder(max_payload=100, admitted=False)
    dec.admit()
    assert bytes(dec.feed(wire.frame_bytes({"t": "chunk"}, b"x" * 100))[0].payload) == b"x" * 100
    with pytest.raises(FrameError, match="exceeds"):
        wire.FrameDecoder(max_payload=100, admitted=False).feed(wire.pack_header({"t": "chunk"}, 101))
