"""Rounds: who proposes, who is ready, when an averaged update is applied. Pure code, no I/O.

Theory of operation. One ``RoundMachine`` per peer. The *leader* (``PeerTable.coordinator``)
sequences numbered rounds; every peer, the leader too, is a *member* of the rounds whose view
names it. A round is a two-phase commit around the ring (the messages: ``roundmsg``):

    leader                               member
    PROPOSE {r, b, view}        ------>  Contribute(r): the host swaps its accumulator, then
                                <------  READY {r, b, samples, version, digest}   on_contribution_ready
                                         StartRing(r, view): at once, the host runs the ring-allreduce
    START {r, b, view, total,   ------>  (every READY is in: the total, and the samples' spread:
           spread}                        ``roundmsg.spread_of``)
                                <------  DONE {r, b, ok, checksum, used}          on_ring_done
    COMMIT {r, b, total, used,  ------>  Apply(r, total, used, spread)   every READY and DONE was ok
            spread}
    ABORT {r, b, reason, drop}  ------>  PutBack(r)        a failure, a timeout, a peer lost

A member's ring starts as it contributes, not at START (``member``'s docstring says why): a
ring cannot end before every member of its view has started it, and nothing is applied
before COMMIT. An attempt not contributed to leaves no trace (no ring ran). Only a started
attempt has an outcome; ``round`` is the last one here. Leaders never reuse a round number
they have seen.

Ballots. Every message of a leader carries its ballot b = (epoch, its id). A member obeys
the best ballot it has seen (higher epoch; on a tie the smaller id) and answers a worse one,
or a view naming a peer it has no link to, with NACK.

Who owns what. The machine is one object holding four parts, each a plain class in its own
module that owns its own state (set in its ``__init__``; no other object assigns it):
``member`` (``p2ptrain.cluster.member.Member``: the attempt this peer takes part in, ``pending``,
and the ballot it obeys, ``promised``; transitions ``_MEMBER``), ``leader``
(``p2ptrain.cluster.leader.Leader``: the attempts it sequences, ``lead``; taking the lead,
fencing, attempts left in doubt, holds for joiners, refusals under partial connectivity, solo;
transitions ``_LEADER``), ``lineage`` (``p2ptrain.cluster.lineage.LineageKeeper``: STATUS,
comparing chains, loading state) and ``ending`` (``p2ptrain.cluster.ending.Ending``: the run's
limits, ``ended``). The machine owns the core they share and advance: ``table``, ``history``,
``round``, ``synced``, ``max_epoch``, ``config``, ``counters``, the deadlines' timers, the log
of attempts (``_log``), the last committed view, and the plumbing (``_send``, ``_broadcast``,
``_emit``; ``_tell``: peers owed our STATUS). Each part holds the machine (``self.machine``)
and reaches the other parts through it; a part's methods without an underscore are what the
machine and the other parts call. This module is the machine itself: its inputs, which part
handles each message (``_dispatch``, by its class), the plumbing, and deadlines; ``pending``,
``promised``, ``lead`` and ``ended`` are read-only views of the parts' state for the host.

Messages. A received message (a dict, as are those we send to ourselves) is checked by
``roundmsg.parse`` into the frozen dataclass of its type (``Propose``, ``Ready``, ...), and the
parts read its fields as attributes; the messages the machine sends are dicts, built where they
are sent, carried by ``Send`` and ``Broadcast``.

Call order: hand each event to one method; carry out the returned actions in order. A
malformed or impossible message raises ``RemoteProtocolError`` (drop that link); a stale
one is counted in ``counters``.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from dataclasses import dataclass, field

from p2ptrain.cluster.ending import Ending
from p2ptrain.cluster.leader import COLLECTING, QUERYING, SOLO, Leader, _Lead
from p2ptrain.cluster.lineage import LineageKeeper
from p2ptrain.cluster.member import Member, _Pending
from p2ptrain.cluster.membership import SYNCED, SYNCING, History, PeerTable, RoundTimer
from p2ptrain.cluster.silence import stillness
from p2ptrain.cluster.roundmsg import (GOODBYE, LOG_KEEP, READIED, Abort, Broadcast, Commit, Done, End, Goodbye,
                                       Log, Message, Nack, Propose, Query, Ready, Send, Start, Status, parse)

MAX_RATES = 256  # peers whose link rate a machine remembers (``learn_rate``; the oldest go first)
LISTEN_GAP = 1.0  # seconds between our own events (ticks come every 0.1 s) past which what we heard is stale


@dataclass(frozen=True)
class SyncPoint:
    """What a snapshot carries besides tensors, so that a joiner continues the same chain.
    A founder uses ``SyncPoint(0, membership.genesis(param_checksum), -1, 0)``."""
    version: int
    digest: bytes
    round: int
    epoch: int
    window: tuple = field(default=(), compare=False, repr=False)  # the member's History before it


@dataclass(frozen=True)
class RoundConfig:
    min_peers: int = 1
    peer_timeout: float = 10.0  # silent (no beacon, no message) this long: dead
    query_timeout: float = 5.0  # a takeover waits this long for STATUS; idle peers re-announce at twice it
    floor: float = RoundTimer.FLOOR_S  # the shortest deadline of a phase (see RoundTimer)
    stall_warn: float = 0.5  # a leader's first Stall, as a fraction of the deadline (the first round's: 1)
    # A member still computing its batch is waited for up to this many ready deadlines (the
    # stalls warn at 1, 2, 4): dropping a live member from a round would make it load the
    # state again. A silent one is left out of the round after ``silence.silence`` (2.5 s)
    # (``Leader.silent_members``), a dead one by its link, not this.
    ready_patience: float = 8.0
    join_hold: float = 10.0  # the leader holds the next round this long while a joiner catches up
    listen: float = 0.0  # a peer leads nothing this long after its start: peers started with it meet at genesis
    max_version: int = 0  # > 0: the cluster's run ends at this version (``ending``: our start + --max-rounds)
    max_rounds: int = 0  # > 0: --max-rounds, counted again from a newer state loaded (``ending.loaded``)
    deadline: float = math.inf  # the run ends at this time (the clock of ``now``) if we lead (--duration)


class RoundMachine:
    """One peer's rounds. It starts not synced: call ``on_synced`` with a founder's SyncPoint or
    a snapshot's ``sync_point()``. The host feeds beacons to ``table.heard`` itself and calls
    ``on_tick`` about every 100 ms; every other event comes through the ``on_*`` methods."""

    def __init__(self, peer_id: str, config: RoundConfig | None = None, table: PeerTable | None = None):
        self.id, self.config = peer_id, config or RoundConfig()
        self.table = table or PeerTable(peer_id)
        self.history, self.synced, self.round = History(), False, -1
        self.max_epoch = 0  # the highest epoch of any ballot seen (a takeover takes the next)
        self.counters: Counter = Counter()
        self.timers = {"ready": RoundTimer(self.config.floor), "ring": RoundTimer(self.config.floor)}
        self._timed_view: frozenset = frozenset()  # the view whose rings timers["ring"] has measured
        self._nbytes = 0  # the ring buffer's size, for the deadline
        self._rates: dict[str, float] = {}  # peer -> bytes/s our state went to it at (``learn_rate``)
        self.ring_moved: dict[int, float] = {}  # round -> when our ring of it last received (``on_tick``)
        self._log: deque = deque(maxlen=LOG_KEEP)  # (r, b, committed) of attempts that ended here
        self._masks: dict = {}  # (r, b) -> the COMMIT's ``used`` mask, of the committed ones logged
        self._seen_r = -1  # the highest round number seen in any proposal
        self._last_view: tuple = ()  # the view of the last round we committed
        self._heard_lead = 0.0  # when a leader last spoke to us (quiet peers re-announce)
        self.led_at = float("-inf")  # when the leader we obey last sent us a round's message (``member``)
        self._ran_at: float | None = None  # (the last event: a long gap since is our own stillness)
        self.listening_since = -math.inf  # the end of our last gap over LISTEN_GAP: silences count from it
        self._tell: set = set()  # peers to send our STATUS once this event is handled
        self._left = False  # we said goodbye: every later event is ignored
        self._now = 0.0  # the time of the event being handled
        self._out: list = []  # the actions of the event being handled
        self._loop: deque = deque()  # messages to ourselves
        # The parts: each owns its own state (see the module docstring).
        self.member = Member(self)  # the attempt we take part in, the ballot we obey
        self.leader = Leader(self)  # the attempts we sequence, and the leader's bookkeeping
        self.lineage = LineageKeeper(self)  # whether peers hold our state; a load put off
        self.ending = Ending(self)  # the run's limits, and whether it ended

    # -- the parts' state the host reads (read-only here: each part owns its own) ---------------
    @property
    def pending(self) -> _Pending | None:
        """The attempt we take part in as a member (``member``)."""
        return self.member.pending

    @property
    def promised(self) -> tuple | None:
        """The best ballot seen: the leader we obey (``member``)."""
        return self.member.promised

    @property
    def lead(self) -> _Lead | None:
        """The attempts we sequence as leader; None if we do not lead (``leader``)."""
        return self.leader.lead

    @property
    def ended(self) -> int | None:
        """The version at which the cluster's run ended here; None while it goes on (``ending``)."""
        return self.ending.ended

    # -- inputs ------------------------------------------------------------------------------
    def on_message(self, sender: str, msg: dict, now: float) -> list:
        return self._run(now, self._dispatch, sender, parse(msg), now)

    def on_tick(self, now: float, ring_moved: dict[int, float] | None = None) -> list:
        """Deadlines, silent peers, and taking the lead: only on a tick, so that STATUS
        messages that arrived together are all seen before a peer takes over. ``ring_moved``:
        round -> when our running ring of it last received a chunk (a ring that moves is slow,
        not stuck: see ``Leader.check_stall``)."""
        self.ring_moved = dict(ring_moved or {})
        return self._run(now, self._tick, now, tick=True)

    def on_connected(self, peer: str, now: float, addr: tuple | None = None) -> list:
        self.table.connected(peer, now, addr)
        return self._run(now, self._linked, peer, now)

    def _linked(self, peer: str, now: float) -> None:
        self.ending.heard_from(peer, now, linked=True)  # (after a stillness this event showed: ``_run``)
        self._tell.add(peer)

    def on_woken(self, now: float, seconds: float) -> list:
        """This machine slept ``seconds`` (a lid closed) though ``now`` shows no gap: the
        host's monotonic clock stops while it is suspended (``sleepwatch``). Handled as a gap
        between events is (``_notice_stillness``); call it before the event that showed it."""
        return self._run(now, self._stood_still, now, seconds, True)

    def on_peer_lost(self, peer: str, now: float) -> list:
        self.table.link_lost(peer, now)
        return self._run(now, self._gone, peer, now, "lost")

    def on_contribution_ready(self, r: int, samples: int, now: float, nbytes: int = 0) -> list:
        if type(samples) is not int or samples < 0:
            raise ValueError(f"samples must be an int >= 0, got {samples!r}")
        self._nbytes = nbytes or self._nbytes  # the ring buffer's size, for the deadline
        return self._run(now, self.member.contributed, r, samples, now)

    def on_ring_done(self, r: int, ok: bool, now: float, checksum: bytes | None = None,
                     void: str | None = None, used: bytes | None = None) -> list:
        """``used``: which parameters of our contribution had a gradient (``used.encode``; None: all)."""
        return self._run(now, self.member.ring_done, r, bool(ok), now, checksum, void, used)

    def on_synced(self, point: SyncPoint, now: float, donor: str | None = None) -> list:
        """Our state is now the one ``point`` describes (a snapshot from ``donor``, or a
        founder's genesis). The donor has it too, so it counts on our side at once: a heal
        compared before the others' STATUS arrives does not see our side as one peer. Nor do
        we lead that side before we see its leader (a replugged peer with a small id, linked
        to one member first, took the members away from their leader, which then loaded state)."""
        self.history, self.round = History(point.version, point.digest, point.window), point.round
        self.synced = True
        self.member.reset()
        self.max_epoch, self._heard_lead = max(self.max_epoch, point.epoch), now
        self._last_view = ()  # (our side is the one we loaded: see ``lineage``)
        if donor is not None and donor != self.id and self.table.is_live(donor):
            self.table.synced(donor, point.version, point.digest, point.round, now)
        side_leader = self.lineage.side_leader
        if donor is not None and side_leader not in ("", self.id):  # that side has a leader: not us
            self.leader.takeover.back_off(side_leader, now)
        self._set_self()
        self.lineage.on_synced(self._peers(), now)
        return self._run(now, self._after_sync, point.version if donor is not None else None)

    def on_load_failed(self, asked: str, why: str, now: float) -> list:
        """The host stopped trying to load state (``Resync``) from the peers it ``asked``: the
        last failed (``why``) and nobody linked was left to ask, or every try failed (a donor
        killed mid-download). We go on from our own state, which the host left as it was, and
        the linked peers' STATUS decide again (``lineage.load_failed``)."""
        return self._run(now, self.lineage.load_failed, asked, why, now)

    def _after_sync(self, loaded: int | None) -> None:
        self._tell.update(self._peers())  # (every peer: ``hello`` awaits only those of the side we loaded)
        if loaded is not None:  # (a state from the cluster: --max-rounds may count from it, ``ending``)
            self.ending.loaded(loaded)

    # -- a peer alone (``leader``: solo) --------------------------------------------------------
    @property
    def solo(self) -> bool:
        """Solo: the host's trainer applies batches at once and the host commits their rounds."""
        return self.leader.lead is not None and self.leader.lead.phase == SOLO

    def solo_round(self) -> int | None:
        """The round a first batch applied alone would be committed as (the next ones follow
        it), if we may go solo now (``leader``); else None."""
        return None if self.solo or not self.leader.may_go_solo() else self.leader.lead.r

    def begin_solo(self, now: float) -> None:
        """Go solo (at ``solo_round``): the round collecting our batch is withdrawn."""
        if self.solo_round() is None:
            raise RuntimeError("not alone, or not between our own batches: no solo now")  # our bug
        self._run(now, self.leader.begin_solo)  # (it sends or emits nothing)

    def solo_may_go_on(self, now: float) -> bool:
        """Not once the run is over (its last version, or its deadline): ``end_solo`` ends it."""
        return not self.ending.run_over(now)

    @property
    def last_version(self) -> int:
        """The version at which the cluster's run ends (0: none set)."""
        return self.ending.limits()[0]

    def commit_solo(self, commits, now: float) -> list:
        """The rounds of batches applied alone: [(round, samples)], in order."""
        return self._run(now, self.leader.commit_solo, list(commits))

    def end_solo(self, now: float) -> list:
        """Back to rounds (the host's trainer no longer applies batches alone)."""
        return self._run(now, self.leader.end_solo, now) if self.solo else []

    def leave(self, now: float) -> list:
        """Say goodbye; the machine is done (an outstanding contribution is put back)."""
        def go():
            self.leader.leave(now)
            self.member.leave()
            self._broadcast({"t": GOODBYE, "end": self.ending.ended}, self._peers())
            self.synced, self._left = False, True
        return self._run(now, go)

    def hold_for(self, peer: str, now: float, sending: bool = False) -> list:
        """We are sending ``peer`` our state (``sending``), or have sent it. As leader, hold the
        next boundary for as long as the snapshot is on its way, then ``join_hold`` at most
        until the peer reports that state, so that it is not behind once it has loaded. (A
        hold of ``join_hold`` from the start left a joiner whose download took longer, a big
        model over Wi-Fi, behind after every load: it loaded again, and never caught up.)"""
        return self._run(now, self.leader.hold_for, peer, now, sending)

    def sync_point(self) -> SyncPoint:
        return SyncPoint(self.history.version, self.history.digest, self.round, self.max_epoch)

    @property
    def version(self) -> int:
        return self.history.version

    @property
    def is_leader(self) -> bool:
        return self.leader.lead is not None

    def members(self) -> int:
        """Peers that train together, us included: the live synced ones in our table, or the
        view our leader proposed to us if that is more. A peer dropped from a round (a refusal,
        a timeout) is marked unsynced here until it shows its STATUS to us, which it may not do
        before the next round commits; the leader, which heard it, proposes it again."""
        pending = self.member.pending
        return max(len(self.table.live_synced()), len(pending.view) if pending is not None else 0)

    # -- plumbing (the parts send, emit and read the peer table through these) -------------------
    def _run(self, now, fn, *args, tick=False) -> list:
        self._out, self._now = [], now
        if self._left:
            return []
        self._notice_stillness(now)
        fn(*args)
        for _ in range(1000):  # our own messages, deferred STATUS, the leader's next step: until quiet
            while self._loop:
                self._dispatch(self.id, parse(self._loop.popleft()), now)
            self.lineage.compare_deferred(now)
            lead = self.leader.lead
            before = lead and (lead.phase, lead.r)
            self.leader.drive(now, tick)
            for p in sorted(self._tell - {self.id}):
                self._send(p, self.lineage.status(to=p))
            self._tell.clear()
            lead = self.leader.lead
            if not self._loop and before == (lead and (lead.phase, lead.r)):
                return self._out
        raise RuntimeError("round machine did not settle")  # our bug

    def _notice_stillness(self, now: float) -> None:
        """Events come at least a tick apart (0.1 s): a gap past ``silence.stillness`` is this
        process's own stillness (a lid closed, SIGSTOP), and the peers' messages wait unread in
        its sockets, whichever event comes first. Every live peer counts as heard now
        (``PeerTable.forgive``): expiring one made us load its state as from a split, not as a
        peer left behind. A round we lead is void (``Leader.stood_still``): a member in doubt
        may have given us up and decided it meanwhile, and committing it on the DONE that waited
        in the socket split the chain. Every peer hears our STATUS: a leader that left us out of
        its round meanwhile (``Leader.silent_members``) finds us behind at once. An event loop
        held up as long (a host's long wait) reads the same; forgiving, voiding and telling cost
        nothing then but a round tried again."""
        last, self._ran_at = self._ran_at, now
        if last is not None and now - last > LISTEN_GAP:  # (frames may wait unread in our sockets)
            self.listening_since = now
        if last is not None and now - last > stillness(self.config):
            self._stood_still(now, now - last)

    def _stood_still(self, now: float, seconds: float, slept: bool = False) -> None:
        self.ending.stood_still(now, seconds, slept)
        self._emit(Log("info", f"this peer stood still for {seconds:.0f} s (its machine slept, its process was "
                               "stopped, or its event loop was held up): the others are heard before any is given up"))
        self.table.forgive(now)
        self.leader.stood_still(now, seconds)
        self.lineage.await_hello(self._peers(), now)
        self._tell.update(self._peers())

    def _emit(self, action) -> None:
        self._out.append(action)

    def _send(self, to: str, msg: dict) -> None:
        self._loop.append(msg) if to == self.id else self._out.append(Send(to, msg))

    def _broadcast(self, msg: dict, to) -> None:
        others = tuple(p for p in to if p != self.id)
        if others:
            self._out.append(Broadcast(msg, others))
        if self.id in to:
            self._loop.append(msg)

    def _peers(self) -> list:
        return [p for p in self.table.ids(SYNCING, SYNCED) if p != self.id]

    def _dispatch(self, sender: str, message: Message, now: float) -> None:
        self.table.message(sender, now)
        self.ending.heard_from(sender, now)
        if self.ending.ended is not None:  # the run is over here: say so to whoever asks, take part in nothing
            if type(message) is Query or (type(message) is Status and not message.re):
                self._send(sender, self.lineage.status(re=True))
            elif type(message) is Goodbye:
                self.table.said_goodbye(sender, now)
            return
        if type(message) in (Query, Propose, Start, Commit, Abort):  # a leader speaks to us
            self._seen_r, self._heard_lead = max(self._seen_r, -1 if type(message) is Query else message.r), now
        member, leader = self.member, self.leader
        {Query: member.on_query, Status: self.lineage.on_status, Propose: member.on_propose, Ready: leader.on_ready,
         Start: member.on_start, Done: leader.on_done, Commit: member.on_decision, Abort: member.on_decision,
         Nack: leader.on_nack, Goodbye: self._on_goodbye, End: self.ending.on_end}[type(message)](sender, message, now)
        if type(message) in (Propose, Start, Commit, Abort) and sender == (member.promised or (0, None))[1]:
            self.led_at = now

    def _set_self(self) -> None:
        self.table.set_self(self.synced, self.history.version, self.history.digest, self.round)

    def _attempt_ended(self, r: int, b: tuple, view, total: int, committed: bool, used: bytes | None = None) -> None:
        """Attempt r (ballot b) ended here, and is logged. Committed (a member's COMMIT, or a
        round of a peer alone: ``leader.commit_solo``), the chain grows by it (an idle round,
        total 0, leaves it as it was) and the peers of its view hold our state."""
        self.round = max(self.round, r)
        self._log.append((r, b, committed))
        self._masks = {k: m for k, m in self._masks.items() if (*k, True) in self._log}
        if committed and used:  # (a new leader that re-commits it to a member in doubt sends it on)
            self._masks[(r, b)] = used
        if committed:
            self.history.append(r, view, total)
            self._last_view = view
            self.lineage.shared_round(view)

    def _on_goodbye(self, sender: str, message: Goodbye, now: float) -> None:
        self.table.said_goodbye(sender, now)
        self._gone(sender, now, "said goodbye", routine=True)
        if message.end is not None:
            self.ending.heard_end(sender, message.end, now)

    def _gone(self, s: str, now: float, why: str, routine: bool = False) -> None:
        """Peer s can no longer take part: re-form at once, without waiting for a deadline.
        ``routine``: it said goodbye (a round it aborts is logged at info, not as a warning)."""
        pending = self.member.pending
        self.leader.peer_gone(s, now, why, routine)
        if pending is not None and not pending.started and pending.b[1] == s:
            self.member.withdraw(pending)

    # -- time --------------------------------------------------------------------------------
    def _link_bytes(self, n: int) -> int:
        return 2 * (n - 1) * self._nbytes // n if n > 1 else 0  # what a ring moves per link

    def _record_ring(self, seconds: float, view) -> None:
        """A ring's duration, learned per view: other peers make another ring (a laptop on
        Wi-Fi joining two wired desktops makes every round several times slower), so a new
        view starts from the timer's defaults, not from the pace of the old one. (Its first
        rounds, aborted at the old pace, left that laptop out, behind, loading state again.)"""
        if frozenset(view) != self._timed_view:
            self.timers["ring"], self._timed_view = self._new_ring_timer(view), frozenset(view)
        self.timers["ring"].record(seconds, self._link_bytes(len(view)))

    def exchange_seconds(self) -> float | None:
        """A ring's usual length in this view, from START (every member ready) to its end: the
        exchange alone, without the wait for the members' batches or windows (None: none timed)."""
        return self.timers["ring"].median() if self._timed_view else None

    def learn_rate(self, peer: str, rate: float) -> None:
        """Our state went to ``peer`` at ``rate`` bytes a second: a ring with it is no faster, so
        a new view with it is first timed at that rate where it is below the timer's default
        (a laptop on 10 Mbit/s Wi-Fi: its first round was aborted at the default's deadline)."""
        if rate > 0:
            self._rates.pop(peer, None)
            self._rates[peer] = rate
            while len(self._rates) > MAX_RATES:
                del self._rates[next(iter(self._rates))]

    def _new_ring_timer(self, view) -> RoundTimer:
        known = [self._rates[p] for p in view if p in self._rates]
        return RoundTimer(self.config.floor, throughput=min([RoundTimer.THROUGHPUT, *known]))

    def _deadline(self, phase: str, view) -> float:
        if phase == QUERYING:
            return self.config.query_timeout
        if phase in (COLLECTING, READIED):
            return self.timers["ready"].deadline()
        timer = self.timers["ring"] if frozenset(view) == self._timed_view else self._new_ring_timer(view)
        return timer.deadline(self._link_bytes(len(view)))

    def _tick(self, now: float) -> None:
        self.ending.decided(now)  # (an end heard while a round of ours, voided another way since, was started)
        if self.ending.ended is not None:
            return
        self.lineage.tick(now)
        for peer in self.table.expire(now, self.config.peer_timeout):
            self._gone(peer, now, f"was silent for {self.config.peer_timeout:g} s")
        self.ending.note(now)
        self.ending.alone_after_stillness(now)
        self.ending.overdue(now)
        if self.ending.ended is not None:
            return
        self.member.give_up_silent_leader(now)
        pending = self.member.pending
        self.leader.check_stall(now)
        quiet = min(2 * self.config.query_timeout, self.config.peer_timeout / 2)  # well before we seem dead
        if self.synced and (pending is None or pending.started) and now - self._heard_lead > quiet:
            self._heard_lead = now  # no leader speaks to us: we may be left out, or in doubt, unheard
            self._broadcast(self.lineage.status(), self._peers())
        self.member.check_stall(now)
