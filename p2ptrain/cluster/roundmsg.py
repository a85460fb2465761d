"""The round protocol's vocabulary: its messages and the actions of the round machine.

Pure code. A round message goes out as a frame header, a dict whose "t" is its type (the
machine builds those dicts where it sends them). ``parse`` checks a received one field by field
and returns it as the frozen dataclass of its type (``Query``, ``Status``, ``Propose``,
``Ready``, ``Start``, ``Done``, ``Commit``, ``Abort``, ``Nack``, ``Goodbye``, ``End``; those
about a round's attempt share ``RoundMessage``'s fields; a STATUS's pending attempt is an
``Attempt``); it raises ``RemoteProtocolError`` and nothing else. A field is named as its key
on the wire (``r``: the round, ``b``: a leader's ballot (epoch, its id), as everywhere in the
machine), so that what is sent and what is received read alike; a class's ``t`` is its type on
the wire. The actions are what ``p2ptrain.cluster.rounds.RoundMachine`` asks its I/O layer to
do, in order.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import ClassVar

from p2ptrain.errors import RemoteProtocolError
from p2ptrain.cluster.membership import STATUS_WINDOW, valid_id
from p2ptrain.cluster.used import MASK_LIMIT

# -- round messages: their types on the wire ("t"), and what parse returns for each ------------
QUERY, STATUS, PROPOSE, READY, START = "query", "status", "propose", "ready", "start"
DONE, COMMIT, ABORT, NACK, GOODBYE, END = "done", "commit", "abort", "nack", "goodbye", "end"
# Why a member's ring failed with no peer or link at fault (DONE's ``void``), and the leader's words
# for its abort: the others' rings wait for chunks that will not come, so it aborts at once.
WITHDRAWN, NOT_FINITE = "withdrawn", "nonfinite"
VOID = {WITHDRAWN: "{peer} withdrew its batch (it changed after backward began)",
        NOT_FINITE: "{peer} holds a sum with NaN or inf, which a lossy codec cannot carry: "
                    "the batch that overflowed is left out"}

# Every message class: frozen, built by field name. A field a peer may leave out (an older one:
# a NACK's ``missing``, a PROPOSE's ``end``...) defaults to None, as parse reads it; the others
# are required.
_message = dataclass(frozen=True, slots=True, kw_only=True)


@_message
class RoundMessage:
    """A message about round ``r``'s attempt under the ballot ``b`` of the leader that sequences it."""
    r: int
    b: tuple


@_message
class Query:
    """New leader -> candidates: report your state (STATUS), obey ballot ``b``."""
    t: ClassVar[str] = QUERY
    b: tuple


@_message
class Attempt:
    """A STATUS's ``pending``: the attempt its sender takes part in as a member, in its ``phase``."""
    r: int
    b: tuple
    phase: str
    ok: bool
    view: tuple
    total: int
    spread: tuple | None = None  # (largest, squares) of the members' samples (``spread_of``); None: none sent


@_message
class Status:
    """Any -> any: the sender's state (``lineage`` compares chains in it), in reply (``re``) or not."""
    t: ClassVar[str] = STATUS
    synced: bool
    version: int
    digest: bytes
    round: int  # the last attempt that ended there (-1: none)
    members: int  # the peers of its side
    min_id: str  # the smallest id of its side ("": none)
    window: list  # [(version, digest)] of its last rounds
    log: list  # [(r, b, committed)] of its last LOG_KEEP attempts
    pending: Attempt | None = None  # the attempt it takes part in (None: idle)
    promised: tuple | None = None  # the ballot it obeys
    b: tuple | None = None  # the ballot of the QUERY/PROPOSE it answers
    re: bool  # a reply: not answered again
    at: tuple | None = None  # (v, its digest at v), in reply to a peer at version v
    out: float | None = None  # from a leader: seconds its views still leave the receiver out
    end: int | None = None  # the version at which the cluster's run ended there
    served: bool | None = None  # whether it has served in a view (``PeerTable.coordinator``; None: not said)
    side: tuple | None = None  # the peers of its side, sorted (``members`` of them; None: not said)
    masks: list | None = None  # [(r, b, used)] of the logged attempts it committed with a ``used`` mask


@_message
class Propose(RoundMessage):
    """Leader -> view: round ``r`` under ballot ``b``, over ``view`` (sorted)."""
    t: ClassVar[str] = PROPOSE
    view: tuple
    end: tuple | None = None  # (the run's last version or 0, seconds left on the leader's clock or None); None: none


@_message
class Ready(RoundMessage):
    """Member -> leader: our contribution to round ``r`` is ready, on our chain at (version, digest)."""
    t: ClassVar[str] = READY
    samples: int
    version: int
    digest: bytes


@_message
class Start(RoundMessage):
    """Leader -> view: every member is ready (their rings began as each contributed); ``total``
    samples in round ``r``."""
    t: ClassVar[str] = START
    view: tuple
    total: int
    spread: tuple | None = None  # (``spread_of`` the READYs' samples; None from a leader that sends none)
    ready: tuple | None = None  # seconds from each member's READY to the last one, in view order (``ready_offsets``)


@_message
class Done(RoundMessage):
    """Member -> leader: our ring of round ``r`` ended (``ok``), with our parameters' checksum;
    ``void``: not ok for no fault of any peer or link (a ``VOID`` reason): the leader aborts at once."""
    t: ClassVar[str] = DONE
    ok: bool
    checksum: bytes | None = None
    void: str | None = None
    used: bytes | None = None  # which of our parameters had a gradient (``used``; None: all did)


@_message
class Commit(RoundMessage):
    """Leader -> view: apply round ``r``, of ``total`` samples (None from a leader that sends none:
    a member then has it from START, as ``spread``). ``used``: the OR of the members' DONE masks
    (``used``; None: every parameter had a gradient at some member, or a leader that sends none)."""
    t: ClassVar[str] = COMMIT
    total: int | None = None
    used: bytes | None = None
    spread: tuple | None = None


@_message
class Abort(RoundMessage):
    """Leader -> view and the dropped: round ``r`` will not be applied; ``drop``: peers it dropped;
    ``void``: a member's DONE said so (``VOID``): ``NOT_FINITE``, every member leaves its batch out."""
    t: ClassVar[str] = ABORT
    reason: str
    drop: tuple
    void: str | None = None


@_message
class Nack:
    """Member -> a leader it does not obey: ``b`` is the ballot it obeys (``r`` -1: a QUERY's)."""
    t: ClassVar[str] = NACK
    r: int
    b: tuple
    reason: str
    missing: tuple | None = None  # the view's peers it has no link to (None: an older peer)


@_message
class Goodbye:
    """A leaving peer -> all."""
    t: ClassVar[str] = GOODBYE
    end: int | None = None  # the version at which the cluster's run ended there


@_message
class End:
    """Leader -> every peer it knows, at a boundary: the cluster's run is over at ``version``
    (its --max-rounds version, or its clock's --duration, ``why``); members stop after it."""
    t: ClassVar[str] = END
    b: tuple
    version: int
    digest: bytes
    why: str


Message = Query | Status | Propose | Ready | Start | Done | Commit | Abort | Nack | Goodbye | End

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


def _one_of(allowed):
    def check(v):
        _need(type(v) is str and v in allowed, "an unknown value")
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
    return Attempt(r=_int(v.get("r")), b=_ballot(v.get("b")), phase=_of(str, 16)(v.get("phase")),
                   ok=_of(bool)(v.get("ok")), view=_ids(v.get("view")), total=_int(v.get("total")),
                   spread=_opt(_spread)(v.get("spread")))


def spread_of(samples) -> list | None:
    """A round's members' samples as the pair a leader sends in START and COMMIT: the largest
    and the sum of their squares (rounds by time may scale the round's mean by them:
    ``LocalSteps.divisor``); None where nobody had any."""
    samples = list(samples)
    return [max(samples), sum(n * n for n in samples)] if any(samples) else None


def ready_offsets(view, ready_at: dict) -> list:
    """Seconds from each member's READY to the last one, in ``view`` order (``ready_at``: member
    -> its READY, in seconds from any one origin), as a leader sends them in START: each member
    learns when the others were ready (``others_after``)."""
    last = max(ready_at.values(), default=0.0)
    return [round(last - ready_at.get(p, last), 6) for p in view]


def others_after(view, ready: tuple | None, me: str) -> float | None:
    """Seconds from our READY to the last of the others' (negative: ours came after it), by
    START's ``ready``, as the leader heard them (``pacing.Pacing.round_committed`` times the
    slower members by it); None: not said, alone, or not a member."""
    if not ready or me not in view:
        return None
    others = [t for p, t in zip(view, ready) if p != me]
    return ready[list(view).index(me)] - min(others) if others else None


def _offsets(v):
    _need(isinstance(v, (list, tuple)) and len(v) <= MAX_VIEW, "bad READY offsets")
    return tuple(_seconds(t) for t in v)


def _spread(v):
    _need(isinstance(v, (list, tuple)) and len(v) == 2, "a bad spread of samples")
    largest, squares = _int(v[0], 1), _int(v[1], 1)
    _need(largest * largest <= squares, "a spread whose largest share exceeds its squares")
    return (largest, squares)


def _mask(v):  # (``used``: a bitmask of one bit per parameter, bounded)
    _need(isinstance(v, bytes) and 0 < len(v) <= MASK_LIMIT, "a bad parameter mask")
    return v


def with_used(msg: dict, mask: bytes | None) -> dict:
    """``msg`` (a DONE or COMMIT) with its ``used`` mask, where there is one (None: every
    parameter had a gradient; ``NONE_YET``, no DONE yet, is none either): the field is left out."""
    if mask:
        msg["used"] = mask
    return msg


def _checked(cls, **checks):
    """A type's class and its fields' checks, in the order parse runs them (the wire's)."""
    if list(checks) != [f.name for f in fields(cls)]:
        raise RuntimeError(f"{cls.__name__}: its fields are not the ones checked, in order")  # our bug
    return cls, tuple(checks.items())


_RB = {"r": _int, "b": _ballot}
_SCHEMA = {m[0].t: m for m in (
    _checked(Query, b=_ballot),
    _checked(Status, synced=_of(bool), version=_int, digest=_of(bytes, 64), round=lambda v: _int(v, -1),
             members=_int, min_id=lambda v: v if v == "" else _ids([v])[0],
             window=lambda v: _pairs(v, STATUS_WINDOW, 2, lambda a, d: (_int(a), _of(bytes, 64)(d))),
             log=lambda v: _pairs(v, LOG_KEEP, 3, lambda r, b, c: (_int(r), _ballot(b), _of(bool)(c))),
             pending=_opt(_pending), promised=_opt(_ballot), b=_opt(_ballot), re=_of(bool),
             at=_opt(lambda v: _pairs([v], 1, 2, lambda a, d: (_int(a), _of(bytes, 64)(d)))[0]),
             out=_opt(_seconds), end=_opt(_int), served=_opt(_of(bool)), side=_opt(_ids),
             masks=_opt(lambda v: _pairs(v, LOG_KEEP, 3, lambda r, b, m: (_int(r), _ballot(b), _mask(m))))),
    _checked(Propose, **_RB, view=lambda v: _ids(v, view=True), end=_opt(_limits)),
    _checked(Ready, **_RB, samples=_int, version=_int, digest=_of(bytes, 64)),
    _checked(Start, **_RB, view=lambda v: _ids(v, view=True), total=_int, spread=_opt(_spread), ready=_opt(_offsets)),
    _checked(Done, **_RB, ok=_of(bool), checksum=_opt(_of(bytes, 64)), void=_opt(_one_of(VOID)),
             used=_opt(_mask)),
    _checked(Commit, **_RB, total=_opt(_int), used=_opt(_mask), spread=_opt(_spread)),
    _checked(Abort, **_RB, reason=_of(str, MAX_REASON), drop=_ids, void=_opt(_one_of(VOID))),
    _checked(Nack, r=lambda v: _int(v, -1), b=_ballot, reason=_of(str, MAX_REASON), missing=_opt(_ids)),
    _checked(Goodbye, end=_opt(_int)),
    _checked(End, b=_ballot, version=_int, digest=_of(bytes, 64), why=_of(str, MAX_REASON)),
)}


def parse(msg: object) -> Message:
    """A round message, checked field by field (in the order of its class's fields), as its
    class: ballots and views as tuples; unknown fields are dropped, and an optional one that is
    absent (a NACK's ``missing`` from an older peer) reads as None. Raises
    ``RemoteProtocolError`` on anything else."""
    if not (isinstance(msg, dict) and isinstance(msg.get("t"), str) and msg["t"] in _SCHEMA):
        kind = str(msg.get("t"))[:20] if isinstance(msg, dict) else type(msg).__name__
        _need(False, f"unknown message type {kind!r}")
    cls, checks = _SCHEMA[msg["t"]]
    out = cls(**{name: check(msg.get(name)) for name, check in checks})
    for m in (out, getattr(out, "pending", None)):  # (a START's, a COMMIT's, a STATUS's pending attempt's)
        spread, total = getattr(m, "spread", None), getattr(m, "total", None)
        _need(spread is None or total is None or _fits(spread, total), "a spread of samples that does not fit its total")
    ready = getattr(out, "ready", None)
    _need(ready is None or len(ready) == len(out.view), "READY offsets that are not one per member")
    return out


def _fits(spread: tuple, total: int) -> bool:
    """Whether ``spread`` can be ``spread_of`` members' samples adding up to ``total``: the largest
    at most the total, and the others' squares at least their sum (1 each at least) and at most
    the largest times their sum; so the scale it gives a mean (``LocalSteps.divisor``) is at least
    1 and at most ``total / largest``."""
    largest, squares = spread
    return largest <= total and largest ** 2 + total - largest <= squares <= largest * total


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
    """Round r committed: apply its ring result / ``total_samples`` (0: nothing to apply);
    ``used``: which parameters had a gradient at some member (``used``; None: all); ``spread``:
    (largest, squares) of the members' samples (``spread_of``; None: not known); ``ready``:
    START's (None: not said)."""
    r: int
    total_samples: int
    view: tuple[str, ...]
    used: bytes | None = None
    spread: tuple | None = None
    ready: tuple | None = None


@dataclass(frozen=True)
class PutBack:
    """Round r will not be applied: cancel its ring if it runs, add the contribution back; but
    ``not_finite`` (its sum held NaN or inf): leave it out, as DDP with GradScaler skips such a
    step on every rank (put back, a batch whose sum overflows with the others' would abort
    every round after)."""
    r: int
    not_finite: bool = False


@dataclass(frozen=True)
class Resync:
    """Our state is not the cluster's: load ``donor``'s (or only the missing rounds, when
    ``reason`` starts with "behind"), drop outstanding contributions, then ``on_synced``."""
    reason: str
    donor: str  # the peer whose state we load


@dataclass(frozen=True)
class Finish:
    """The cluster's run is over: this peer's last update is the one that made ``version``
    (round ``r``): stop training, and say why (``reason``). ``behind``: the cluster ended
    elsewhere, at another version or one not known here (this peer was not in its last rounds)."""
    version: int
    r: int
    reason: str
    behind: bool = False


@dataclass(frozen=True)
class Stall:
    """A wait passed a threshold (half the deadline, the deadline; members: 1, 2, 4... times)."""
    waiting_for: tuple[str, ...]
    phase: str  # leader: "status", "ready", "done"; member: "start", "decision"
    seconds: float
    r: int


@dataclass(frozen=True)
class Waiting:
    """Too few synced peers to train, this long (said at WAIT_REMINDERS, then every WAIT_REPEAT)."""
    seconds: float
    why: str  # ``can_train``'s words: "waiting for K more peer(s): n of m synced"


@dataclass(frozen=True)
class Log:
    level: str
    text: str
