"""The member role of the round machine: taking part in a leader's rounds. Pure code, no I/O.

``MemberRole`` is a mixin of ``p2ptrain.cluster.rounds.RoundMachine``: its state and plumbing
(``_send``, ``_emit``, ``_move``, ``pending``, ``promised``, ``table``, ``history``) are the
machine's. ``rounds`` holds the machine (its inputs, the plumbing, deadlines); ``leader`` is
what only the peer that sequences rounds does; this module is what every peer does as a member
of a round, the leader too. The machine dispatches QUERY, PROPOSE, START, COMMIT and ABORT here
and calls ``_contributed`` and ``_ring_done`` for its host's answers.

Transitions (``_MEMBER``; ``_move`` refuses any other):
    idle -PROPOSE-> proposed -contribution-> ready -START-> ring -ring_done-> done
    done -COMMIT-> idle (Apply);  any -ABORT-> idle (PutBack);
    proposed|ready -PROPOSE of a better ballot, same round-> same phase (READY again)
    proposed|ready -a better ballot, leader lost-> idle (withdrawn, PutBack)
"""

from __future__ import annotations

from dataclasses import dataclass

from p2ptrain.errors import RemoteProtocolError
from p2ptrain.cluster.roundmsg import (ABORT, COMMIT, DONE, NACK, PROPOSE, PROPOSED, READIED, READY, RING, RINGED,
                                       START, Apply, Contribute, Log, PutBack, StartRing, beats)

# (phase, event) -> next phase: the only transitions there are (``_move`` refuses others).
_MEMBER = {
    (None, PROPOSE): PROPOSED,  # -> Contribute(r)
    (PROPOSED, "contribution"): READIED,  # -> READY
    (READIED, START): RING,  # -> StartRing
    (RING, "ring_done"): RINGED,  # -> DONE
    (RINGED, COMMIT): None,  # -> Apply
    (PROPOSED, PROPOSE): PROPOSED, (READIED, PROPOSE): READIED,  # same round, better ballot (READY again)
    (PROPOSED, "withdraw"): None, (READIED, "withdraw"): None,  # never started: no trace (PutBack)
    (PROPOSED, ABORT): None, (READIED, ABORT): None, (RING, ABORT): None, (RINGED, ABORT): None,  # -> PutBack
}


@dataclass
class _Pending:  # the attempt this peer takes part in as a member
    r: int
    b: tuple
    view: tuple
    phase: str
    since: float
    samples: int | None = None
    total: int = 0
    ok: bool = False
    mark: float = 1.0  # next Stall, as a multiple of the deadline

    @property
    def started(self) -> bool:
        return self.phase in (RING, RINGED)


class MemberRole:
    """What a peer does as a member of the rounds whose view names it."""

    def _nack(self, to: str, r: int, reason: str, missing=()) -> None:
        if to != self.id:
            self._send(to, {"t": NACK, "r": r, "b": list(self.promised or (0, self.id)), "reason": reason,
                            "missing": list(missing)})

    def _promise(self, b: tuple, now: float, keep: int = -1) -> None:
        """Obey ballot b from now on. An unstarted attempt of another ballot can never start
        here any more: it is withdrawn (unless it is round ``keep``, proposed again under b)."""
        pending = self.pending
        if pending is not None and not pending.started and pending.b != b and pending.r != keep:
            self._withdraw(pending)
        self.promised, self.max_epoch = b, max(self.max_epoch, b[0])
        if pending is not None and not pending.started and pending.b[1] != b[1]:  # its leader would wait for our READY:
            self._nack(pending.b[1], pending.r, "superseded")  # it steps down now, not at its deadline
        if self.lead and self.lead.b != b:
            self._step_down(now, f"superseded by {b[1]} (epoch {b[0]})", rival=b[1])

    def _on_query(self, sender, message, now) -> None:
        if message["b"][1] != sender:
            raise RemoteProtocolError("QUERY from a peer that does not own its ballot")
        if self.synced and beats(self.promised, message["b"]):
            return self._nack(sender, -1, "superseded")
        if self.synced:
            self._promise(message["b"], now)
        self._send(sender, self._status(message["b"], re=True))

    def _on_propose(self, sender, message, now) -> None:
        r, b, view, pending = message["r"], message["b"], message["view"], self.pending
        if b[1] != sender or (pending is not None and (pending.r, pending.b) == (r, b)):
            raise RemoteProtocolError("PROPOSE repeated, or from a peer that does not own its ballot")
        if not self.synced or r <= self.round:
            self.counters["old_round" if self.synced else "unsynced"] += 1
        elif beats(self.promised, b):
            self._nack(sender, r, "superseded")
        elif self.id not in view or sender not in view:
            self._nack(sender, r, "the view does not hold us and the leader")
        elif any(q != self.id and not self.table.is_live(q) for q in view):
            missing = [q for q in view if q != self.id and not self.table.is_live(q)]
            self._nack(sender, r, "the view names a peer we are not connected to", missing)
        elif pending is not None and pending.started:  # in doubt: this leader must resolve that attempt first
            self._promise(b, now)
            self._send(sender, self._status(b, re=True))
        else:
            self._promise(b, now, keep=r)
            self._adopt_limits(message, now)
            self._proposed = (r, b)
            if self.pending is not None and self.pending.r != r:
                self._withdraw(self.pending)
            pending = self.pending
            if pending is not None:  # the same round under a better ballot: keep our contribution
                pending.phase = self._move(_MEMBER, pending.phase, PROPOSE)
                pending.b, pending.view, pending.since = b, view, now
                if pending.phase == READIED:
                    self._send(sender, self._ready_msg(pending))
                return
            self.pending = _Pending(r, b, view, self._move(_MEMBER, None, PROPOSE), now)
            if r not in self._asked:  # (one outstanding Contribute per round number)
                self._asked.add(r)
                self._emit(Contribute(r))

    def _contributed(self, r, samples, now) -> None:
        self._asked.discard(r)
        pending = self.pending
        if pending is None or pending.r != r or pending.phase != PROPOSED:
            self.counters["late_contribution"] += 1
            return self._emit(PutBack(r))
        pending.phase = self._move(_MEMBER, pending.phase, "contribution")
        pending.samples, pending.since = samples, now
        self._send(pending.b[1], self._ready_msg(pending))

    def _ready_msg(self, pending: _Pending) -> dict:
        return {"t": READY, "r": pending.r, "b": list(pending.b), "samples": pending.samples,
                "version": self.history.version, "digest": self.history.digest}

    def _attempt(self, s, m) -> _Pending | None:
        """The attempt a leader's START/COMMIT/ABORT is about, or None if stale (counted)."""
        pending, r, b = self.pending, m["r"], m["b"]
        if s != (self.promised or (0, None))[1]:  # a leader we no longer obey: it must step down
            self.counters["superseded"] += 1
            if beats(self.promised, b):
                self._nack(s, r, "superseded")
            return None
        if pending is not None and (pending.r, pending.b) == (r, b):
            return pending
        if m["t"] == START and r > self.round and (r, b) != self._proposed:  # (not one we withdrew)
            raise RemoteProtocolError("START for a round that was not proposed to us")
        self.counters["stale"] += 1
        return None

    def _on_start(self, sender, message, now) -> None:
        pending = self._attempt(sender, message)
        if pending is None:
            return
        if pending.started and message["view"] == pending.view:  # sent again, for a READY we sent again
            self.counters["stale"] += 1
            return
        if pending.phase != READIED or message["view"] != pending.view:
            raise RemoteProtocolError("START before READY, or with another view")
        self.timers["ready"].record(now - pending.since)
        pending.phase = self._move(_MEMBER, pending.phase, START)
        pending.total, pending.since, pending.mark = message["total"], now, 1.0
        self._emit(StartRing(pending.r, pending.view))

    def _ring_done(self, r, ok, now, checksum) -> None:
        pending = self.pending
        if pending is None or pending.r != r or pending.phase != RING:
            self.counters["late_ring"] += 1
            return
        pending.phase, pending.ok = self._move(_MEMBER, pending.phase, "ring_done"), ok
        if self.promised and self.promised[1] == pending.b[1]:  # else a newer leader resolves it
            self._send(pending.b[1], {"t": DONE, "r": r, "b": list(pending.b), "ok": ok, "checksum": checksum})

    def _on_decision(self, sender, message, now) -> None:
        if message["t"] == ABORT and sender == (self.promised or (0, None))[1]:
            for q in set(message["drop"]) - {sender, self.id}:
                self.table.unsynced(q)
        pending = self._attempt(sender, message)
        if pending is None:
            return
        if message["t"] == COMMIT and not (pending.phase == RINGED and pending.ok):
            raise RemoteProtocolError("COMMIT of a round whose ring did not finish here")
        self._move(_MEMBER, pending.phase, message["t"])
        if pending.started:
            self._finish(pending, message["t"] == COMMIT, now)
        else:
            self._withdraw(pending)
        if message["t"] == ABORT and sender != self.id:  # (a leader logged its own abort)
            self._emit(Log("info", f"round {message['r']} aborted: {message['reason']}"))

    def _withdraw(self, pending: _Pending) -> None:
        """An unstarted attempt goes away (a started one is never withdrawn, only decided)."""
        self._move(_MEMBER, pending.phase, "withdraw")
        if pending.samples is not None:
            self._emit(PutBack(pending.r))
        self.pending = None

    def _finish(self, pending: _Pending, committed: bool, now: float) -> None:
        self.pending, self.round = None, max(self.round, pending.r)
        self._log.append((pending.r, pending.b, committed))
        self._record_ring(now - pending.since, pending.view)
        self.table.mark_served(pending.view)
        if not committed:
            self._emit(PutBack(pending.r))
        else:
            self.history.append(pending.r, pending.view, pending.total)  # (idle, total 0: the chain stays as it was)
            self._last_view = pending.view
            self._elsewhere.difference_update(pending.view)
            for q in self.table.live_synced() if pending.total else ():  # synced, not in the view: behind us now
                if q not in pending.view and self.table.unsynced(q) and self.lead and not self._is_left_out(q, now):
                    self._tell.add(q)  # tell it, and hold the next boundary while it catches up
                    self._admit[q] = now + self.config.join_hold
            for q in pending.view:
                self.table.synced(q, self.history.version, self.history.digest, pending.r)
            self._emit(Apply(pending.r, pending.total, pending.view))
        self._set_self()
