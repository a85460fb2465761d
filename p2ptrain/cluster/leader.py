"""The leader part of the round machine: taking the lead, proposing, deciding. Pure code, no I/O.

``Leader`` is a part held by ``p2ptrain.cluster.rounds.RoundMachine`` (``machine.leader``). It
owns the attempts this peer sequences (``lead``), the holds for joiners catching up, and, as parts
of its own, whether it may take the lead and the decisions it took (``takeover``), the refusals
under partial connectivity (``refusals``) and who held its rounds more than its samples were
worth (``worth``; one line, at a commit): modules of ``p2ptrain.cluster``. It reads and advances
the machine's core (``table``, ``history``, ``round``, the attempt log) and sends through it (``_send``,
``_broadcast``, ``_emit``). ``rounds`` tells the round itself, ``member`` the member side; this
module is what only the peer that sequences rounds does. The machine calls ``drive`` after every
event, ``check_stall`` on a tick, and ``on_ready``, ``on_done``, ``on_nack`` for the messages a
leader receives; the other parts call ``step_down``, ``abort``, ``takeover.resolve`` and the holds.

Ballots and who leads: a new leader fences off the old one's COMMIT with a newer epoch and a
QUERY, and decides the attempts left in doubt (``takeover``, whose docstring tells the rules).

Refusals. A member that refuses a view (NACK) naming peers it has no link to is dropped, or
those peers are left out of our views a while (``refusals``, whose docstring tells the rules).

A peer alone (``solo``). A leader whose view is itself alone, with nobody else known, asks its
host at every round for a batch and commits it with no ring: the host (``Cluster``) may take
that cost off every step by letting its trainer apply each batch at once and hearing of them
after. ``begin_solo`` withdraws the attempt collecting our batch (it has none yet), and the
rounds of the batches applied meanwhile are committed in order by ``commit_solo``, each as a
round of one member would be: the same chain, round numbers and log. ``end_solo`` goes back to
proposing rounds. While solo the host hands the machine ticks only (a tick changes no round
number then); any other event, a peer linked or a message, ends solo first (``Cluster``).

Transitions (``_LEADER``; ``roundmsg.move`` refuses any other):
    none -takeover-> querying -all STATUS or timeout-> between
    between -PROPOSE-> collecting -all READY-> running -all DONE ok-> between (COMMIT)
    collecting|running -failure, timeout, peer lost, superseded-> between (ABORT)
    querying|between -superseded, loading state, a smaller peer served-> none
    collecting (our own batch, alone) -solo-> solo -solo_end-> between
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from p2ptrain.errors import RemoteProtocolError
from p2ptrain.cluster.refusals import Refusals
from p2ptrain.cluster.takeover import Takeover
from p2ptrain.cluster.silence import silence, silent as silent_peers
from p2ptrain.cluster.worth import Worth
from p2ptrain.cluster.roundmsg import (ABORT, COMMIT, MAX_REASON, PROPOSE, QUERY, START, VOID, WITHDRAWN,
                                       Done, Log, Nack, Ready, Stall, Status, Waiting, beats, move, parse,
                                       ready_offsets, spread_of, with_used)
from p2ptrain.cluster.used import NONE_YET, merge

QUERYING, BETWEEN, COLLECTING, RUNNING, SOLO = "querying", "between", "collecting", "running", "solo"  # leader (None: not)
WAIT_REMINDERS, WAIT_REPEAT = (10.0, 60.0), 300.0  # seconds too few peers to train at which it is said again
USUAL_SLACK = 1.5  # a round first says it stalls once it waits this many times the usual wait (if past half its deadline)

# (phase, event) -> next phase: the only transitions there are (``move`` refuses others).
_LEADER = {
    (None, "takeover"): QUERYING,  # -> QUERY to every candidate
    (QUERYING, "recovered"): BETWEEN,  # -> COMMIT/ABORT of attempts left in doubt
    (BETWEEN, PROPOSE): COLLECTING,
    (COLLECTING, START): RUNNING,
    (RUNNING, COMMIT): BETWEEN,
    (COLLECTING, ABORT): BETWEEN, (RUNNING, ABORT): BETWEEN,
    (QUERYING, "step_down"): None, (BETWEEN, "step_down"): None,  # (collecting/running abort first)
    (COLLECTING, "solo"): SOLO, (SOLO, "solo_end"): BETWEEN,
}


@dataclass
class _Lead:  # the attempts this peer sequences as leader
    b: tuple
    phase: str
    r: int  # the round in flight, or the next one to propose
    since: float
    view: tuple = ()
    waiting: set = field(default_factory=set)
    got: dict = field(default_factory=dict)
    mark: float = 0.5
    early: dict = field(default_factory=dict)  # DONEs that came while collecting (rings start as members contribute)
    ready_at: dict = field(default_factory=dict)  # member -> seconds from the proposal to its READY (``worth``)
    used: bytes | None = NONE_YET  # the OR of its DONEs' masks of parameters with a gradient (``used``; None: all)


class Leader:
    """What only the peer that sequences rounds does: the attempts it leads (``lead``), the
    decisions it took, and the holds, back-offs and refusals around them."""

    def __init__(self, machine) -> None:
        self.machine = machine  # the RoundMachine that holds us
        self.lead: _Lead | None = None  # the attempts we sequence (None: we do not lead)
        self._admit: dict = {}  # joiners catching up: peer -> hold the boundary until
        self._held: dict = {}  # the version a joiner had when we last held for it
        self.takeover = Takeover(machine)  # whether we may lead; our decisions, attempts in doubt
        self.refusals = Refusals(machine)  # peers our views leave out: a member could not reach them
        self.worth = Worth()  # who held our rounds more than its samples were worth (said once)
        self._waiting_since: float | None = None  # too few synced peers to train since then
        self._remind_at = WAIT_REMINDERS[0]  # seconds of it at which the next Waiting is said

    # -- what the machine and the other parts tell us ------------------------------------------
    def peer_gone(self, s: str, now: float, why: str, routine: bool = False) -> None:
        """Peer s can no longer take part: the round we lead with it aborts at once; a rival we
        backed off from that is lost (link, goodbye, silence), not just behind, is forgotten."""
        lead = self.lead
        self.worth.forget(s)
        if lead is not None and lead.phase == QUERYING:
            lead.waiting.discard(s)
        elif lead is not None and lead.phase in (COLLECTING, RUNNING) and s in lead.view:
            self.abort(now, f"{s} {why}", drop=[s], routine=routine)
        self.takeover.peer_gone(s)

    def take_status(self, sender: str, message: Status) -> bool:
        """A STATUS that answers our QUERY is kept for the recovery (True); else False."""
        lead = self.lead
        if lead is not None and message.b == lead.b and lead.phase == QUERYING and sender in lead.waiting:
            lead.waiting.discard(sender)
            lead.got[sender] = message
            return True
        return False

    def hold_for(self, peer: str, now: float, sending: bool) -> None:
        """``RoundMachine.hold_for``: while our state is on its way to ``peer`` (``sending``),
        hold the boundary; once sent, ``join_hold`` at most more."""
        if sending:
            if self.lead is not None and not self.refusals.is_left_out(peer, now):
                self._admit[peer], self._held[peer] = math.inf, self.machine.history.version
        elif self._admit.get(peer) == math.inf:
            self._admit[peer] = now + self.machine.config.join_hold

    def hold_for_behind(self, peer: str, now: float) -> bool:
        """A synced peer left out of a round we just committed is behind now: as leader (unless
        our views leave it out), hold the next boundary while it catches up. True if we hold."""
        if self.lead is None or self.refusals.is_left_out(peer, now):
            return False
        self._admit[peer] = now + self.machine.config.join_hold
        return True

    def hold_for_joiner(self, peer: str, version: int, now: float) -> None:
        """A STATUS shows ``peer`` behind, at ``version``: as leader, hold the boundary while it
        loads (once per version it reports)."""
        if self.lead and self._held.get(peer, -1) < version and not self.refusals.is_left_out(peer, now):
            self._held[peer], self._admit[peer] = version, now + self.machine.config.join_hold

    def caught_up(self, peer: str) -> None:
        """``peer`` showed our state: no more holding for it."""
        self._admit.pop(peer, None)
        self._held.pop(peer, None)

    def leave(self, now: float) -> None:
        """We say goodbye: the round we lead aborts, and we lead no more."""
        if self.lead and self.lead.phase in (COLLECTING, RUNNING):
            self.abort(now, "the leader is leaving", drop=[self.machine.id], routine=True)
        self.lead = None

    def check_stall(self, now: float) -> None:
        """On a tick: a round we lead that waits for a silent member (``silence``) aborts and
        leaves it out, and a takeover stops waiting for a silent candidate; a phase we lead that
        waits past its mark says so (Stall); past its deadline the silent are left out of a
        takeover, a collecting round waits for a slow batch up to ``ready_patience``, a running
        one waits as long while its ring ended ok at some member or ours still moves
        (``_ring_moves``), and any other round aborts. A ring with a slow link, a laptop on poor
        Wi-Fi, is slow everywhere and ends last downstream of it; its first rounds outran a
        deadline set before it joined, and aborting dropped that peer, which fell behind and
        loaded the state again. A ring is a pipeline: where a member hangs, ours stops within a
        few chunks, so such a round still aborts at its next mark, and a dead member is caught
        by its silence."""
        machine, lead = self.machine, self.lead
        if silent := self.silent_members(now):
            return self.abort(now, f"{', '.join(silent)} sent nothing for {silence(machine.config):g} s (stopped, or "
                                   "unplugged): left out until it shows its state", drop=silent)
        if lead is not None and lead.phase == QUERYING:  # (a peer stopped with the leader we take over from)
            self._unqueried(silent_peers(machine, lead.waiting, now))
        if lead is not None and lead.phase in (QUERYING, COLLECTING, RUNNING):
            waited, deadline = now - lead.since, machine._deadline(lead.phase, lead.view)
            if waited >= lead.mark * deadline:
                what = {QUERYING: "status", COLLECTING: "ready", RUNNING: "done"}[lead.phase]
                machine._emit(Stall(tuple(sorted(lead.waiting)), what, waited, lead.r))
                if lead.mark < 1.0:
                    lead.mark = 1.0
                elif lead.phase == QUERYING:
                    self._unqueried(list(lead.waiting))
                elif lead.phase == COLLECTING and lead.mark * 2 <= machine.config.ready_patience:
                    lead.mark *= 2  # (the waited for are live: a slow device's batch, not a failure)
                elif (lead.phase == RUNNING and lead.mark * 2 <= machine.config.ready_patience
                      and (len(lead.waiting) < len(lead.view) or self._ring_moves(lead, now, deadline))):
                    lead.mark *= 2  # (the sums went round, or are going round: a slow link, not a failure)
                else:
                    self.abort(now, f"timed out after {waited:.1f} s waiting for {what} from "
                                    f"{', '.join(sorted(lead.waiting))}", drop=lead.waiting)

    def _unqueried(self, peers) -> None:
        """Our takeover waits no more for ``peers``: left out until they show a STATUS (told ours)."""
        self.machine._tell.update(peers)
        for q in peers:
            self.machine.table.unsynced(q)
        self.lead.waiting.difference_update(peers)

    def silent_members(self, now: float) -> list[str]:
        """The members our collecting or running round waits for that are silent (``silence``):
        left out, they show their state when they run again, and load the cluster's."""
        lead = self.lead
        if lead is None or lead.phase not in (COLLECTING, RUNNING):
            return []
        return silent_peers(self.machine, lead.waiting, now)

    def stood_still(self, now: float, seconds: float) -> None:
        """This process stood still ``seconds`` (``RoundMachine._notice_stillness``): we lead no
        more, and a round we lead is aborted, not committed on what waited in our sockets. A
        member in doubt that gave us up took the lead and decided it without us (aborted: no
        one had committed it), so committing it would put the chains apart. Leading on, our next
        round would wait for a peer stopped with us, and the STATUS of those that went on behind it.
        Alone (``SOLO``) nobody could have decided a round without us: nothing is voided."""
        if self.lead is not None and self.lead.phase != SOLO:
            self.step_down(now, f"this peer stood still for {seconds:.0f} s: its members may have decided the "
                                "round without it")

    def _ring_moves(self, lead: _Lead, now: float, deadline: float) -> bool:
        """Our ring of the led round received a chunk within the last quarter of its
        ``deadline`` (which allows 4x the ring's expected time, so a moving ring's chunks come
        far more often; a member frozen mid-ring, a laptop's lid, is given up on at the first
        mark unless it froze just before it, and then at the next)."""
        moved = self.machine.ring_moved.get(lead.r)
        return moved is not None and now - moved < deadline / 4

    # -- leading -------------------------------------------------------------------------------
    def drive(self, now: float, tick: bool) -> None:
        machine = self.machine
        lead = self.lead
        if not machine.synced or machine.ending.ended is not None:
            return
        if lead is None:
            if tick and self.takeover.may_lead(now):
                self._takeover(now)
        elif lead.phase == QUERYING and not lead.waiting:
            self._recover()
        elif lead.phase == BETWEEN and machine.table.coordinator() != machine.id:
            self.step_down(now, f"handing the lead over to {machine.table.coordinator()}")
        elif lead.phase == BETWEEN:
            self._propose(now)

    def _catching_up(self, now: float) -> dict:
        """The joiners we still hold the boundary for: live, within their hold, not silent (``silence``)."""
        silent = set(silent_peers(self.machine, self._admit, now))
        return {p: t for p, t in self._admit.items() if t > now and self.machine.table.is_live(p) and p not in silent}

    def _takeover(self, now: float) -> None:
        machine = self.machine
        b = (machine.max_epoch + 1, machine.id)
        machine.member.promise(b, now)
        cands = set(machine.table.live_synced()) - {machine.id}
        r = max(machine.round, machine._seen_r, machine.member.pending.r if machine.member.pending else -1) + 1
        self.lead = _Lead(b, move(_LEADER, None, "takeover"), r, now, waiting=cands)
        machine._broadcast({"t": QUERY, "b": list(b)}, sorted(cands))
        machine._emit(Log("info", f"coordinating from epoch {b[0]}: asking {len(cands)} peer(s) for their state"))

    def _recover(self) -> None:
        machine = self.machine
        lead = self.lead
        got = {p: st for p, st in lead.got.items() if st.synced}
        got[machine.id] = parse(machine.lineage.status(lead.b))
        for st in got.values():
            lead.r = max(lead.r, st.round + 1, (st.pending.r if st.pending is not None else -1) + 1)
        after = self.takeover.resolve(got)
        for p in set(lead.got) | set(after):
            if after.get(p) != after[machine.id]:  # not synced, or another state: it hears ours
                machine.table.unsynced(p)
                machine._tell.add(p)
        lead.phase, lead.got = move(_LEADER, lead.phase, "recovered"), {}

    def _propose(self, now: float) -> None:
        machine = self.machine
        lead = self.lead
        over = machine.ending.run_over(now)
        if over:  # (``ending``) once no joiner is catching up: they end with the same parameters
            self._admit = self._catching_up(now)
            if not self._admit:
                machine.ending.end_run(now, over)
            return
        ok, why = machine.table.can_train(machine.config.min_peers)
        if not ok:
            if self._waiting_since is None:
                self._waiting_since, self._remind_at = now, WAIT_REMINDERS[0]
                machine._emit(Log("info", why))
            elif now - self._waiting_since >= self._remind_at:  # (a step that waits on it would wait in silence)
                machine._emit(Waiting(now - self._waiting_since, why))
                later = [t for t in WAIT_REMINDERS if t > self._remind_at]
                self._remind_at = later[0] if later else self._remind_at + WAIT_REPEAT
            return
        self._waiting_since = None
        if not self.refusals.may_propose(now):
            return
        self._admit = self._catching_up(now)
        if self._admit:
            return  # at the boundary, for a joiner catching up
        view = tuple(p for p in machine.table.live_synced() if p == machine.id or not self.refusals.is_left_out(p, now))
        if len(view) < machine.config.min_peers:
            return  # (peers left out for a while: wait for them)
        lead.phase, lead.view = move(_LEADER, lead.phase, PROPOSE), view
        lead.since, lead.mark = now, self._ready_stall_mark()
        lead.waiting, lead.got, lead.early, lead.ready_at = set(lead.view), {}, {}, {}
        lead.used = NONE_YET
        machine._broadcast({"t": PROPOSE, "r": lead.r, "b": list(lead.b), "view": list(lead.view),
                            "end": machine.ending.limits_msg(now)}, lead.view)

    def _lead_msg(self, s: str, m: Ready | Done) -> _Lead | None:
        """Our attempt, if this READY/DONE is about it and in the phase that waits for it."""
        lead = self.lead
        waits_for = COLLECTING if type(m) is Ready else RUNNING
        if lead is None or lead.phase != waits_for or (m.r, m.b) != (lead.r, lead.b):
            self.machine.counters["stale"] += 1
            return None
        if s not in lead.waiting:
            raise RemoteProtocolError(f"{m.t.upper()} from a peer not waited for in this round")
        lead.waiting.discard(s)
        return lead

    def on_ready(self, sender: str, message: Ready, now: float) -> None:
        machine = self.machine
        if self._answer_late_ready(sender, message):
            return
        lead = self._lead_msg(sender, message)
        if lead is None:
            return
        if (message.version, message.digest) != (machine.history.version, machine.history.digest):
            machine.table.unsynced(sender)
            return self.abort(now, f"{sender} holds another state", drop=[sender])
        lead.got[sender], lead.ready_at[sender] = message.samples, now - lead.since
        if not lead.waiting:
            machine.timers["ready"].record(now - lead.since)
            lead.phase, lead.since, lead.mark = move(_LEADER, lead.phase, START), now, machine.config.stall_warn
            lead.waiting = set(lead.view)
            machine._broadcast(self._start_msg(lead), lead.view)
            early, lead.early = lead.early, {}
            for s, done in early.items():  # (a ring can end before the last READY is in)
                if self.lead is not lead or lead.phase != RUNNING:
                    break
                self.on_done(s, done, now)

    def _ready_stall_mark(self) -> float:
        """When a collecting round first says it stalls, as a fraction of its deadline: at
        ``stall_warn``, or where rounds usually wait longer (local steps: the slowest member's H
        inner steps; a slow device's batch) at USUAL_SLACK times the usual wait, at most the
        deadline (where a member says its round stalls). A usual wait is the round's work. Before
        any wait is measured (the first round: a first batch, kernels compiled, H inner steps),
        at the deadline: half of it warned at every start of a local-steps run."""
        machine = self.machine
        timer = machine.timers["ready"]
        usual = timer.usual()
        return 1.0 if not usual else max(machine.config.stall_warn, min(1.0, USUAL_SLACK * usual / timer.deadline()))

    @staticmethod
    def _start_msg(lead: _Lead) -> dict:
        return {"t": START, "r": lead.r, "b": list(lead.b), "view": list(lead.view), "total": sum(lead.got.values()),
                "spread": spread_of(lead.got.values()), "ready": ready_offsets(lead.view, lead.ready_at)}

    def _answer_late_ready(self, s: str, m: Ready) -> bool:
        """A READY (sent again) for an attempt of ours that collects no more. Its member waits
        for a START or an ABORT that a broken link lost: tell it again, or it waits for ever
        while we wait for it. A member that never started a ring is in no round that
        committed (the ring needs every member of its view), so an attempt that is not
        running is an ABORT for it."""
        machine = self.machine
        lead, r, b = self.lead, m.r, m.b
        if b[1] != machine.id:
            return False
        if lead is not None and (r, b) == (lead.r, lead.b):
            if lead.phase == COLLECTING:
                return s in lead.got  # (counted already: that READY is here)
            if lead.phase == RUNNING and s in lead.waiting and s in lead.view:  # (already started: it ignores this)
                machine.counters["start_again"] += 1
                machine._send(s, self._start_msg(lead))
            return True
        if self.takeover.decision((r, b)) is not True:
            machine.counters["abort_again"] += 1
            machine._send(s, {"t": ABORT, "r": r, "b": list(b), "drop": [], "reason": "that attempt is over"})
        return True

    def on_done(self, sender: str, message: Done, now: float) -> None:
        machine = self.machine
        lead = self.lead
        if (lead is not None and lead.phase == COLLECTING and (message.r, message.b) == (lead.r, lead.b)
                and sender in lead.view):  # (its ring ended before every READY came: kept until then)
            if sender in lead.early:
                raise RemoteProtocolError("DONE repeated")
            lead.early[sender] = message
            return
        lead = self._lead_msg(sender, message)
        if lead is None:
            return
        machine.table.report(sender, message.r, message.checksum)
        if not message.ok and message.void is not None:  # (no fault: nobody to wait for or drop; the
            #       others' rings wait for its chunks: abort now; the batches go in the next round, bar one
            #       that is not finite, which its peer leaves out)
            why = VOID[message.void].format(peer=sender)
            return self.abort(now, why, drop=[], routine=message.void == WITHDRAWN, void=message.void)
        if not message.ok:  # (abort now: the others' rings may wait for chunks that will not come,
            self.refusals.ring_failed(now)  # their ends of a closed link not told yet)
            return self.abort(now, f"the ring failed at {sender}", drop=[])
        lead.used = merge(lead.used, message.used)  # (a mask of another length: ``RemoteProtocolError``)
        if lead.waiting:
            return
        machine._record_ring(now - lead.since, lead.view)
        sums = {machine.table.get(p).checksum for p in lead.view if machine.table.get(p)} - {None}
        if len(sums) > 1:  # measured, not assumed away: replicas on different devices drift
            machine._emit(Log("info", f"round {lead.r}: parameter checksums differ ({len(sums)} kinds)"))
        self.takeover.decide((lead.r, lead.b), True)
        # The peers left out hear it too: a leader that speaks to them keeps them from asking
        # around, finding themselves behind and loading state again every round meanwhile.
        out = self.refusals.committed(lead.view, now)
        machine._broadcast(with_used({"t": COMMIT, "r": lead.r, "b": list(lead.b), "total": sum(lead.got.values()),
                                      "spread": spread_of(lead.got.values())}, lead.used),
                           sorted(set(lead.view) | set(out)))
        lead.phase, lead.r = move(_LEADER, lead.phase, COMMIT), lead.r + 1
        slow = self.worth.round(lead.ready_at, lead.got, max(lead.ready_at.values(), default=0.0) + now - lead.since)
        if slow:
            machine._emit(Log("warning", slow))

    def abort(self, now: float, reason: str, drop, tell=True, routine=False, void: str | None = None) -> None:
        """Abort the round we lead, for ``reason`` (one line); ``routine`` (a goodbye, not a
        fault) logs it at info; ``void``: a member's DONE gave that reason (``Abort.void``)."""
        machine = self.machine
        lead, drop = self.lead, sorted(set(drop))
        if lead.phase == RUNNING:
            self.takeover.decide((lead.r, lead.b), False)
        for q in set(drop) - {machine.id}:
            machine.table.unsynced(q)
            if tell:  # it may be alive: our STATUS lets it show its own and come back
                machine._tell.add(q)
        abort = {"t": ABORT, "r": lead.r, "b": list(lead.b), "reason": reason[:MAX_REASON], "drop": drop}
        if void is not None:
            abort["void"] = void
        machine._broadcast(abort, sorted(set(lead.view) | set(drop)))
        machine._emit(Log("info" if routine else "warning", f"round {lead.r} aborted: {reason}"))
        lead.phase, lead.r = move(_LEADER, lead.phase, ABORT), lead.r + 1

    def superseded(self, sender: str, b: tuple, now: float) -> None:
        """``sender`` obeys ballot ``b``, which beats ours (a NACK, or a STATUS of a member of our
        round): we lead no more, and take over again, with a newer epoch, if we still coordinate.
        (A member that followed a leader which then loaded state left our round waiting eight
        deadlines for a DONE it would never send.)"""
        self.machine.max_epoch = max(self.machine.max_epoch, b[0])
        if self.lead is not None and beats(b, self.lead.b):
            self.step_down(now, f"{sender} follows {b[1]} (epoch {b[0]})", rival=b[1])

    def on_nack(self, sender: str, message: Nack, now: float) -> None:
        self.superseded(sender, message.b, now)
        lead = self.lead  # (None if that ballot beat ours)
        if lead is not None and lead.phase == QUERYING and message.r == -1 and sender in lead.waiting:
            return self.takeover.refused(sender, message.b[1], message.reason, now)  # (``Member.on_query``)
        if lead is not None and message.r == lead.r and lead.phase == COLLECTING and sender in lead.view:
            drop = self.refusals.refused(sender, message.missing, lead.view, now)  # (it or nobody)
            self.abort(now, f"{sender} refused the proposal: {message.reason}", drop=drop)

    # -- a peer alone (see the module docstring) -------------------------------------------------
    def may_go_solo(self) -> bool:
        """We lead a view of ourselves alone, know no other live peer, and collect our own batch
        of a round that has none yet."""
        machine = self.machine
        lead, pending = self.lead, machine.member.pending
        return (machine.synced and machine.ending.ended is None and lead is not None and lead.phase == COLLECTING
                and lead.view == (machine.id,) and machine.config.min_peers <= 1 and not self._admit
                and not machine.lineage.hello and not machine.lineage.load_later
                and all(p == machine.id or not machine.table.is_live(p) for p in machine.table.ids())
                and pending is not None and (pending.r, pending.b) == (lead.r, lead.b)
                and pending.samples is None)

    def begin_solo(self) -> None:
        lead = self.lead
        self.machine.member.go_solo(lead.r)  # (its Contribute goes unanswered; no batch in it: nothing put back)
        lead.phase, lead.waiting = move(_LEADER, lead.phase, "solo"), set()

    def commit_solo(self, commits) -> None:
        """(round, samples) of batches applied alone, in order, from ``lead.r`` on."""
        machine = self.machine
        lead = self.lead
        for r, total in commits:
            if lead is None or lead.phase != SOLO or r != lead.r or type(total) is not int or total < 1:
                raise RuntimeError(f"solo commit of round {r} ({total} samples) out of order")  # our bug
            machine._attempt_ended(r, lead.b, lead.view, total, committed=True)
            machine._seen_r, lead.r = max(machine._seen_r, r), r + 1
        if commits:  # (as ``member._finish`` after a committed round)
            machine.table.mark_served(lead.view)  # (a joiner with a smaller id does not take the lead at once)
            machine.table.synced(machine.id, machine.history.version, machine.history.digest, machine.round)
            machine._set_self()

    def end_solo(self, now: float) -> None:
        lead = self.lead
        lead.phase, lead.since = move(_LEADER, lead.phase, "solo_end"), now  # (the next step: PROPOSE)

    def step_down(self, now: float, why: str, rival: str = "", routine: bool = False) -> None:
        """No longer lead: the round we lead aborts (``routine``: said at info, as ``abort``)."""
        machine = self.machine
        if self.lead.phase in (COLLECTING, RUNNING):
            self.abort(now, why, drop=[], routine=routine)
        move(_LEADER, self.lead.phase, "step_down")
        self.lead = None
        if rival:
            self.takeover.back_off(rival, now)
        machine._emit(Log("info", f"no longer coordinating: {why}"))
