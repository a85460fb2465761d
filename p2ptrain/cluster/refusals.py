"""Refusals: which peers a leader leaves out of its views under partial connectivity. Pure code, no I/O.

``Refusals`` is held by the leader part of the round machine (``machine.leader.refusals``,
``p2ptrain.cluster.leader``). It owns which peers our views leave out and until when, which
peers members last said they could not reach, and when the next proposal may go out after a
refusal. It reads the machine's ``table``, ``_last_view`` and the time of the event (``_now``),
and emits through it (``_emit``, ``_tell``). The leader calls ``refused`` for a NACK that refuses
its proposal (and aborts it, dropping whom ``refused`` returns), ``may_propose`` at a boundary,
``committed`` after a COMMIT, and ``is_left_out``/``out_for`` where views, holds and STATUS
need them.

Refusals. A member refuses (NACK) a view naming a peer it has no link to, and names them
(``missing``). The first time, the link is most likely re-forming (a replugged cable, a mesh
still forming): the refuser is dropped, hears our STATUS, and the next proposal waits
REFUSAL_BACKOFF. A peer named missing again within MISSING_AGAIN seconds is left out of our
views for LEAVE_OUT seconds, doubling while refusals repeat (LEAVE_OUT_MAX at most), so the
rest keep training under partial connectivity; if the refuser misses more of the view than it
reaches, the refuser is left out instead. On a tie the side that was not in our last round is
left out, else the refuser: at three peers, a peer replugged and linked to one member so far is
left out, whichever of the two refuses, not the member it has no link to yet, which would fall
behind and load state. (Leaving a peer out at the first refusal made it chase the leader's
version, loading state again and again while it was out.) A left-out peer still hears every
COMMIT (a leader that speaks to it keeps it from asking around and loading state again and
again); when its time is over it hears our STATUS, catches up (we hold the boundary) and is in
the next view. A refusal that names nobody (an older peer) drops the refuser and delays the
next proposal by REFUSAL_BACKOFF, so that it cannot loop at once.

Rings that fail round after round (``ring_failed``; a fault that stays, such as peers whose
gradients cannot sum) wait too: the first failure none (a link lost as a peer left: the next
view leaves it out), then REFUSAL_BACKOFF, doubling up to RING_BACKOFF_MAX, until a round
commits. Before, each abort led to the next proposal at once: 26,000 log lines in 30 s.
"""

from __future__ import annotations

from p2ptrain.cluster.roundmsg import Log

REFUSAL_BACKOFF = 0.25  # seconds a leader waits before proposing again after a member refused
LEAVE_OUT, LEAVE_OUT_MAX = 2.0, 30.0  # a peer a member cannot reach stays out of views this long, doubling
MISSING_AGAIN = 5.0  # a peer named missing twice within this many seconds is left out (once: a link re-forming)
RING_BACKOFF_MAX = 4.0  # seconds the next proposal waits at most while rings keep failing


class Refusals:
    """The leader's record of refusals: who is left out of our views, and for how long."""

    def __init__(self, machine) -> None:
        self.machine = machine  # the RoundMachine whose leader holds us
        self._refused_until = float("-inf")  # no proposal before this (a member just refused one)
        self._left_out: dict = {}  # peer a member could not reach -> (out of our views until, for how long)
        self._missing_at: dict = {}  # peer a member last said it could not reach -> when
        self._ring_failures = 0  # rounds in a row whose ring failed (``ring_failed``)

    def refused(self, sender: str, named, view, now: float) -> list:
        """``sender``, of ``view``, refused our proposal, naming the peers it has no link to
        (``named``; None from an older peer). Returns whom the ABORT drops: nobody if someone
        is left out now, else the refuser (and the next proposal waits REFUSAL_BACKOFF)."""
        machine = self.machine
        missing = sorted(set(named or ()) & set(view) - {machine.id, sender})
        again = [q for q in missing  # (a peer left out before, and not in a round since, counts too)
                 if q in self._left_out or now - self._missing_at.get(q, float("-inf")) < MISSING_AGAIN]
        self._missing_at.update((q, now) for q in missing)
        if again:  # no link to them, again: leave them out a while (or it, if they are more)
            fewer = 2 * len(missing) - (len(view) - 1)  # < 0: it misses fewer than it reaches
            newcomers = sender in machine._last_view and not set(missing) & set(machine._last_view)
            out = missing if fewer < 0 or (fewer == 0 and newcomers) else [sender]  # (a tie: the newcomers)
            self._leave_out(out, now, f"{sender} is not connected to {', '.join(missing)}")
            return []
        # Told our STATUS, it comes back as soon as it shows it is synced (a mesh still
        # forming refuses for a moment; waiting for its idle re-announce took 10 s), and
        # the next proposal waits REFUSAL_BACKOFF so that a refusal cannot loop at once.
        self._refused_until = now + REFUSAL_BACKOFF
        return [sender]

    def ring_failed(self, now: float) -> None:
        """A round we led aborted because its ring failed: from the second in a row, the next
        proposal waits (see the module docstring)."""
        self._ring_failures += 1
        if self._ring_failures >= 2:
            wait = min(REFUSAL_BACKOFF * 2 ** (self._ring_failures - 2), RING_BACKOFF_MAX)
            self._refused_until = max(self._refused_until, now + wait)

    def may_propose(self, now: float) -> bool:
        """At a boundary: not within REFUSAL_BACKOFF of a refusal. A peer whose time out is
        over hears our STATUS: it loads our state if behind, and is in the next view."""
        if now < self._refused_until:
            return False
        table = self.machine.table
        for q, (until, secs) in list(self._left_out.items()):
            if q not in table:
                del self._left_out[q]
            elif float("-inf") < until <= now:  # its time out is over: it hears our state,
                self._left_out[q] = (float("-inf"), secs)  # loads it if behind, and is in the next view
                self.machine._tell.add(q)
        return True

    def committed(self, view, now: float) -> list:
        """A round of ``view`` worked: a later refusal of its peers starts from LEAVE_OUT again.
        Returns the live peers our views leave out now."""
        self._ring_failures = 0
        for p in view:
            self._left_out.pop(p, None)
        return [p for p in self._left_out if self.is_left_out(p, now) and self.machine.table.is_live(p)]

    def _leave_out(self, peers, now: float, why: str) -> None:
        """Partial connectivity: views leave ``peers`` out for LEAVE_OUT seconds, doubling while
        refusals repeat (up to LEAVE_OUT_MAX), so that the others train meanwhile. A round
        that commits with a peer in it clears its record."""
        for q in peers:
            secs = min(2 * self._left_out.get(q, (0.0, LEAVE_OUT / 2))[1], LEAVE_OUT_MAX)
            self._left_out[q] = (now + secs, secs)
            self.machine._emit(Log("info", f"leaving {q} out of the rounds for {secs:g} s: {why}"))

    def is_left_out(self, peer: str, now: float) -> bool:
        return self._left_out.get(peer, (float("-inf"),))[0] > now

    def out_for(self, peer: str) -> float | None:
        """Seconds our views still leave ``peer`` out, for its STATUS: a peer left out and
        behind waits for us rather than load our state again after every round it misses; 0
        once its time is over (it loads now if behind); None for a peer never left out."""
        if peer not in self._left_out:
            return None
        return round(max(0.0, self._left_out[peer][0] - self.machine._now), 3)
