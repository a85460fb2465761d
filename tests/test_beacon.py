"""Beacons, the beacon filter and the heard-peers table: pure code, fed bytes and times."""

from __future__ import annotations

import dataclasses
import struct

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2ptrain.net import auth, beacon as beacon_mod, wire
from p2ptrain.net.beacon import (MAX_BEACON_BYTES, Beacon, BeaconFilter, HeardPeers, decode_beacon, encode_beacon)
from p2ptrain.errors import ConfigError, FrameError, HandshakeError
from p2ptrain.identity import new_peer_id

SECRET = b"s3cret"
B = Beacon(cluster="lab", peer_id="peer-b", port=7001, device="mps", round=42, state="training")
ME = "peer-me"


def raw(fields: dict, tag: bytes = b"") -> bytes:
    """A datagram with an arbitrary body, bypassing the encoder's checks."""
    body = msgpack.packb(fields, use_bin_type=True)
    return struct.pack("<4sH", b"P2PB", len(body)) + body + tag


FIELDS = {"v": wire.PROTOCOL_VERSION, "c": "lab", "id": "peer-b", "p": 7001, "d": "mps", "r": 42, "s": "training"}


def flt(secret=SECRET, cluster="lab") -> BeaconFilter:
    return BeaconFilter(cluster=cluster, peer_id=ME, secret=secret)


# -- encode / decode ------------------------------------------------------------------------

@pytest.mark.parametrize("secret", [None, SECRET])
def test_round_trip(secret):
    data = encode_beacon(B, secret)
    assert len(data) <= MAX_BEACON_BYTES
    assert decode_beacon(data, secret) == B


def test_defaults_and_version():
    b = Beacon(cluster="c", peer_id="p", port=1)
    assert (b.version, b.device, b.round, b.state) == (wire.PROTOCOL_VERSION, "cpu", 0, "syncing")
    assert not hasattr(b, "host")  # the receiver takes the host from the datagram


def test_tag_is_checked():
    data = encode_beacon(B, SECRET)
    with pytest.raises(HandshakeError) as err:
        decode_beacon(data, b"other secret")
    assert err.value.reason == auth.REASON_SECRET
    flipped = data[:-1] + bytes([data[-1] ^ 1])
    with pytest.raises(HandshakeError):
        decode_beacon(flipped, SECRET)
    body_flipped = bytearray(data)
    body_flipped[10] ^= 0x01
    with pytest.raises((HandshakeError, FrameError)):
        decode_beacon(bytes(body_flipped), SECRET)


def test_tag_required_with_a_secret_and_refused_without():
    with pytest.raises(HandshakeError) as err:
        decode_beacon(encode_beacon(B, None), SECRET)
    assert err.value.reason == auth.REASON_SECRET_MODE
    with pytest.raises(HandshakeError) as err:
        decode_beacon(encode_beacon(B, SECRET), None)
    assert err.value.reason == auth.REASON_SECRET_MODE


def test_tag_is_not_a_handshake_proof_key():
    body = b"x"
    assert auth.beacon_tag(SECRET, body) != auth.derive_key(SECRET, "handshake")


def test_other_version_is_refused():
    data = raw({**FIELDS, "v": 99, "new": [1, 2]})
    with pytest.raises(HandshakeError) as err:
        decode_beacon(data, None)
    assert err.value.reason == auth.REASON_VERSION


@pytest.mark.parametrize("data", [
    b"", b"P2PB", b"XXXX\x00\x00", b"P2PB\x05\x00abc", raw(FIELDS, b"short tag"),
    raw({**FIELDS, "p": 0}), raw({**FIELDS, "p": 70000}), raw({**FIELDS, "p": "7001"}), raw({**FIELDS, "r": -1}),
    raw({**FIELDS, "c": ""}), raw({**FIELDS, "c": "x" * 65}), raw({**FIELDS, "id": "a\x1b[2Jb"}),
    raw({**FIELDS, "d": None}), raw({**FIELDS, "s": "s" * 17}), raw({k: v for k, v in FIELDS.items() if k != "id"}),
    raw([1, 2, 3]), raw({**FIELDS, "v": "1"}), raw({**FIELDS, "v": True}),
    struct.pack("<4sH", b"P2PB", 1) + b"\xc1",  # a reserved msgpack byte
])
def test_malformed_is_a_frame_error(data):
    with pytest.raises(FrameError):
        decode_beacon(data, None)
    f = flt(None)
    assert f.accept(data, "10.0.0.9", 0.0) is None
    assert f.counts["malformed"] == 1 and f.counts["accepted"] == 0


def test_unknown_keys_are_ignored():
    assert decode_beacon(raw({**FIELDS, "future": {"x": 1}}), None) == B


@pytest.mark.parametrize("change", [{"cluster": ""}, {"cluster": "x" * 65}, {"peer_id": "a\nb"}, {"port": 0},
                                    {"round": -1}, {"device": "d" * 17}, {"state": ""}])
def test_encoder_refuses_bad_fields(change):
    with pytest.raises(ConfigError):
        encode_beacon(dataclasses.replace(B, **change), None)


# -- the filter -----------------------------------------------------------------------------

def test_filter_accepts_our_cluster():
    f = flt()
    assert f.accept(encode_beacon(B, SECRET), "10.0.0.2", 0.0) == B
    assert f.counts == {"accepted": 1, "own": 0, "other_cluster": 0, "bad_tag": 0, "malformed": 0, "other_version": 0}
    assert f.dropped == 0 and f.describe_drops() == ""


def test_filter_drops_and_counts_each_reason():
    f = flt()
    own = dataclasses.replace(B, peer_id=ME)
    other = dataclasses.replace(B, cluster="other")
    cases = [
        (encode_beacon(own, SECRET), "own"),
        (encode_beacon(other, SECRET), "other_cluster"),
        (encode_beacon(other, b"their own secret"), "other_cluster"),  # another team's cluster: no alarm
        (encode_beacon(B, b"wrong"), "bad_tag"),
        (encode_beacon(B, None), "bad_tag"),
        (b"\x00" * 20, "malformed"),
        (raw({**FIELDS, "v": 99}), "other_version"),
    ]
    for data, reason in cases:
        before = dict(f.counts)
        assert f.accept(data, "10.0.0.7", 1.0) is None, reason
        assert f.counts[reason] == before[reason] + 1, reason
    assert f.counts["accepted"] == 0
    assert f.last_other_version == 99 and f.last_other_version_from == "10.0.0.7"
    assert f.dropped == len(cases) - 1  # own beacons are not "dropped"
    text = f.describe_drops()
    assert "2 with a bad tag (last from 10.0.0.7)" in text and "2 of another cluster" in text
    assert "protocol version 99" in text


def test_filter_without_a_secret_drops_tagged_beacons():
    f = flt(None)
    assert f.accept(encode_beacon(B, SECRET), "10.0.0.7", 0.0) is None
    assert f.counts["bad_tag"] == 1
    assert f.accept(encode_beacon(B, None), "10.0.0.7", 0.0) == B


def test_all_clusters_filter():
    f = BeaconFilter(cluster=None, peer_id=ME, secret=None)
    assert f.accept(encode_beacon(dataclasses.replace(B, cluster="zzz"), None), "10.0.0.2", 0.0).cluster == "zzz"


def test_oversize_refused_before_parsing(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("parsed an oversize datagram")
    data = encode_beacon(B, None)
    data += b"\x00" * (MAX_BEACON_BYTES + 1 - len(data))
    monkeypatch.setattr(beacon_mod.msgpack, "unpackb", boom)
    f = flt(None)
    assert f.accept(data, "10.0.0.2", 0.0) is None
    assert f.counts["malformed"] == 1
    with pytest.raises(FrameError, match="exceeds"):
        decode_beacon(data, None)


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=2000))
def test_fuzz_random_bytes_never_raise(data):
    for secret in (None, SECRET):
        assert flt(secret).accept(data, "10.0.0.1", 0.0) is None
        try:
            decode_beacon(data, secret)
        except (FrameError, HandshakeError):
            pass


_scalars = (st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | st.text(max_size=70)
            | st.binary(max_size=20))
_values = _scalars | st.lists(_scalars, max_size=3) | st.dictionaries(st.text(max_size=3), _scalars, max_size=3)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(["v", "c", "id", "p", "d", "r", "s", "x"]), _values, max_size=8),
       st.sampled_from([b"", b"\x00" * 32, b"\x00" * 5]))
def test_fuzz_structured_bodies_never_raise(fields, tag):
    data = raw({**FIELDS, **fields}, tag)
    for secret in (None, SECRET):
        result = flt(secret).accept(data, "10.0.0.1", 0.0)
        assert result is None or isinstance(result, Beacon)
        try:
            decode_beacon(data, secret)
        except (FrameError, HandshakeError):
            pass


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 200), st.integers(0, 7))
def test_fuzz_bit_flips_in_a_tagged_beacon_are_never_accepted(pos, bit):
    data = bytearray(encode_beacon(B, SECRET))
    pos %= len(data)
    data[pos] ^= 1 << bit
    assert flt().accept(bytes(data), "10.0.0.1", 0.0) in (None,)


# -- log policy -----------------------------------------------------------------------------

def test_bad_tag_flood_logged_at_most_once_per_30s():
    f = flt()
    bad = encode_beacon(B, b"wrong")
    lines = []
    t = 100.0
    for i in range(3000):  # 100 beacons a second for 30 s
        t = 100.0 + i * 0.01
        f.accept(bad, "10.0.0.7", t)
        lines += [(t, line) for line in f.take_log_lines(t)]
    assert len(lines) == 1 and lines[0][0] == 100.0  # the first one at once
    assert lines[0][1].startswith("dropped 1 beacon with a bad tag from 10.0.0.7")
    assert f.take_log_lines(129.99) == []
    (line,) = f.take_log_lines(130.0)
    assert line == "dropped 2999 beacons with a bad tag from 10.0.0.7 in the last 30 s: is its --secret the same?"
    assert f.take_log_lines(200.0) == []  # nothing new, nothing said
    assert f.counts["bad_tag"] == 3000


def test_log_line_summarises_several_hosts_and_reasons_in_one_line():
    f = flt()
    f.take_log_lines(0.0)
    for ip in ("10.0.0.7", "10.0.0.7", "10.0.0.8"):
        f.accept(encode_beacon(B, b"wrong"), ip, 1.0)
    f.accept(encode_beacon(B, None), "10.0.0.9", 1.0)
    f.accept(raw({**FIELDS, "v": 99}), "10.0.0.10", 1.0)
    (line,) = f.take_log_lines(1.0)
    assert "\n" not in line
    assert "dropped 3 beacons with a bad tag from 10.0.0.7 and 1 other host:" in line
    assert "without a tag from 10.0.0.9" in line and "1 beacon of protocol version 99 from 10.0.0.10" in line


def test_other_clusters_and_own_beacons_are_never_logged():
    f = flt()
    for t in range(100):
        f.accept(encode_beacon(dataclasses.replace(B, cluster="other"), b"x"), "10.0.0.7", float(t))
        f.accept(encode_beacon(dataclasses.replace(B, peer_id=ME), SECRET), "10.0.0.1", float(t))
        assert f.take_log_lines(float(t)) == []


def test_log_memory_is_bounded_under_spoofed_sources():
    f = flt()
    bad = encode_beacon(B, b"wrong")
    for i in range(5000):
        f.accept(bad, f"10.{i // 65536}.{i // 256 % 256}.{i % 256}", 1.0)
    assert len(f._window) <= beacon_mod._MAX_LOG_KEYS + 1
    (line,) = f.take_log_lines(1.0)
    assert "dropped 5000 beacons with a bad tag" in line


# -- heard peers ----------------------------------------------------------------------------

def test_heard_peers_update_and_expire():
    h = HeardPeers()
    assert h.update(B, "10.0.0.2", 0.0) is True
    assert h.update(B, "10.0.0.2", 1.0) is False  # nothing new
    assert h.update(dataclasses.replace(B, round=43), "10.0.0.2", 2.0) is True
    c = dataclasses.replace(B, peer_id="peer-c", device="cuda")
    h.update(c, "10.0.0.3", 3.0)
    assert [(p.beacon.peer_id, p.ip, p.last_seen) for p in h.peers()] == [("peer-b", "10.0.0.2", 2.0),
                                                                          ("peer-c", "10.0.0.3", 3.0)]
    assert h.expire(7.0, ttl=5.0) == []
    (gone,) = h.expire(7.5, ttl=5.0)
    assert gone.beacon.peer_id == "peer-b" and gone.ip == "10.0.0.2"
    assert [p.beacon.peer_id for p in h.peers()] == ["peer-c"] and "peer-b" not in h and len(h) == 1
    h.expire(100.0)
    assert h.peers() == []


def test_heard_peer_keeps_its_first_fresh_address():
    h = HeardPeers()
    h.update(B, "10.0.0.2", 0.0)  # multicast on the wired interface
    h.update(B, "192.168.1.2", 0.5)  # broadcast on Wi-Fi
    h.update(B, "10.0.0.2", 1.0)
    assert h.peers()[0].ip == "10.0.0.2" and h.addresses("peer-b") == ["10.0.0.2", "192.168.1.2"]
    h.update(B, "192.168.1.2", 6.0)
    h.expire(6.5, ttl=5.0)  # the wired address went quiet
    assert h.peers()[0].ip == "192.168.1.2" and h.peers()[0].last_seen == 6.0


def test_leaving_beacon_removes_the_peer_at_once():
    h = HeardPeers()
    h.update(B, "10.0.0.2", 0.0)
    assert h.update(dataclasses.replace(B, state="leaving"), "10.0.0.2", 0.1) is True
    assert h.peers() == []
    assert h.update(dataclasses.replace(B, state="leaving"), "10.0.0.2", 0.2) is False


def test_heard_peers_are_bounded():
    h = HeardPeers(max_peers=3)
    for i in range(10):
        h.update(dataclasses.replace(B, peer_id=f"p{i}"), "10.0.0.2", 0.0)
    assert len(h) == 3
    assert h.update(dataclasses.replace(B, peer_id="p0", round=1), "10.0.0.2", 0.0) is True  # known peers update


def test_new_peer_id_is_fresh_hex():
    ids = {new_peer_id() for _ in range(100)}
    assert len(ids) == 100 and all(len(i) == 16 and int(i, 16) >= 0 for i in ids)
