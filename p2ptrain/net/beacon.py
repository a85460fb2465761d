"""Discovery beacons: what a peer announces once a second, and which beacons we believe.
Pure code: bytes, addresses and the current time in; beacons, counters and log lines out.

A beacon is one UDP datagram of at most ``MAX_BEACON_BYTES``::

    magic "P2PB" | body_len u16 (little-endian) | body (msgpack map) | tag (0 or 32 bytes)

    body = {"v": protocol version, "c": cluster, "id": peer id, "p": TCP port,
            "d": device kind, "r": round, "s": state}       (unknown keys are ignored)
    tag  = auth.beacon_tag(secret, body) with a secret, absent without one

The host is not in the beacon: the receiver takes it from the datagram's source address.

``BeaconFilter.accept`` checks, in this order: size, layout, version, fields, cluster,
own id, tag. Version comes before fields because another version's body may mean other
things; cluster comes before the tag because another cluster on the same LAN, with its own
secret, is normal and must not raise a "wrong secret?" alarm. Every drop is counted.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import NamedTuple

import msgpack

from p2ptrain.net import auth, wire
from p2ptrain.errors import ConfigError, FrameError, HandshakeError

MAGIC = b"P2PB"
_PREFIX = struct.Struct("<4sH")
TAG_BYTES = 32
# Security limit: one unfragmented datagram on any LAN (Ethernet 1500 minus IP/UDP headers).
MAX_BEACON_BYTES = 1400
MAX_DEVICE_LEN = 16
MAX_STATE_LEN = 16
MAX_ROUND = (1 << 63) - 1
LOG_INTERVAL = 30.0  # seconds between two summary lines about dropped beacons
HEARD_TTL = 5.0  # a peer not heard for this long is forgotten (five beacon intervals)
MAX_HEARD = 1024  # security limit on peers remembered (forged ids without a secret)
_MAX_LOG_KEYS = 64  # (reason, ip) pairs remembered per log window; more are summed up

COUNTERS = ("accepted", "own", "other_cluster", "bad_tag", "malformed", "other_version")


@dataclass(frozen=True, kw_only=True)
class Beacon:
    """One peer's announcement. ``round``/``state`` are informational (the membership
    code decides who is a member, after the TCP handshake)."""

    version: int = wire.PROTOCOL_VERSION
    cluster: str
    peer_id: str
    port: int
    device: str = "cpu"
    round: int = 0
    state: str = "syncing"


def _field_problem(v: object, c: object, pid: object, port: object, dev: object, rnd: object,
                   state: object) -> str | None:
    """Why these beacon fields are invalid, or None. Shared by encoder and decoder."""
    def text(x: object, limit: int) -> bool:
        return isinstance(x, str) and 0 < len(x) <= limit and x.isprintable()

    if type(v) is not int:
        return "version is not an integer"
    if not text(c, auth.MAX_CLUSTER_LEN):
        return f"cluster must be 1..{auth.MAX_CLUSTER_LEN} printable characters"
    if not text(pid, auth.MAX_ID_LEN):
        return f"peer id must be 1..{auth.MAX_ID_LEN} printable characters"
    if type(port) is not int or not 0 < port < 65536:
        return "port must be 1..65535"
    if not text(dev, MAX_DEVICE_LEN):
        return f"device must be 1..{MAX_DEVICE_LEN} printable characters"
    if type(rnd) is not int or not 0 <= rnd <= MAX_ROUND:
        return "round must be a non-negative 64-bit integer"
    if not text(state, MAX_STATE_LEN):
        return f"state must be 1..{MAX_STATE_LEN} printable characters"
    return None


def encode_beacon(b: Beacon, secret: bytes | None) -> bytes:
    """The datagram for ``b``, tagged when ``secret`` is set. Raises ConfigError on bad fields."""
    problem = _field_problem(b.version, b.cluster, b.peer_id, b.port, b.device, b.round, b.state)
    if problem:
        raise ConfigError(f"cannot announce this peer: {problem}")
    body = msgpack.packb({"v": b.version, "c": b.cluster, "id": b.peer_id, "p": b.port,
                          "d": b.device, "r": b.round, "s": b.state}, use_bin_type=True)
    tag = auth.beacon_tag(secret, body) if secret else b""
    data = _PREFIX.pack(MAGIC, len(body)) + body + tag
    if len(data) > MAX_BEACON_BYTES:  # unreachable with the field limits above
        raise ConfigError(f"beacon of {len(data)} bytes exceeds {MAX_BEACON_BYTES}")
    return data


class _Raw(NamedTuple):
    version: int
    body: bytes
    fields: dict
    tag: bytes


def _split(data: bytes) -> _Raw:
    """Layout and msgpack checks only. Raises FrameError, nothing else."""
    if len(data) > MAX_BEACON_BYTES:
        raise FrameError(f"beacon of {len(data)} bytes exceeds {MAX_BEACON_BYTES}")
    if len(data) < _PREFIX.size:
        raise FrameError("datagram too short for a beacon")
    magic, body_len = _PREFIX.unpack_from(data)
    if magic != MAGIC:
        raise FrameError("not a p2ptrain beacon (bad magic)")
    body = bytes(data[_PREFIX.size:_PREFIX.size + body_len])
    tag = bytes(data[_PREFIX.size + body_len:])
    if len(body) != body_len or len(tag) not in (0, TAG_BYTES):
        raise FrameError("beacon lengths do not add up")
    try:
        fields = msgpack.unpackb(body, raw=False, strict_map_key=True, max_str_len=MAX_BEACON_BYTES,
                                 max_bin_len=MAX_BEACON_BYTES, max_array_len=64, max_map_len=32, max_ext_len=0)
    except Exception:  # msgpack raises many types; all mean "not a beacon body"
        raise FrameError("undecodable beacon body") from None
    if not isinstance(fields, dict) or type(fields.get("v")) is not int:
        raise FrameError("beacon body is not a map with a version")
    return _Raw(fields["v"], body, fields, tag)


def _to_beacon(raw: _Raw) -> Beacon:
    f = raw.fields
    values = (raw.version, f.get("c"), f.get("id"), f.get("p"), f.get("d"), f.get("r"), f.get("s"))
    problem = _field_problem(*values)
    if problem:
        raise FrameError(f"malformed beacon: {problem}")
    v, c, pid, port, dev, rnd, state = values
    return Beacon(version=v, cluster=c, peer_id=pid, port=port, device=dev, round=rnd, state=state)


def _tag_problem(raw: _Raw, secret: bytes | None) -> str | None:
    """None when the tag matches our auth mode: 'wrong', 'missing' or 'unexpected' otherwise."""
    if secret is None:
        return "unexpected" if raw.tag else None
    if not raw.tag:
        return "missing"
    return None if auth.beacon_tag_ok(secret, raw.body, raw.tag) else "wrong"


def decode_beacon(data: bytes, secret: bytes | None) -> Beacon:
    """Strictly decode one datagram. Raises FrameError when malformed or oversize, and
    HandshakeError (a fixed reason from ``auth``) for another protocol version or a tag
    that does not match our secret. Cluster and own id are the caller's (or the filter's)."""
    raw = _split(data)
    if raw.version != wire.PROTOCOL_VERSION:
        raise HandshakeError(auth.REASON_VERSION)
    beacon = _to_beacon(raw)
    problem = _tag_problem(raw, secret)
    if problem == "wrong":
        raise HandshakeError(auth.REASON_SECRET)
    if problem:
        raise HandshakeError(auth.REASON_SECRET_MODE)
    return beacon


_LOG_TEXT = {  # reason -> (what was dropped, what to do)
    "wrong": ("beacon{s} with a bad tag", "is its --secret the same?"),
    "missing": ("beacon{s} without a tag", "that peer has no --secret: start every peer with the same one"),
    "unexpected": ("beacon{s} tagged with a secret", "this peer has no --secret: start every peer with the same one"),
    "version": ("beacon{s} of protocol version {v}", "run the same p2ptrain version everywhere"),
    "malformed": ("malformed datagram{s}",
                  "another program uses the discovery port? pick another with --discovery-port"),
}


class BeaconFilter:
    """Decides which datagrams are beacons of our cluster worth believing.

    ``accept()`` per datagram; ``take_log_lines(now)`` whenever convenient (after each
    datagram is fine): it returns at most one summary line per ``log_interval`` about
    drops worth a human's attention (bad tags, other versions, malformed datagrams).
    ``counts`` has one counter per outcome (see ``COUNTERS``). ``cluster=None`` accepts
    every cluster (the peers command's ``--all-clusters``)."""

    def __init__(self, *, cluster: str | None, peer_id: str | None, secret: bytes | None,
                 log_interval: float = LOG_INTERVAL):
        self.cluster = cluster
        self.peer_id = peer_id
        self.secret = secret
        self.log_interval = log_interval
        self.counts: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self.last_other_version: int | None = None
        self.last_other_version_from: str | None = None
        self.last_drop_from: dict[str, str] = {}  # counter -> source of the latest such beacon
        self._window: dict[tuple[str, str], int] = {}  # (reason, ip) -> drops since the last line
        self._window_start: float | None = None
        self._last_logged = -math.inf

    @property
    def dropped(self) -> int:
        """Beacons dropped for a reason other than being our own."""
        return sum(n for k, n in self.counts.items() if k not in ("accepted", "own"))

    def describe_drops(self) -> str:
        """The drop counters in words, e.g. 'dropped beacons: 3 with a bad tag (last from 10.0.0.7)'; '' if none."""
        words = {"bad_tag": "with a bad tag", "other_cluster": "of another cluster", "malformed": "malformed",
                 "other_version": f"of protocol version {self.last_other_version}"}
        parts = [f"{self.counts[k]} {w} (last from {self.last_drop_from[k]})"
                 for k, w in words.items() if self.counts[k]]
        return "dropped beacons: " + ", ".join(parts) if parts else ""

    def accept(self, data: bytes, src_ip: str, now: float) -> Beacon | None:
        """The beacon in ``data`` (sent from ``src_ip``) if we believe it, else None. Never raises."""
        try:
            raw = _split(data)
        except FrameError:
            return self._drop("malformed", "malformed", src_ip, now)
        if raw.version != wire.PROTOCOL_VERSION:
            self.last_other_version, self.last_other_version_from = raw.version, src_ip
            return self._drop("other_version", "version", src_ip, now)
        try:
            beacon = _to_beacon(raw)
        except FrameError:
            return self._drop("malformed", "malformed", src_ip, now)
        if self.cluster is not None and beacon.cluster != self.cluster:
            return self._drop("other_cluster", None, src_ip, now)
        if beacon.peer_id == self.peer_id:
            return self._drop("own", None, src_ip, now)
        problem = _tag_problem(raw, self.secret)
        if problem:
            return self._drop("bad_tag", problem, src_ip, now)
        self.counts["accepted"] += 1
        return beacon

    def _drop(self, counter: str, log_reason: str | None, ip: str, now: float) -> None:
        self.counts[counter] += 1
        self.last_drop_from[counter] = ip
        if log_reason is not None:
            key = (log_reason, ip)
            if key in self._window or len(self._window) < _MAX_LOG_KEYS:
                self._window[key] = self._window.get(key, 0) + 1
            else:
                self._window[(log_reason, "?")] = self._window.get((log_reason, "?"), 0) + 1
            if self._window_start is None:
                self._window_start = now
        return None

    def take_log_lines(self, now: float) -> list[str]:
        """At most one line per ``log_interval``, summing up the drops since the last one."""
        if not self._window or now - self._last_logged < self.log_interval:
            return []
        since = self._last_logged if math.isfinite(self._last_logged) else self._window_start
        span = f" in the last {now - since:.0f} s" if now - since >= 1 else ""
        parts = []
        for reason, (what, advice) in _LOG_TEXT.items():
            by_ip = {ip: n for (r, ip), n in self._window.items() if r == reason}
            if not by_ip:
                continue
            top = max(by_ip, key=by_ip.__getitem__)
            others = len(by_ip) - 1
            more = f" and {others} other host{'s' if others > 1 else ''}" if others else ""
            total = sum(by_ip.values())
            what = what.format(s="s" if total != 1 else "", v=self.last_other_version)
            parts.append(f"dropped {total} {what} from {top}{more}{span}: {advice}")
        self._window.clear()
        self._window_start = None
        self._last_logged = now
        return ["; ".join(parts)]


class HeardPeer(NamedTuple):
    beacon: Beacon
    ip: str
    last_seen: float


class HeardPeers:
    """Peers heard recently, by peer id: the addresses discovery proposes. Pure.

    A peer heard on several addresses (multicast on one interface, broadcast on another)
    keeps the first one that is still fresh, so its address does not flap. A beacon with
    state ``"leaving"`` removes its peer at once."""

    def __init__(self, max_peers: int = MAX_HEARD):
        self.max_peers = max_peers
        self._beacons: dict[str, Beacon] = {}
        self._seen: dict[str, dict[str, float]] = {}  # peer id -> {ip: last seen}, first heard first

    def __len__(self) -> int:
        return len(self._beacons)

    def __contains__(self, peer_id: object) -> bool:
        return peer_id in self._beacons

    def update(self, beacon: Beacon, ip: str, now: float) -> bool:
        """Record a beacon. True when the set of peers or one's announcement changed."""
        pid = beacon.peer_id
        if beacon.state == "leaving":
            self._seen.pop(pid, None)
            return self._beacons.pop(pid, None) is not None
        if pid not in self._beacons and len(self._beacons) >= self.max_peers:
            return False
        old = self._beacons.get(pid)
        self._seen.setdefault(pid, {})[ip] = now
        self._beacons[pid] = beacon
        return old != beacon

    def expire(self, now: float, ttl: float = HEARD_TTL) -> list[HeardPeer]:
        """Forget addresses not heard for ``ttl`` seconds; return the peers forgotten."""
        gone = []
        for pid in list(self._seen):
            seen = self._seen[pid]
            first, last = next(iter(seen)), max(seen.values())
            for ip in [ip for ip, t in seen.items() if now - t > ttl]:
                del seen[ip]
            if not seen:
                gone.append(HeardPeer(self._beacons.pop(pid), first, last))
                del self._seen[pid]
        return gone

    def peers(self) -> list[HeardPeer]:
        """Every peer heard, by peer id: (latest beacon, address, last heard)."""
        return [HeardPeer(self._beacons[pid], next(iter(self._seen[pid])), max(self._seen[pid].values()))
                for pid in sorted(self._beacons)]

    def addresses(self, peer_id: str) -> list[str]:
        """Every fresh address a peer was heard from, first heard first."""
        return list(self._seen.get(peer_id, ()))
