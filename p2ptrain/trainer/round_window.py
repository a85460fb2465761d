"""Rounds by time (``sync_every`` a window or ``auto``): how long a window is. Pure, no clock.

In local-steps mode by time, a member forms its pseudo-gradient after the first inner step
that ends once ``window`` seconds have passed since its last contribution
(``contribution_decision.pseudo_gradient_due``): a fast device takes many inner steps in a
window, a slow one few, and the round averages their changes weighted by samples. No member
waits for another's count of steps; the round waits at most for the step each member has in
progress when its window ends.

``auto``: the window is ``AUTO_RING_TIMES`` times the measured exchange (a ring, from its start
to its commit: ``pacing.Pacing.round_mean``), so that a round's exchange stays well under the
window it overlaps, and at least ``AUTO_MIN_STEPS`` of this member's inner steps and
``AUTO_MIN_S`` seconds (a window shorter than a step is a round per step: the ring's fixed
costs every step), at most ``AUTO_MAX_S``. Before any ring is timed: ``AUTO_FIRST_S``. Each
member computes its own; a round goes at the pace of the longest, which is right: the others
step on meanwhile (staleness >= 1). A window changes by at most ``AUTO_MAX_CHANGE`` times per
contribution, so one slow ring (a peer joining, a state transfer) does not swing it.
"""

from __future__ import annotations

AUTO_FIRST_S = 1.0  # auto's window before any ring was timed
AUTO_RING_TIMES = 4.0  # the exchange takes at most a quarter of the window
AUTO_MIN_S = 0.5  # seconds: shorter windows pay the ring's fixed costs (a round's messages) too often
AUTO_MIN_STEPS = 2.0  # inner steps of this member's at least, so a slow member contributes every window
AUTO_MAX_S = 30.0  # a longer window lets the replicas' inner steps diverge too far (DiLoCo's H <= 500 steps)
AUTO_MAX_CHANGE = 2.0  # times a window may grow or shrink from one contribution to the next


def auto_window(previous: float | None, ring_mean: float | None, compute_mean: float) -> float:
    """``auto``'s next window in seconds, from the last one (None: the first), the mean ring
    seconds (None: none timed yet) and the mean seconds of one inner step."""
    if ring_mean is None:
        target = AUTO_FIRST_S
    else:
        target = AUTO_RING_TIMES * ring_mean
    target = min(AUTO_MAX_S, max(AUTO_MIN_S, AUTO_MIN_STEPS * compute_mean, target))
    if previous is not None:
        target = min(previous * AUTO_MAX_CHANGE, max(previous / AUTO_MAX_CHANGE, target))
    return target
