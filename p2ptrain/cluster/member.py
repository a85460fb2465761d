"""The member part of the round machine: taking part in a leader's rounds. Pure code, no I/O.

``Member`` is a part held by ``p2ptrain.cluster.rounds.RoundMachine`` (``machine.member``). It
owns the attempt this peer takes part in (``pending``), the ballot it obeys (``promised``) and
which rounds' Contribute the host still owes. It reads the machine's core (``table``,
``history``, ``round``, ``counters``, ``timers``, the attempt log ``_log``) and sends through it
(``_send``, ``_emit``). ``rounds`` holds the machine (its inputs, the plumbing, deadlines);
``leader`` is what only the peer that sequences rounds does; this module is what every peer does
as a member of a round, the leader too. The machine dispatches QUERY, PROPOSE, START, COMMIT and
ABORT here and calls ``contributed`` and ``ring_done`` for its host's answers, and
``check_stall`` on a tick.

Transitions (``_MEMBER``; ``roundmsg.move`` refuses any other):
    idle -PROPOSE-> proposed -contribution-> ring (READY, and StartRing at once) -ring_done-> done
    done -COMMIT-> idle (Apply);  any -ABORT-> idle (PutBack);
    proposed -PROPOSE of a better ballot, same round-> proposed
    proposed -a better ballot, leader lost-> idle (withdrawn)

A member starts its ring as it contributes, not at the leader's START: the ring cannot end
before every member of the view has started it, so waiting for START (every READY in, told
back) only added a message each way to every round (2 peers at 1 Gbit/s: READY sent to ring
started took 1.4-1.9 ms of a 17-22 ms round). Nothing is applied before COMMIT, so a round the
leader aborts meanwhile (a READY of another state, a NACK, a READY that never came) is put back
as any started one is. START still comes, once every READY is in: it tells the total (COMMIT
tells it too), and a member that has not heard it sends its READY again (``check_stall``).
"""

from __future__ import annotations

from dataclasses import dataclass

from p2ptrain.errors import RemoteProtocolError
from p2ptrain.cluster.membership import SYNCED
from p2ptrain.cluster.silence import lately, quiet_for, silence, speaks
from p2ptrain.cluster.roundmsg import (ABORT, COMMIT, DONE, NACK, NOT_FINITE, PROPOSE, PROPOSED, READIED, READY, RING,
                                       RINGED, Abort, Apply, Commit, Contribute, Log, Propose, PutBack, Query,
                                       Stall, Start, StartRing, beats, move, with_used)

# (phase, event) -> next phase: the only transitions there are (``move`` refuses others).
_MEMBER = {
    (None, PROPOSE): PROPOSED,  # -> Contribute(r)
    (PROPOSED, "contribution"): RING,  # -> READY, StartRing
    (RING, "ring_done"): RINGED,  # -> DONE
    (RINGED, COMMIT): None,  # -> Apply
    (PROPOSED, PROPOSE): PROPOSED,  # same round, better ballot
    (PROPOSED, "withdraw"): None,  # never started: no trace
    (PROPOSED, ABORT): None, (RING, ABORT): None, (RINGED, ABORT): None,  # -> PutBack (a started one)
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
    told: bool = False  # the leader's START came (every member ready; the total)
    used: bytes | None = None  # the COMMIT's mask of parameters with a gradient (``used``; None: all)
    spread: tuple | None = None  # (largest, squares) of the members' samples, from START or COMMIT
    ready: tuple | None = None  # START's: seconds from each member's READY to the last one

    @property
    def started(self) -> bool:
        return self.phase in (RING, RINGED)


class Member:
    """What a peer does as a member of the rounds whose view names it."""

    def __init__(self, machine) -> None:
        self.machine = machine  # the RoundMachine that holds us
        self.pending: _Pending | None = None  # the attempt we take part in
        self.promised: tuple | None = None  # the best ballot seen: the leader we obey
        self._asked: set = set()  # rounds whose Contribute the host has not answered yet
        self._proposed: tuple = ()  # the last attempt proposed to us that we took up

    def reset(self) -> None:
        """We loaded state (``on_synced``): no attempt, no leader obeyed, nothing asked."""
        self.pending, self.promised, self._asked = None, None, set()

    def _nack(self, to: str, r: int, reason: str, missing=()) -> None:
        machine = self.machine
        if to != machine.id:
            machine._send(to, {"t": NACK, "r": r, "b": list(self.promised or (0, machine.id)), "reason": reason,
                               "missing": list(missing)})

    def promise(self, b: tuple, now: float, keep: int = -1) -> None:
        """Obey ballot b from now on. An unstarted attempt of another ballot can never start
        here any more: it is withdrawn (unless it is round ``keep``, proposed again under b)."""
        machine, pending = self.machine, self.pending
        if pending is not None and not pending.started and pending.b != b and pending.r != keep:
            self.withdraw(pending)
        self.promised, machine.max_epoch = b, max(machine.max_epoch, b[0])
        if pending is not None and not pending.started and pending.b[1] != b[1]:  # its leader would wait for our READY:
            self._nack(pending.b[1], pending.r, "superseded")  # it steps down now, not at its deadline
        if machine.leader.lead and machine.leader.lead.b != b:
            machine.leader.step_down(now, f"superseded by {b[1]} (epoch {b[0]})", rival=b[1])

    def on_query(self, sender: str, message: Query, now: float) -> None:
        machine = self.machine
        if message.b[1] != sender:
            raise RemoteProtocolError("QUERY from a peer that does not own its ballot")
        if machine.synced and beats(self.promised, message.b):
            return self._nack(sender, -1, "superseded")
        if machine.synced and self._led_on(sender, now):  # (a peer left out, back from a cut cable whose
            #   link to our leader is quiet a while longer: it found that leader silent)
            self._nack(sender, -1, f"its leader {self.promised[1]} leads")  # it steps down; our STATUS shows it
            return machine._send(sender, machine.lineage.status())  # where the cluster is (it loads if behind)
        if machine.synced:
            self.promise(message.b, now)
        machine._send(sender, machine.lineage.status(message.b, re=True))

    def _led_on(self, candidate: str, now: float) -> bool:
        """Whether a takeover by ``candidate``, which our table shows out of the cluster (not
        synced), would replace a leader that leads us now: in its round, or one that sent us a
        round's message while it speaks (``silence.speaks``). Refused, as Raft's followers refuse
        a vote while their leader is live: obeyed for its newer epoch, a peer that had been cut
        off deposed a working leader, and the soak saw 5-6 s without a round. A synced candidate
        may take over (a smaller id after its first round, a side after a heal)."""
        machine, leader = self.machine, (self.promised or (0, None))[1]
        if leader in (None, candidate, machine.id) or machine.table.state(candidate) == SYNCED:
            return False
        in_round = self.pending is not None and self.pending.b == self.promised
        return machine.table.state(leader) == SYNCED and speaks(machine, leader, now) and (
            in_round or now - machine.led_at < lately(machine.config))

    def on_propose(self, sender: str, message: Propose, now: float) -> None:
        machine = self.machine
        r, b, view, pending = message.r, message.b, message.view, self.pending
        if b[1] != sender or (pending is not None and (pending.r, pending.b) == (r, b)):
            raise RemoteProtocolError("PROPOSE repeated, or from a peer that does not own its ballot")
        if not machine.synced or r <= machine.round:
            machine.counters["old_round" if machine.synced else "unsynced"] += 1
        elif beats(self.promised, b):
            self._nack(sender, r, "superseded")
        elif machine.id not in view or sender not in view:
            self._nack(sender, r, "the view does not hold us and the leader")
        elif any(q != machine.id and not machine.table.is_live(q) for q in view):
            missing = [q for q in view if q != machine.id and not machine.table.is_live(q)]
            self._nack(sender, r, "the view names a peer we are not connected to", missing)
        elif pending is not None and pending.started:  # in doubt: this leader must resolve that attempt first
            self.promise(b, now)
            machine._send(sender, machine.lineage.status(b, re=True))
        else:
            self.promise(b, now, keep=r)
            machine.ending.adopt_limits(message, now)
            self._proposed = (r, b)
            if self.pending is not None and self.pending.r != r:
                self.withdraw(self.pending)
            pending = self.pending
            if pending is not None:  # the same round under a better ballot, not contributed to yet
                pending.phase = move(_MEMBER, pending.phase, PROPOSE)
                pending.b, pending.view, pending.since = b, view, now
                return
            self.pending = _Pending(r, b, view, move(_MEMBER, None, PROPOSE), now)
            if r not in self._asked:  # (one outstanding Contribute per round number)
                self._asked.add(r)
                machine._emit(Contribute(r))

    def contributed(self, r, samples, now) -> None:
        """The host's answer to Contribute(r)."""
        machine = self.machine
        self._asked.discard(r)
        pending = self.pending
        if pending is None or pending.r != r or pending.phase != PROPOSED:
            machine.counters["late_contribution"] += 1
            return machine._emit(PutBack(r))
        pending.phase = move(_MEMBER, pending.phase, "contribution")
        pending.samples, pending.since = samples, now
        machine._send(pending.b[1], self._ready_msg(pending))
        machine._emit(StartRing(pending.r, pending.view))  # (not at START: the module docstring)

    def _ready_msg(self, pending: _Pending) -> dict:
        history = self.machine.history
        return {"t": READY, "r": pending.r, "b": list(pending.b), "samples": pending.samples,
                "version": history.version, "digest": history.digest}

    def _attempt(self, s: str, m: Start | Commit | Abort) -> _Pending | None:
        """The attempt a leader's START/COMMIT/ABORT is about, or None if stale (counted)."""
        machine = self.machine
        pending, r, b = self.pending, m.r, m.b
        if s != (self.promised or (0, None))[1]:  # a leader we no longer obey: it must step down
            machine.counters["superseded"] += 1
            if beats(self.promised, b):
                self._nack(s, r, "superseded")
            return None
        if pending is not None and (pending.r, pending.b) == (r, b):
            return pending
        if type(m) is Start and r > machine.round and (r, b) != self._proposed:  # (not one we withdrew)
            raise RemoteProtocolError("START for a round that was not proposed to us")
        machine.counters["stale"] += 1
        return None

    def on_start(self, sender: str, message: Start, now: float) -> None:
        machine = self.machine
        pending = self._attempt(sender, message)
        if pending is None:
            return
        if not pending.started or message.view != pending.view:
            raise RemoteProtocolError("START before READY, or with another view")
        if pending.told:  # sent again, for a READY we sent again
            machine.counters["stale"] += 1
            return
        machine.timers["ready"].record(now - pending.since)
        pending.told, pending.total, pending.spread, pending.mark = True, message.total, message.spread, 1.0
        pending.ready = message.ready
        if pending.phase == RING:  # (the ring's time counts from here, as the leader's does)
            pending.since = now

    def ring_done(self, r, ok, now, checksum, void=None, used=None) -> None:
        """The host's answer to StartRing(r); ``void``: not ok, with no peer at fault (``roundmsg.VOID``);
        ``used``: which of our parameters had a gradient (``used.encode``; None: all did)."""
        machine = self.machine
        pending = self.pending
        if pending is None or pending.r != r or pending.phase != RING:
            machine.counters["late_ring"] += 1
            return
        pending.phase, pending.ok = move(_MEMBER, pending.phase, "ring_done"), ok
        if self.promised and self.promised[1] == pending.b[1]:  # else a newer leader resolves it
            done = {"t": DONE, "r": r, "b": list(pending.b), "ok": ok, "checksum": checksum}
            if void is not None:
                done["void"] = void
            machine._send(pending.b[1], with_used(done, used))

    def on_decision(self, sender: str, message: Commit | Abort, now: float) -> None:
        machine = self.machine
        if type(message) is Abort and sender == (self.promised or (0, None))[1]:
            for q in set(message.drop) - {sender, machine.id}:
                machine.table.unsynced(q)
        pending = self._attempt(sender, message)
        if pending is None:
            return
        if type(message) is Commit and not (pending.phase == RINGED and pending.ok):
            raise RemoteProtocolError("COMMIT of a round whose ring did not finish here")
        if type(message) is Commit and message.total is not None:  # (its START may have been lost)
            pending.total, pending.spread = message.total, message.spread
        if type(message) is Commit:
            pending.used = message.used
        move(_MEMBER, pending.phase, message.t)
        if pending.started:
            self._finish(pending, type(message) is Commit, now,
                         not_finite=type(message) is Abort and message.void == NOT_FINITE)
        else:
            self.withdraw(pending)
        if type(message) is Abort and sender != machine.id:  # (a leader logged its own abort)
            machine._emit(Log("info", f"round {message.r} aborted: {message.reason}"))

    def withdraw(self, pending: _Pending) -> None:
        """An unstarted attempt goes away (a started one is never withdrawn, only decided)."""
        move(_MEMBER, pending.phase, "withdraw")
        if pending.samples is not None:
            self.machine._emit(PutBack(pending.r))
        self.pending = None

    def forget(self) -> None:
        """We load state: an unstarted attempt is withdrawn, an in-doubt one is void (the
        host's Resync says so)."""
        if self.pending and not self.pending.started:
            self.withdraw(self.pending)
        self.pending = None

    def go_solo(self, r: int) -> None:
        """Our own batch of round r is applied alone: its Contribute goes unanswered (the host
        drops it) and the attempt collecting it is withdrawn (no batch in it: nothing put back)."""
        self._asked.discard(r)
        self.withdraw(self.pending)

    def leave(self) -> None:
        """We say goodbye: a contribution handed over is put back."""
        if self.pending and self.pending.samples is not None:
            self.machine._emit(PutBack(self.pending.r))
        self.pending = None

    def _finish(self, pending: _Pending, committed: bool, now: float, not_finite: bool = False) -> None:
        machine = self.machine
        table = machine.table
        self.pending = None
        if pending.told:  # (since START: before it, the ring waited for the others' batches too)
            machine._record_ring(now - pending.since, pending.view)
        table.mark_served(pending.view)
        machine._attempt_ended(pending.r, pending.b, pending.view, pending.total, committed, pending.used)
        if not committed:
            machine._emit(PutBack(pending.r, not_finite))
        else:
            for q in table.live_synced() if pending.total else ():  # synced, not in the view: behind us now
                if q not in pending.view and table.unsynced(q) and machine.leader.hold_for_behind(q, now):
                    machine._tell.add(q)  # tell it (the leader holds the next boundary while it catches up)
            for q in pending.view:
                table.synced(q, machine.history.version, machine.history.digest, pending.r)
            machine._emit(Apply(pending.r, pending.total, pending.view, pending.used, pending.spread, pending.ready))
        machine._set_self()
        machine.ending.decided(now)  # (an end a peer told us while this round awaited its decision)

    def give_up_silent_leader(self, now: float) -> None:
        """On a tick: the leader we obey sent nothing at all (keepalives come every 0.5 s) for the
        silence a leader gives a member up after (``silence.silence``: 2.5 s by default) while we
        listened, and another peer was heard meanwhile (so the silence is the leader's, not our
        own link's): it is stopped or unplugged. It is left out as a
        silent member is (unsynced, not dead: its links stay), so the next smallest synced peer
        takes the lead (``Takeover.may_lead``) and resolves a round in doubt, rather than every
        peer waiting out the peer timeout; so is that next peer, while it is as silent (two lids
        closed together). Back, a peer left out stood still, tells its state, finds a newer
        ballot and loads the cluster's state if it is behind."""
        machine = self.machine
        table, limit, leader = machine.table, silence(machine.config), (self.promised or (0, None))[1]
        lead = leader if table.state(leader) == SYNCED else table.coordinator()
        if not machine.synced or lead in (None, machine.id) or quiet_for(machine, lead, now) <= limit:
            return  # (every tick: the usual answer, before a look at every peer)
        quiet = {p: quiet_for(machine, p, now) for p in machine._peers()}
        if len(quiet) > 1 and all(q > limit for q in quiet.values()):
            return  # (every other peer silent: our own link, not theirs; alone with the leader we cannot tell)
        for _ in quiet:  # (each pass leaves one peer out: the next to lead, until one speaks or it is us)
            lead = leader if table.state(leader) == SYNCED else table.coordinator()
            if lead in (None, machine.id) or quiet.get(lead, 0.0) <= limit:
                return
            table.unsynced(lead)
            machine._tell.add(lead)  # (read once it runs again: it steps down at once)
            pending = self.pending
            if pending is not None and not pending.started and pending.b[1] == lead:
                self.withdraw(pending)
            who = f"leader {lead}" if lead == leader else f"{lead}, next to lead,"
            machine._emit(Log("warning", f"{who} sent nothing for {limit:g} s (stopped, or unplugged): the next "
                                         "peer leads; it is left out until it shows its state"))

    def check_stall(self, now: float) -> None:
        """On a tick: our READY or DONE waits longer than its deadline for the leader's answer
        (a Stall at 1, 2, 4... deadlines, for a DONE); a READY no START answered is sent again,
        in case a link lost it (or its START, or an ABORT)."""
        machine, pending = self.machine, self.pending
        if pending is None or not pending.started or pending.b[1] == machine.id:
            return
        waited, ready = now - pending.since, not pending.told
        if not ready and pending.phase != RINGED:  # (told, our ring runs: its own timeout; mark stays for DONE)
            return
        if waited >= pending.mark * machine._deadline(READIED if ready else pending.phase, pending.view):
            if pending.phase == RINGED:
                machine._emit(Stall((pending.b[1],), "start" if ready else "decision", waited, pending.r))
            pending.mark *= 2
            if ready:  # its leader answers again (``on_ready``)
                machine._send(pending.b[1], self._ready_msg(pending))
