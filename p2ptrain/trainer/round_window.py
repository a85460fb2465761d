"""Rounds by time (``sync_every`` a window or ``auto``): how long a window is. Pure, no clock.

In local-steps mode by time, a member forms its pseudo-gradient after the inner step whose end
is nearest to ``window`` seconds since its last contribution: the first step that ends less than
half a step before that, or after it (``contribution_decision.pseudo_gradient_due``, from the
mean step): a fast device takes many inner steps in a window, a slow one few, and the round
averages their changes weighted by samples. No member waits for another's count of steps; the
round waits at most for about half the step each member has in progress when its window ends.
Taking the first step past the window instead, a member 10x slower (0.57 s steps beside 40 ms
ones) overshot its window by about 0.3 s (half its step) on average, which every other member
idled for each round where the members wait at each window's end (below).

``auto``: the window is ``AUTO_RING_TIMES`` times the measured exchange (the median ring of the
current view, from the leader's START to its end: ``RoundMachine.exchange_seconds``), so that a
round's exchange stays a tenth of the window it overlaps, and at least ``AUTO_MIN_STEPS`` of
this member's inner steps (where the members step on through the exchange; where they wait at
each window's end, a slow member's longer window would idle the others) and ``AUTO_MIN_S``
seconds, at most ``AUTO_MAX_S``; before any ring is timed, ``AUTO_MIN_S``. Each member computes
its own; a round goes at the pace of the longest, which is right: the others step on meanwhile
(with two members; see ``auto_waits``). A window changes by at most ``AUTO_MAX_CHANGE`` times per
contribution, so one slow ring (a peer joining, a state transfer) does not swing it.
Why from START: before it, a ring waits for the members whose windows end later, and a window
grown on that wait makes the others wait longer in turn. Fed the ring from its first chunk, the
windows of five peers on two cores grew to the 30 s ceiling within 90 s, with or without faults
(``bench/soak.py --long --sync-every auto``: 18 rounds in the 120 s without faults). A median,
so that a ring held up by a fault (5 s for a silent member) does not move it.
Why a 2 s floor: each round's update lands a round late, plus the slower member's step in
progress, and that delay is a larger share of a shorter window. Measured (``bench/uneven.py
--model 1m``, a peer 3.7x slower, int8, staleness 1, a loaded 2-core machine): to the loss in
5.7 s with 2 s windows, 10.9 s with 1 s, 25.8 s with 0.5 s ones; the fast peer alone 5.5 s.

``auto`` with three or more members waits at each window's end for its round to be applied
(``auto_waits``), as at staleness 0, where the cluster allows staleness 1: with four replicas a
round's update landing a window late left them stepping on from points a window apart. Measured
(``bench/uneven.py --model 1m --n 4 --gpu-like --slow 3.7``, int8, batch 8, quiet): final loss
0.785 and 0.825 stepping on, three fast peers alone 0.709 and 0.728 (40 s); waiting, 0.672-0.690
in six runs of 50 s, the three alone 0.659-0.758 (the waits, 0.05-0.10 s a round: a waiting
member's window begins as its step returns, ``TrainerState.window_began``). Beside a fourth
10x slower (``--slow 10``, 50 s, three runs each, time to 0.78 read on the smoothed loss), with
the slow member's window ending at its nearest step and not lengthened by its steps: 0.81x, 0.82x
and 0.87x the three fast peers' time alone at 567-587 samples/s and 24-25 rounds, where the first
step past a window of at least four of its steps gave 0.88x, 0.89x and 0.95x at 472-484 samples/s
and 20-21 rounds. Two members step
on: there staleness 1 won in each of three runs (``--slow 3.7``, ``10``, and ``--gpu-like``:
0.44x against 0.73x the fast peer's time, 0.54x against 0.62x, and a final loss of 0.755
against 0.800).
"""

from __future__ import annotations

AUTO_MIN_S = 2.0  # seconds: shorter windows lose more to the update landing a round late (the docstring)
AUTO_FIRST_S = AUTO_MIN_S  # auto's window before any ring was timed
AUTO_RING_TIMES = 10.0  # the exchange takes at most a tenth of the window
AUTO_MIN_STEPS = 4.0  # inner steps of this member's at least, so a slow member contributes a few every window
AUTO_MAX_S = 30.0  # a longer window lets the replicas' inner steps diverge too far (DiLoCo's H <= 500 steps)
AUTO_MAX_CHANGE = 2.0  # times a window may grow or shrink from one contribution to the next
AUTO_WAIT_MEMBERS = 3  # members from which auto's rounds are waited for at each window's end (the docstring)


def auto_window(previous: float | None, ring_mean: float | None, compute_mean: float, waits: bool = False) -> float:
    """``auto``'s next window in seconds, from the last one (None: the first), the mean ring
    seconds (None: none timed yet) and the mean seconds of one inner step; ``waits``: the
    members wait at each window's end (``auto_waits``), where no member's own steps lengthen it."""
    if ring_mean is None:
        target = AUTO_FIRST_S
    else:
        target = AUTO_RING_TIMES * ring_mean
    steps = 0.0 if waits else AUTO_MIN_STEPS * compute_mean
    target = min(AUTO_MAX_S, max(AUTO_MIN_S, steps, target))
    if previous is not None:
        target = min(previous * AUTO_MAX_CHANGE, max(previous / AUTO_MAX_CHANGE, target))
    return target


def auto_waits(members: int) -> bool:
    """Whether ``auto``'s member waits at a window's end for its round, as at staleness 0 (the
    module docstring): with ``members`` (at least ``min_peers``) of three or more."""
    return members >= AUTO_WAIT_MEMBERS
