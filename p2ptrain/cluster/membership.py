"""Who is in the cluster, which state it holds, and how long to wait for it. Pure code: events
and the current time (``now``) in, answers out; no I/O, no clock.

Three small parts the round state machine (``p2ptrain.cluster.rounds``) stands on:

- ``PeerTable``: one entry per peer id: address, state, last heard, the lineage it last
  reported and its parameter checksum. The only state changes are the ``_TRANSITIONS``
  table below. ``coordinator()`` is the smallest live synced id.
- ``History``: a hash chain over the committed rounds. Two peers at the same
  (version, digest) applied the same updates in the same order. ``relation`` and
  ``heal_decision`` say which of two peers that disagree loads state again.
- ``RoundTimer``: adaptive deadlines, so a slow link is not taken for a dead peer and a dead
  peer is not waited for minutes.

Peer states (``synced``: same lineage as ours, may be in a view)::

              heard                connected               synced (same lineage)
    (new) -----------> connecting -----------> syncing <=========================> synced
                         ^   ^  link_lost         |          unsynced (behind, dropped,
                         |   `--------------------+-------------- split, not synced)
                  heard  |                  expire (silent)
                       dead <--------------- connecting | syncing | synced
    any --said_goodbye--> leaving  (final: a restarted process draws a new id)

"synced" says only what this peer believes: the round machine marks a peer synced when its
STATUS shows our (version, digest), and unsynced when it falls behind or is dropped.
"""

from __future__ import annotations

import hashlib
import statistics
import struct
from collections import deque
from dataclasses import dataclass
from typing import Iterable, NamedTuple


CONNECTING = "connecting"
SYNCING = "syncing"
SYNCED = "synced"
LEAVING = "leaving"
DEAD = "dead"
STATES = (CONNECTING, SYNCING, SYNCED, LEAVING, DEAD)

# Security limits: ids come from the network (beacons are forgeable without a secret).
MAX_PEERS = 1024
MAX_ID_LEN = 64
FORGET_AFTER = 10  # dead and leaving entries silent for this many peer timeouts are forgotten

# (event, state before) -> state after. ``None`` is "not in the table". A pair that is not
# listed leaves the state as it is (and creates no entry).
_TRANSITIONS: dict[tuple[str, str | None], str] = {
    ("heard", None): CONNECTING,
    ("heard", DEAD): CONNECTING,
    ("connected", None): SYNCING,
    ("connected", CONNECTING): SYNCING,
    ("connected", DEAD): SYNCING,
    ("synced", SYNCING): SYNCED,
    ("synced", SYNCED): SYNCED,
    ("synced", DEAD): SYNCED,  # a STATUS over a live link is proof of life
    ("unsynced", SYNCED): SYNCING,
    ("link_lost", SYNCING): CONNECTING,
    ("link_lost", SYNCED): CONNECTING,
    ("said_goodbye", CONNECTING): LEAVING,
    ("said_goodbye", SYNCING): LEAVING,
    ("said_goodbye", SYNCED): LEAVING,
    ("said_goodbye", DEAD): LEAVING,
    ("expire", CONNECTING): DEAD,
    ("expire", SYNCING): DEAD,
    ("expire", SYNCED): DEAD,
}


def valid_id(peer_id: object) -> bool:
    return isinstance(peer_id, str) and 0 < len(peer_id) <= MAX_ID_LEN


@dataclass
class PeerEntry:
    peer_id: str
    state: str
    last_heard: float
    addr: tuple | None = None
    version: int = -1  # the lineage it last reported (rounds applied, chain digest)
    digest: bytes = b""
    round: int = -1  # the last round it reported
    checksum: bytes | None = None  # its parameter checksum for that round
    served: bool = False  # has been in a view of a round that ended: may coordinate


class PeerTable:
    """Every peer we know of, this one included (its own entry never expires).

    Feed it events in the order they happen; each returns True when it changed a state.
    Events about unknown ids create an entry only where ``_TRANSITIONS`` says so.
    """

    def __init__(self, self_id: str):
        if not valid_id(self_id):
            raise ValueError(f"bad peer id {self_id!r}")
        self.self_id = self_id
        self._peers: dict[str, PeerEntry] = {self_id: PeerEntry(self_id, SYNCING, 0.0)}

    # -- lookups ---------------------------------------------------------------------------
    def get(self, peer_id: str) -> PeerEntry | None:
        return self._peers.get(peer_id)

    def state(self, peer_id: str) -> str | None:
        e = self._peers.get(peer_id)
        return e.state if e else None

    def __contains__(self, peer_id: object) -> bool:
        return peer_id in self._peers

    def __len__(self) -> int:
        return len(self._peers)

    def ids(self, *states: str) -> list[str]:
        return sorted(p for p, e in self._peers.items() if not states or e.state in states)

    def is_live(self, peer_id: str) -> bool:
        """Connected, as far as we know (a link and no goodbye)."""
        return self.state(peer_id) in (SYNCING, SYNCED)

    def live_synced(self) -> list[str]:
        """The ids a view may hold: synced with us, sorted (the ring order)."""
        return self.ids(SYNCED)

    def coordinator(self) -> str | None:
        """The smallest live synced id. Peers that have served in a view come first, so a
        joiner with a small id coordinates only after its first round, at a boundary. Each
        peer says in its STATUS whether it has served, so that every table names the same one
        (a joiner that knew of no one served took itself for the coordinator, and took the
        lead from one that held its rounds for another joiner's download)."""
        ids = self.live_synced()
        served = [p for p in ids if self._peers[p].served]
        pool = served or ids
        return pool[0] if pool else None

    def can_train(self, min_peers: int) -> tuple[bool, str]:
        n = len(self.live_synced())
        if n >= min_peers:
            return True, f"{n} synced peers"
        return False, f"waiting for {min_peers - n} more peer(s): {n} of {min_peers} synced"

    # -- events ----------------------------------------------------------------------------
    def _event(self, event: str, peer_id: str, now: float | None = None) -> bool:
        if not valid_id(peer_id):
            return False
        e = self._peers.get(peer_id)
        new = _TRANSITIONS.get((event, e.state if e else None))
        if e is None:
            if new is None or len(self._peers) >= MAX_PEERS:
                return False
            e = self._peers[peer_id] = PeerEntry(peer_id, new, now or 0.0)
            return True
        if now is not None:
            e.last_heard = max(e.last_heard, now)
        if new is None or new == e.state or peer_id == self.self_id:
            return False
        e.state = new
        return True

    def heard(self, peer_id: str, addr: tuple | None, now: float) -> bool:
        """A beacon (or a static address) named this peer."""
        changed = self._event("heard", peer_id, now)
        if addr is not None and peer_id in self._peers:
            self._peers[peer_id].addr = addr
        return changed

    def connected(self, peer_id: str, now: float, addr: tuple | None = None) -> bool:
        """Its handshake passed: it may talk to us, but is not in a view before it is synced."""
        changed = self._event("connected", peer_id, now)
        if addr is not None and peer_id in self._peers:
            self._peers[peer_id].addr = addr
        return changed

    def link_lost(self, peer_id: str, now: float) -> bool:
        return self._event("link_lost", peer_id, now)

    def said_goodbye(self, peer_id: str, now: float | None = None) -> bool:
        return self._event("said_goodbye", peer_id, now)

    def message(self, peer_id: str, now: float) -> None:
        """Any message from it: proof of life, no state change."""
        self._event("message", peer_id, now)

    def synced(self, peer_id: str, version: int, digest: bytes, round: int, now: float | None = None) -> bool:
        """It showed our lineage (version, digest): it may be in the next view."""
        changed = self._event("synced", peer_id, now)
        e = self._peers.get(peer_id)
        if e is not None and e.state == SYNCED:
            e.version, e.digest, e.round = version, digest, max(e.round, round)
        return changed

    def unsynced(self, peer_id: str) -> bool:
        """Behind, split off, dropped from a view or resyncing: not in a view until it is synced."""
        return self._event("unsynced", peer_id)

    def report(self, peer_id: str, round: int, checksum: bytes | None) -> None:
        e = self._peers.get(peer_id)
        if e is not None:
            e.round = max(e.round, round)
            if checksum is not None:
                e.checksum = checksum

    def mark_served(self, ids: Iterable[str]) -> None:
        for p in ids:
            if p in self._peers:
                self._peers[p].served = True

    def set_served(self, peer_id: str, served: bool) -> None:
        """Whether ``peer_id`` has served in a view, as its STATUS says (``served``), or as we
        know of ourselves (a solo peer that joins a cluster served in none of its views)."""
        if peer_id in self._peers:
            self._peers[peer_id].served = served

    def set_self(self, synced: bool, version: int = -1, digest: bytes = b"", round: int = -1) -> None:
        """The round machine says whether this peer itself holds the cluster's state."""
        e = self._peers[self.self_id]
        e.state = SYNCED if synced else SYNCING
        e.version, e.digest, e.round = version, digest, round

    def forgive(self, now: float) -> None:
        """This process stood still (a lid closed, SIGSTOP): the silence was ours, not theirs.
        Every peer not dead or leaving counts as heard now; one that is gone is found so a
        silence later, and one that went on without us is heard from first (its messages wait
        in our sockets), so that we load its state as a peer left behind, not of a split."""
        for p, e in self._peers.items():
            if p != self.self_id and e.state not in (DEAD, LEAVING):
                e.last_heard = max(e.last_heard, now)

    def expire(self, now: float, timeout: float) -> list[str]:
        """Mark peers silent for ``timeout`` seconds dead; return them. Forget old tombstones."""
        newly = []
        for p, e in list(self._peers.items()):
            if p == self.self_id:
                continue
            if e.state in (DEAD, LEAVING):
                if now - e.last_heard > FORGET_AFTER * timeout:
                    del self._peers[p]
            elif now - e.last_heard > timeout and self._event("expire", p):
                newly.append(p)
        return sorted(newly)


# -- lineage ---------------------------------------------------------------------------------
DIGEST_BYTES = 16
WINDOW = 1 << 16  # versions whose digest a History remembers (a split this long is still told apart)
STATUS_WINDOW = 8  # of which a STATUS carries the newest


def genesis(checksum: bytes = b"") -> bytes:
    """The digest at version 0: founders that start from the same parameters share it."""
    return hashlib.blake2b(b"p2ptrain/genesis\0" + checksum, digest_size=DIGEST_BYTES).digest()


class History:
    """The hash chain over committed updates: ``d_v = H(d_{v-1}, round, view, total)``.

    Only a round that changes the parameters is in the chain, so its version counts the
    updates applied: the count that ``--max-rounds``, ``peer.version``, checkpoints and
    summaries all name. Aborted rounds change no parameter, and neither does a committed round
    in which nobody contributed anything (total 0: an idle cluster at staleness >= 1); both
    leave the chain as it was. Two peers that only disagree on which rounds aborted or were
    idle hold the same parameters and the same digest. (Counting idle rounds made a run end
    at "version 60" on peers that had applied 58 updates.)
    """

    def __init__(self, version: int = 0, digest: bytes | None = None, window: Iterable = ()):
        """``window``: the (version, digest) pairs before and at ``version`` of a member whose
        state we loaded (its snapshot carries them), so that we can still tell a split from
        lagging against older versions. Pairs that do not form a chain ending here are ignored.

        The digests of the last WINDOW versions are kept in one ring of DIGEST_BYTES slots
        (1 MiB at most), not a dict of bytes objects (about 200 bytes a version: 13 MB)."""
        self.version = version
        self.digest = genesis() if digest is None else digest
        pairs = [tuple(e) for e in window if isinstance(e, (list, tuple)) and len(e) == 2][-WINDOW:]
        if not (pairs and pairs[-1] == (version, self.digest)
                and all(type(v) is int and isinstance(d, bytes) and len(d) == DIGEST_BYTES for v, d in pairs)
                and all(b[0] == a[0] + 1 for a, b in zip(pairs, pairs[1:]))):
            pairs = [(version, self.digest)]
        self._base = self._first = pairs[0][0]  # the ring's slot 0, and the oldest version held
        self._ring = bytearray()  # grows to WINDOW slots, then wraps
        for v, d in pairs:
            self._keep(v, d)

    def _keep(self, version: int, digest: bytes) -> None:
        """The digest after ``version`` (the next version after the newest held, or the first)."""
        at = (version - self._base) % WINDOW * DIGEST_BYTES
        if at == len(self._ring):
            self._ring += digest.ljust(DIGEST_BYTES, b"\0")[:DIGEST_BYTES]
        else:
            self._ring[at:at + DIGEST_BYTES] = digest.ljust(DIGEST_BYTES, b"\0")[:DIGEST_BYTES]
        self._first = max(self._first, version - WINDOW + 1)

    @staticmethod
    def next_digest(digest: bytes, round: int, view: Iterable[str], total: int) -> bytes:
        h = hashlib.blake2b(digest, digest_size=DIGEST_BYTES)
        h.update(struct.pack("<qq", round, total))
        h.update("\0".join(view).encode())
        return h.digest()

    @staticmethod
    def after(version: int, digest: bytes, round: int, view: Iterable[str], total: int) -> tuple[int, bytes]:
        """(version, digest) once a committed round is applied: unchanged if it was idle (total 0)."""
        if not total:
            return version, digest
        return version + 1, History.next_digest(digest, round, view, total)

    def append(self, round: int, view: Iterable[str], total: int) -> bytes:
        """A committed round; an idle one (total 0) changes nothing (see the class docstring)."""
        if not total:
            return self.digest
        self.digest = self.next_digest(self.digest, round, view, total)
        self.version += 1
        self._keep(self.version, self.digest)
        return self.digest

    def at(self, version: int) -> bytes | None:
        """Our digest after ``version`` commits, if still in the window."""
        if type(version) is not int or not self._first <= version <= self.version:
            return None
        if version == self.version:
            return self.digest
        at = (version - self._base) % WINDOW * DIGEST_BYTES
        return bytes(self._ring[at:at + DIGEST_BYTES])

    def recent(self, n: int = STATUS_WINDOW) -> list[tuple[int, bytes]]:
        """The newest ``n`` (version, digest) pairs held, oldest first."""
        return [(v, self.at(v)) for v in range(max(self._first, self.version - n + 1), self.version + 1)]


def relation(mine: History, version: int, digest: bytes, recent: Iterable[tuple[int, bytes]],
             at: tuple[int, bytes] | None = None, can_ask: bool = False) -> str:
    """How a peer's lineage relates to ours: ``same``; ``behind`` (it is on our chain, older);
    ``ahead`` (we are on its chain, older); ``split`` (the chains differ).

    The newer side tells from its own history. The older side needs the newer one's digest at
    its version: in ``recent`` (its newest few) or ``at`` (sent in reply to our STATUS). Without
    it: ``unknown`` when we ``can_ask`` (send our STATUS; the reply carries ``at``), else by
    version (a split longer than WINDOW looks like lagging: the older side loads state)."""
    if version == mine.version:
        return "same" if digest == mine.digest else "split"
    if version < mine.version:
        ours = mine.at(version)
        return "behind" if ours is None or ours == digest else "split"
    theirs = dict(recent).get(mine.version)
    if theirs is None and at is not None and at[0] == mine.version:
        theirs = at[1]
    if theirs is None:
        return "unknown" if can_ask else "ahead"
    return "ahead" if theirs == mine.digest else "split"


class Lineage(NamedTuple):
    """One side of a meeting: how many peers share its state, its digest, its version (updates
    applied since genesis), its smallest id."""

    members: int
    digest: bytes
    version: int
    min_id: str


def heal_decision(mine: Lineage, theirs: Lineage) -> str:
    """``'keep'`` or ``'resync'`` for our side when two lineages meet. The side with fewer
    members re-syncs (a laptop that went on alone, fast with no ring to wait for, does not
    overwrite the cluster); on a tie the side with fewer updates since genesis (peers that
    founded apart at start-up keep the one far ahead, whose member count may be short just
    after a state load); then the side whose smallest id is larger; then the larger digest.
    Both sides evaluate it with the same two lineages and reach opposite answers, so exactly
    one of them re-syncs."""
    if mine.digest == theirs.digest and mine.version == theirs.version:
        return "keep"
    for ours, other in ((mine.members, theirs.members), (mine.version, theirs.version)):
        if ours != other:
            return "resync" if ours < other else "keep"
    if mine.min_id != theirs.min_id:
        return "resync" if mine.min_id > theirs.min_id else "keep"
    return "resync" if mine.digest > theirs.digest else "keep"


# -- timing ----------------------------------------------------------------------------------
class RoundTimer:
    """How long to wait for one phase of a round, learned from the last rounds::

        deadline = max(floor, slack * nbytes / throughput, median + MAD_K * MAD)

    - ``floor`` (5 s): longer than a GC pause, a Wi-Fi roam or a TCP retransmit burst; short
      enough that a peer dead without a reset is given up on in seconds, not minutes.
    - ``slack`` (4): the bytes a phase moves, at the median throughput of recent rounds,
      may take 4x longer before we call it stuck, so a slow or loaded link is not a dead peer.
      Before the first round the throughput is ``throughput`` (10 MB/s, a poor Wi-Fi link).
    - median + 4 MAD of the last ``keep`` (32) durations: robust to a few outliers (a GC
      pause does not raise it), and it follows a compute-bound phase (waiting for a slow
      device's batch), which the byte count does not see.
    """

    FLOOR_S = 5.0
    SLACK = 4.0
    MAD_K = 4.0
    KEEP = 32
    THROUGHPUT = 10e6

    def __init__(self, floor: float = FLOOR_S, slack: float = SLACK, keep: int = KEEP,
                 throughput: float = THROUGHPUT):
        if floor <= 0 or slack <= 0 or keep < 1 or throughput <= 0:
            raise ValueError("RoundTimer needs floor, slack, keep and throughput > 0")
        self.floor, self.slack, self._default_tp = floor, slack, throughput
        self._durations: deque[float] = deque(maxlen=keep)
        self._rates: deque[float] = deque(maxlen=keep)

    def record(self, seconds: float, nbytes: int = 0) -> None:
        if seconds < 0:
            return
        self._durations.append(seconds)
        if nbytes > 0 and seconds > 0:
            self._rates.append(nbytes / seconds)

    @property
    def throughput(self) -> float:
        return statistics.median(self._rates) if self._rates else self._default_tp

    def median(self) -> float | None:
        """The median of the recent durations (None: none yet)."""
        return statistics.median(self._durations) if self._durations else None

    def usual(self) -> float:
        """The longest the recent rounds make usual: median + MAD_K MAD of the durations (0: none yet)."""
        if not self._durations:
            return 0.0
        med = statistics.median(self._durations)
        return med + self.MAD_K * statistics.median(abs(x - med) for x in self._durations)

    def deadline(self, nbytes: int = 0) -> float:
        d = max(self.floor, self.usual())
        if nbytes > 0:
            d = max(d, self.slack * nbytes / self.throughput)
        return d
