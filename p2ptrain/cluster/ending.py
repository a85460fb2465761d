"""The end of a run, one for the whole cluster. Pure code, no I/O.

``Ending`` is a part held by ``p2ptrain.cluster.rounds.RoundMachine`` (``machine.ending``). It
owns ``ended`` and the limits heard from the leader; it reads the machine's ``config`` and
``history`` and sends through the machine (``_broadcast``, ``_emit``). The leader part calls
``run_over`` and ``end_run`` at a boundary and ``limits_msg`` for each PROPOSE; the member part
``adopt_limits`` for a PROPOSE it takes up; the machine dispatches END to ``on_end``, and a
STATUS or GOODBYE that carries ``end`` to ``heard_end``. Finishing steps the leader part down
and withdraws the member part's unstarted attempt.

Why. ``--max-rounds`` and ``--duration`` counted per peer: peers started a moment apart
stopped at different rounds, with different parameters, and the last one trained on alone.

How. A run's limits are the cluster's: a version (``RoundConfig.max_version``: the version a
peer started from, a checkpoint's or 0, plus its --max-rounds; a state loaded from the cluster
moves it to that state's version plus --max-rounds, ``loaded``) and the leader's clock
(``RoundConfig.deadline``, on the clock of ``now``). The leader sends its limits with every
PROPOSE (the version, and the seconds left on its clock); members keep the last they heard, so
that a new leader ends the run at the earlier of its own limits and those. At a boundary (no
attempt in flight) past a limit, once no joiner is catching up (they end with the same
parameters), the leader sends END {version, digest} to every peer it knows and finishes; a
member finishes on END. ``Finish(version, r)`` is the host's cue: the trainer stops once it
has applied that version's update. A finished peer takes part in no round and leads none; its
STATUS and GOODBYE carry ``end``, and a peer that hears it and is not ahead (a joiner that
came too late, a peer left alone) finishes too, whatever version it holds: nobody trains on
alone after the cluster's run is over.

After a resume whose peers bring different checkpoints, the cluster's state is the newest one's
(the peers behind load it), and ``--max-rounds N`` means N updates after it, on every peer
(counted from each peer's own checkpoint, the run would end where the coordinator's limit says,
a different number of updates for each peer). A peer that loads a state
counts N from it (``loaded``); since limits take the earlier of ours and the leader's, a joiner
of a run under way still ends where that run does.

A peer that stood still (SIGSTOP, a lid closed: ``stood_still``) past the end was dropped before
END went out, and the others may have exited since, so no peer is left to tell it. It tells the
end itself: it leads nothing for ``query_timeout`` after waking (``wondering``), time to read
what waited in its sockets and to dial the others again; if then no peer it trained with is
linked (their links closed, their dials failed) and, at the pace of the updates it saw before
it stopped, the cluster would have reached its last version meanwhile, the run is over here
too (``Finish(behind=True)``). A pace too slow for that says the others crashed instead: it
goes on as a peer left alone does (``--min-peers``). A peer of them that links to us again, or
speaks after the backlog of our sockets was read, ends the doubt at once (``heard_from``).
A sleep stops the monotonic clock of ``now``, not the leader's: the seconds slept count on the
deadline (``_asleep``).
"""

from __future__ import annotations

import math
from collections import deque

from p2ptrain.errors import RemoteProtocolError
from p2ptrain.cluster.membership import SYNCED, SYNCING
from p2ptrain.cluster.roundmsg import END, End, Finish, Log, Propose, beats

FRESH_S = 0.5  # a message this long after waking was sent after it, not waiting in our sockets
PACE_KEEP = 32  # (time, version) points a peer keeps to know the cluster's pace (``stood_still``)
OVERDUE_TIMEOUTS = 2.0  # peer timeouts past its deadline after which a member ends a run its leader did not (``overdue``)


class Ending:
    """The end of the run: the limits we heard, and whether the run ended here (``ended``)."""

    def __init__(self, machine) -> None:
        self.machine = machine  # the RoundMachine that holds us
        self.ended: int | None = None  # the version at which the cluster's run ended here
        self._heard_limits = (0, math.inf)  # the leader's (version or 0, deadline on our clock), from its PROPOSE
        self._end_heard: tuple[str, int] | None = None  # a peer's end, heard while a round of ours awaits its decision
        self._after_load = 0  # a state loaded from the cluster: its version + --max-rounds
        self._asleep = 0.0  # seconds this machine slept: the deadline's clock is ``now`` plus these
        self._pace: deque = deque(maxlen=PACE_KEEP)  # (time, version) where the version grew here (``note``)
        self._noted: int | None = None  # the version at the last tick
        self._woke: tuple | None = None  # (when, seconds, version, the peers we trained with, pace) after a stillness

    def loaded(self, version: int) -> None:
        """(``on_synced`` with a donor) We hold the cluster's state at ``version`` now: our
        --max-rounds counts from it, if that is later than our own limit (said in one line where
        our own end had passed). A joiner of a run under way ends where that run's leader says:
        ``limits`` takes the earlier of ours and the leader's."""
        config = self.machine.config
        if not config.max_rounds or self.ended is not None:
            return
        limit = version + config.max_rounds
        if limit <= max(config.max_version, self._after_load):
            return
        self._after_load = limit
        if version >= config.max_version:  # (our own end passed: a newer checkpoint than ours; a joiner of a run
            #                                  under way ends at its leader's limit, heard with its PROPOSE)
            self.machine._emit(Log("info", f"the cluster's state is at version {version}, past this peer's end "
                                           f"(version {config.max_version}): the run ends at version {limit} "
                                           f"(--max-rounds {config.max_rounds} after it)"))

    def limits(self) -> tuple[int, float]:
        """The earlier of our own limits and the leader's we heard: (version or 0, deadline)."""
        config = self.machine.config
        ours = max(config.max_version, self._after_load)
        versions = [v for v in (ours, self._heard_limits[0]) if v > 0]
        return (min(versions) if versions else 0, min(config.deadline, self._heard_limits[1]))

    def limits_msg(self, now: float) -> list | None:
        """A PROPOSE's ``end``: [version or 0, seconds left or None]; None without limits."""
        version, deadline = self.limits()
        if not version and deadline == math.inf:
            return None
        return [version, None if deadline == math.inf else round(max(0.0, deadline - now - self._asleep), 3)]

    def adopt_limits(self, m: Propose, now: float) -> None:
        """The leader we obey proposed with its limits: they are the cluster's now; a deadline
        heard before stays if it is earlier (a leader that started later and never heard it, a
        peer restarted or the side of a split, must not move the cluster's end away: the run went
        on past every original peer's --duration in a churn soak)."""
        version, left = m.end if m.end is not None else (0, None)
        deadline = math.inf if left is None else now + self._asleep + left
        self._heard_limits = (version, min(deadline, self._heard_limits[1]))

    def run_over(self, now: float) -> str:
        """Why the run is over at this boundary ("" if it is not)."""
        version, deadline = self.limits()
        if version and self.machine.history.version >= version:
            return f"the cluster reached its last round (version {version}: --max-rounds)"
        if now + self._asleep >= deadline:
            return "the leader's --duration is over"
        return ""

    def end_run(self, now: float, why: str) -> None:
        """As leader, at a boundary: every peer we know hears END, and we finish."""
        machine = self.machine
        machine._broadcast({"t": END, "b": list(machine.leader.lead.b), "version": machine.history.version,
                            "digest": machine.history.digest, "why": why}, machine._peers())
        self._finish_run(now, why)

    def on_end(self, sender: str, message: End, now: float) -> None:
        if message.b[1] != sender:
            raise RemoteProtocolError("END from a peer that does not own its ballot")
        if self.ended is not None:
            return
        if beats(self.machine.member.promised, message.b):  # a leader we no longer obey: its run is not ours
            self.machine.counters["stale"] += 1
            return
        self._finish_run(now, message.why, (message.version, message.digest))

    def heard_end(self, s: str, version: int, now: float) -> None:
        """A peer says the cluster's run ended at ``version``: unless we are ahead of it (a new
        run), so has ours. A member that heard the last COMMIT first can say so before that
        COMMIT reaches us (its STATUS or GOODBYE comes on another link than the leader's): while
        a round of ours is started and the end is ahead of us, its decision is awaited
        (``decided``). Finishing at once left such a peer a version behind the others, with
        other parameters (seen once in 14 runs of four CPU-starved peers, local steps)."""
        history = self.machine.history
        if self.ended is not None or version < history.version:
            return
        pending = self.machine.member.pending
        if pending is not None and pending.started and version > history.version:
            self._end_heard = (s, version)
            return
        self._end_heard = None
        self._finish_run(now, f"{s} says the cluster's run ended at version {version}", (version, None))

    def decided(self, now: float) -> None:
        """(after a started round of ours was decided, and on each tick) An end heard while it
        awaited its decision takes effect now, once no round of ours is started."""
        if self._end_heard is not None:
            s, version = self._end_heard
            self.heard_end(s, version, now)

    def overdue(self, now: float) -> None:
        """(on each tick) A member whose deadline (its own --duration, or one heard) passed
        ``OVERDUE_TIMEOUTS`` peer timeouts ago, while the leader goes on (it holds a later one and
        never heard ours), ends the run here at its version, between rounds: its STATUS and
        GOODBYE carry the end, and the peers not ahead of it finish too (``heard_end``). A leader
        that knows the deadline ends the run long before (at its next boundary; a new leader at
        once, after ``peer_timeout``)."""
        machine = self.machine
        pending = machine.member.pending
        if self.ended is not None or machine.is_leader or (pending is not None and pending.started):
            return
        late = now + self._asleep - self.limits()[1]
        if late >= OVERDUE_TIMEOUTS * machine.config.peer_timeout:
            self._finish_run(now, f"the cluster's --duration ended {late:.0f} s ago and its leader goes on (it "
                                  "started later and never heard it): the run ends here")
            machine._broadcast(machine.lineage.status(), machine._peers())  # (it carries the end)

    def note(self, now: float) -> None:
        """(on each tick) The version as it grows: the pace a peer that stood still reckons by."""
        version = self.machine.history.version
        if version != self._noted:
            if self._noted is not None:  # (the first version noted may have stood long: no pace from it)
                self._pace.append((now, version))
            self._noted = version

    def stood_still(self, now: float, seconds: float, slept: bool) -> None:
        """This peer stood still ``seconds`` (``slept``: its machine was suspended, and ``now``
        shows no gap). Call it before the event that showed it is handled: the peers we trained
        with are those still in the table then (the machine forgave their silence)."""
        if slept:
            self._asleep += seconds
        if not self.limits()[0]:  # (a run without --max-rounds never ends unheard: nothing to wonder about)
            return
        first, last = (self._pace[0], self._pace[-1]) if self._pace else ((0.0, 0), (0.0, 0))
        pace = (last[1] - first[1]) / (last[0] - first[0]) if last[0] > first[0] else 0.0
        self._woke = (now, seconds, self.machine.history.version, frozenset(self.machine._peers()), pace)

    def wondering(self, now: float) -> bool:
        """Whether the run may have ended while we stood still and we do not know yet: we lead
        nothing then (``Leader``), or we would train alone on the others' absence."""
        return self._woke is not None and self.ended is None and now - self._woke[0] < self.machine.config.query_timeout

    def heard_from(self, peer: str, now: float, linked: bool = False) -> None:
        """A peer we trained with linked to us again (``linked``), or spoke a moment after we
        woke (what waited in our sockets is read at once): it goes on, so we lead again."""
        if (self._woke is not None and peer in self._woke[3]
                and (linked or now - self._woke[0] > FRESH_S)):
            self._woke = None

    def alone_after_stillness(self, now: float) -> None:
        """(on each tick) The end told by the peers' absence (the module docstring): decided once,
        ``query_timeout`` after waking, time for a peer that goes on to be dialled again."""
        if self._woke is None or self.ended is not None or self.wondering(now):
            return
        woke, seconds, version, peers, pace = self._woke
        self._woke = None
        machine = self.machine
        last = self.limits()[0]
        if (not peers or not last or version + pace * seconds < last
                or any(machine.table.state(p) in (SYNCING, SYNCED) for p in peers)):
            return
        machine._emit(Log("warning", f"this peer stood still {seconds:.0f} s and no peer it trained with can be "
                                     f"reached since: at their pace ({pace:.3g} updates a second) the cluster reached "
                                     f"its last version ({last}) meanwhile. It stops at version "
                                     f"{machine.history.version} rather than train on alone; the others' final state "
                                     "is the run's"))
        self._finish_run(now, "the cluster's run ended while this peer stood still", behind=True)

    def _finish_run(self, now: float, why: str, theirs: tuple | None = None, behind: bool = False) -> None:
        machine = self.machine
        history = machine.history
        if machine.leader.lead is not None:
            machine.leader.step_down(now, "the run is over")
        pending = machine.member.pending
        if pending is not None and not pending.started:
            machine.member.withdraw(pending)
        if theirs is not None and (theirs[0] != history.version
                                   or theirs[1] not in (None, history.digest)):
            machine._emit(Log("warning", f"the cluster's run ended at version {theirs[0]} while this peer holds "
                                         f"version {history.version} (it was not in the last rounds); it stops too"))
            behind = True
        self.ended = history.version
        machine._emit(Finish(history.version, machine.round, why, behind))
