"""The round protocol's vocabulary: its messages and the actions of the round machine.

Pure code. ``parse`` checks a received message (a frame header whose "t" is its type)
and raises ``RemoteProtocolError`` and nothing else. The actions are what
``p2ptrain.cluster.rounds.RoundMachine`` asks its I/O layer to do, in order.
"""

from __future__ import annotations

from dataclasses import dataclass

from p2ptrain.errors import RemoteProtocolError
from p2ptrain.cluster.membership import STATUS_WINDOW, valid_id

# -- round messages (frame headers; "t" is the type) ---------------------------------------------
QUERY = "query"  # new leader -> candidates  {b}: report your state, obey ballot b
STATUS = "status"  # any -> any  {synced, version, digest, round, members, min_id, window, pending,
#                                log, promised, b (the QUERY/PROPOSE answered, or None), re (a reply),
#                                at ([v, our digest at v] in reply to a peer at version v, or None),
#                                out (from a leader: seconds its views still leave the receiver out, or None),
#                                end (the version at which the cluster's run ended here, or None)}
PROPOSE = "propose"  # leader -> view  {r, b, view, end ([the version the run ends at or 0, seconds left of
#                       the leader's clock or None], or None: no limit)}
READY = "ready"  # member -> leader  {r, b, samples, version, digest}
START = "start"  # leader -> view  {r, b, view, total}
DONE = "done"  # member -> leader  {r, b, ok, checksum}
COMMIT = "commit"  # leader -> view  {r, b}
ABORT = "abort"  # leader -> view and the dropped  {r, b, reason, drop}
NACK = "nack"  # member -> a leader it does not obey  {r, b (the ballot it obeys), reason, missing (the
#                  view's peers it has no link to; absent from older peers)}
GOODBYE = "goodbye"  # a leaving peer -> all  {end (the version at which the cluster's run ended here, or None)}
END = "end"  # leader -> every peer it knows, at a boundary  {b, version, digest, why}: the cluster's run is
#              over (its --max-rounds version, or its clock's --duration); members stop after that version

# A member's phase in the attempt it takes part in (a STATUS reports it as "pending"; None: idle).
PROPOSED, READIED, RING, RINGED = "proposed", "ready", "ring", "done"


def beats(a: tuple | None, b: tuple | None) -> bool:
    """Ballot a is better than b: a higher epoch, or the same epoch and a smaller id."""
    return b is None or (a is not None and (a[0] > b[0] or (a[0] == b[0] and a[1] < b[1])))


def move(table: dict, phase, event):
    """The next phase from ``table`` ((phase, event) -> next phase: a part's transitions, the
    only ones there are); a pair not listed is our bug."""
    if (phase, event) not in table:
        raise RuntimeError(f"no transition from {phase} on {event}")  # our bug
    return table[(phase, event)]


# Security limits on what a peer may send (the frame layer bounds the header to 16 KiB too).
MAX_VIEW = 256
MAX_REASON = 200
LOG_KEEP = 8  # attempts whose outcome a STATUS reports
_MAX_INT = (1 << 63) - 1


def _need(ok: bool, what: str) -> None:
    if not ok:
        raise RemoteProtocolError(f"malformed round message: {what}")


def _int(v, lo=0):
    _need(type(v) is int and lo <= v <= _MAX_INT, "an integer out of range")
    return v


def _ballot(v):
    _need(isinstance(v, (list, tuple)) and len(v) == 2 and valid_id(v[1]), "a bad ballot")
    return (_int(v[0]), v[1])


def _ids(v, view=False):
    _need(isinstance(v, (list, tuple)) and len(v) <= MAX_VIEW and all(valid_id(p) for p in v), "bad peer ids")
    _need(not view or (v and list(v) == sorted(set(v))), "a view must be sorted, unique, non-empty")
    return tuple(v)


def _pairs(v, n, size, check):
    _need(isinstance(v, (list, tuple)) and len(v) <= n and all(isinstance(e, (list, tuple)) and len(e) == size
                                                             for e in v), "a bad list")
    return [check(*e) for e in v]


def _opt(check):
    return lambda v: None if v is None else check(v)


def _of(kind, n=None):
    def check(v):
        _need(isinstance(v, kind) and (n is None or len(v) <= n), f"a bad {kind.__name__} field")
        return v
    return check


def _seconds(v):
    _need(type(v) in (int, float) and 0 <= v <= 3600, "a bad number of seconds")  # (NaN fails too)
    return float(v)


def _limits(v):
    _need(isinstance(v, (list, tuple)) and len(v) == 2, "bad run limits")
    return (_int(v[0]), None if v[1] is None else _run_seconds(v[1]))


def _run_seconds(v):
    _need(type(v) in (int, float) and 0 <= v <= 10 ** 9, "bad seconds left")  # (NaN fails too)
    return float(v)


def _pending(v):
    _need(isinstance(v, dict), "a bad pending attempt")
    return {"r": _int(v.get("r")), "b": _ballot(v.get("b")), "phase": _of(str, 16)(v.get("phase")),
            "ok": _of(bool)(v.get("ok")), "view": _ids(v.get("view")), "total": _int(v.get("total"))}


_RB = {"r": _int, "b": _ballot}
_SCHEMA = {
    QUERY: {"b": _ballot},
    STATUS: {"synced": _of(bool), "version": _int, "digest": _of(bytes, 64), "round": lambda v: _int(v, -1),
             "members": _int, "min_id": lambda v: v if v == "" else _ids([v])[0],
             "window": lambda v: _pairs(v, STATUS_WINDOW, 2, lambda a, d: (_int(a), _of(bytes, 64)(d))),
             "log": lambda v: _pairs(v, LOG_KEEP, 3, lambda r, b, c: (_int(r), _ballot(b), _of(bool)(c))),
             "pending": _opt(_pending), "promised": _opt(_ballot), "b": _opt(_ballot), "re": _of(bool),
             "at": _opt(lambda v: _pairs([v], 1, 2, lambda a, d: (_int(a), _of(bytes, 64)(d)))[0]),
             "out": _opt(_seconds), "end": _opt(_int)},
    PROPOSE: {**_RB, "view": lambda v: _ids(v, view=True), "end": _opt(_limits)},
    READY: {**_RB, "samples": _int, "version": _int, "digest": _of(bytes, 64)},
    START: {**_RB, "view": lambda v: _ids(v, view=True), "total": _int},
    DONE: {**_RB, "ok": _of(bool), "checksum": _opt(_of(bytes, 64))},
    COMMIT: _RB,
    ABORT: {**_RB, "reason": _of(str, MAX_REASON), "drop": _ids},
    NACK: {"r": lambda v: _int(v, -1), "b": _ballot, "reason": _of(str, MAX_REASON), "missing": _opt(_ids)},
    GOODBYE: {"end": _opt(_int)},
    END: {"b": _ballot, "version": _int, "digest": _of(bytes, 64), "why": _of(str, MAX_REASON)},
}


def parse(msg: object) -> dict:
    """A round message, checked field by field: the fields of its type, normalised (ballots and
    views as tuples); unknown fields are dropped, and an optional one that is absent (a NACK's
    ``missing`` from an older peer) reads as None. Raises ``RemoteProtocolError`` on anything else."""
    if not (isinstance(msg, dict) and isinstance(msg.get("t"), str) and msg["t"] in _SCHEMA):
        kind = str(msg.get("t"))[:20] if isinstance(msg, dict) else type(msg).__name__
        _need(False, f"unknown message type {kind!r}")
    return {"t": msg["t"], **{name: check(msg.get(name)) for name, check in _SCHEMA[msg["t"]].items()}}


# -- actions: what the I/O layer must do, in order ------------------------------------------
@dataclass(frozen=True)
class Send:
    to: str
    msg: dict  # a frame header


@dataclass(frozen=True)
class Broadcast:
    msg: dict
    to: tuple[str, ...]


@dataclass(frozen=True)
class Contribute:
    """Swap the accumulator out for round r (now, or after the batch that staleness 0 waits
    for), then call ``on_contribution_ready(r, samples)``."""
    r: int


@dataclass(frozen=True)
class StartRing:
    """Run round r's ring-allreduce over ``view`` (the ring order), then call ``on_ring_done``."""
    r: int
    view: tuple[str, ...]


@dataclass(frozen=True)
class Apply:
    """Round r committed: apply its ring result / ``total_samples`` (0: nothing to apply)."""
    r: int
    total_samples: int
    view: tuple[str, ...]


@dataclass(frozen=True)
class PutBack:
    """Round r will not be applied: cancel its ring if it runs, add the contribution back."""
    r: int


@dataclass(frozen=True)
class Resync:
    """Our state is not the cluster's: load ``donor``'s (or only the missing rounds, when
    ``reason`` starts with "behind"), drop outstanding contributions, then ``on_synced``."""
    reason: str
    donor: str  # the peer whose state we load


@dataclass(frozen=True)
class Finish:
    """The cluster's run is over: this peer's last update is the one that made ``version``
    (round ``r``): stop training, and say why (``reason``)."""
    version: int
    r: int
    reason: str


@dataclass(frozen=True)
class Stall:
    """A wait passed a threshold (half the deadline, the deadline; members: 1, 2, 4... times)."""
    waiting_for: tuple[str, ...]
    phase: str  # leader: "status", "ready", "done"; member: "start", "decision"
    seconds: float
    r: int


@dataclass(frozen=True)
class Log:
    level: str
    text: str
