"""``contribution_decision``: when a member contributes, table by table, with no thread, socket or
clock (``now`` is an argument). Each row: a state, a mode, the time, and what must be decided."""

from __future__ import annotations

import dataclasses

import pytest

from p2ptrain.trainer.contribution_decision import (LINGER_MAX_S, LINGER_S, PATIENCE_S, Action, Mode, View, decide,
                                                    idle_linger, patience, pseudo_gradient_due)

NOW = 100.0
WAIT, TAKE, FILLING = Action.WAIT, Action.TAKE, Action.TAKE_FILLING

# A member between steps: one batch of 8 accumulated on version 5, the cluster at 5, its next batch
# computing on 5 since 0.01 s, a compute mean well under the patience floor, not in lockstep.
BASE = View(accumulated=8, oldest=5, committed=5, computing_on=5, computing=True, step_end=NOW - 0.01,
            compute_mean=0.01, lockstep=False)


def view(**changes) -> View:
    return dataclasses.replace(BASE, **changes)


def test_the_view_and_the_decision_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        BASE.accumulated = 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        decide(BASE, Mode(staleness=0), NOW).action = TAKE


# (mode, view changes, action, why, retry in seconds from now or None, drop)
ALWAYS = [
    (Mode(0), dict(restore_waiting=True), WAIT, "a state load waits", None, False),
    (Mode(0), dict(out=True), WAIT, "our last one is still out", None, False),
    (Mode(2), dict(out=True, restore_waiting=True), WAIT, "our last one is still out", None, False),
    (Mode(1, local_steps=True), dict(restore_waiting=True), WAIT, "a state load waits", None, False),
]

STALENESS_0 = [
    (Mode(0), {}, TAKE, "", None, False),
    (Mode(0), dict(accumulated=0, oldest=None), WAIT, "no batch yet", None, False),
    # overlap: backward's buffer goes out once takeable, and only where nothing else is accumulated
    (Mode(0, overlap=True), dict(accumulated=0, oldest=None, filling_ready=True), FILLING, "", None, False),
    (Mode(0, overlap=True), dict(filling_ready=True), TAKE, "", None, False),
    (Mode(0, overlap=True), dict(accumulated=0, oldest=None), WAIT, "no batch yet", None, False),
    # staleness 0 never drops, nor waits for a batch in progress: step waits for its round instead
    (Mode(0), dict(oldest=1, committed=9, computing_on=3), TAKE, "", None, False),
]

LATE = PATIENCE_S - 0.01  # (seconds since step returned: a batch still waited for)
STALE = [
    # a batch in progress that would be too stale after this round is waited for, until the patience is out
    (Mode(1), dict(computing_on=4), WAIT, "the batch in progress", LATE, False),
    (Mode(2), dict(computing_on=4), TAKE, "", None, False),  # (within 2)
    (Mode(1), dict(computing_on=4, step_end=NOW - PATIENCE_S), TAKE, "", None, False),  # (patience out)
    # in lockstep at staleness 1: any batch in progress, and the next one while nothing is accumulated
    (Mode(1), dict(lockstep=True), WAIT, "the batch in progress", LATE, False),
    (Mode(1), dict(lockstep=True, computing=False, accumulated=0, oldest=None), WAIT, "the next batch", LATE,
     False),
    (Mode(1), dict(lockstep=True, computing=False), TAKE, "", None, False),  # (it stepped: take it)
    (Mode(1), dict(lockstep=True, computing=False, accumulated=0, oldest=None, leaving=True), WAIT,
     "lingering for a batch", LINGER_S, False),
    (Mode(2), dict(lockstep=True), TAKE, "", None, False),  # (lockstep waits at staleness 1 only)
    # what is staler than the bound is dropped first; with nothing left the member lingers
    (Mode(1), dict(oldest=3, computing=False), WAIT, "lingering for a batch", LINGER_S, True),
    (Mode(1), dict(oldest=3, computing=False, linger_due=True), TAKE, "", None, True),
    (Mode(2), dict(oldest=3, computing=False), TAKE, "", None, False),
    # nothing accumulated: linger (doubling after idle rounds), unless the linger already ran out
    (Mode(1), dict(accumulated=0, oldest=None), WAIT, "lingering for a batch", LINGER_S, False),
    (Mode(1), dict(accumulated=0, oldest=None, idle_rounds=3), WAIT, "lingering for a batch", 8 * LINGER_S,
     False),
    (Mode(1), dict(accumulated=0, oldest=None, linger_due=True), TAKE, "", None, False),
    # a member not waited for any more, still computing, gives nothing at once (the others go on) ...
    (Mode(1), dict(accumulated=0, oldest=None, step_end=NOW - 3.0), TAKE, "", None, False),
    # ... and so does one whose batch in progress is not due within the linger (a slower member's) ...
    (Mode(2), dict(accumulated=0, oldest=None, compute_mean=0.5), TAKE, "", None, False),
    (Mode(2), dict(accumulated=0, oldest=None, compute_mean=0.025), WAIT, "lingering for a batch", LINGER_S,
     False),  # (due in 15 ms: within the linger)
    # ... unless a round found nothing anywhere: then it backs off as idle
    (Mode(2), dict(accumulated=0, oldest=None, compute_mean=0.5, idle_rounds=1), WAIT, "lingering for a batch",
     2 * LINGER_S, False),
    (Mode(1), dict(accumulated=0, oldest=None, step_end=NOW - 3.0, idle_rounds=1), WAIT,
     "lingering for a batch", 2 * LINGER_S, False),
    # beside a slower member: ours waits while another batch of ours ends before its READY is due
    (Mode(1), dict(computing=False, more_until=NOW + 0.3), WAIT, "the batches that fit before a slower member's",
     0.3, False),
    (Mode(2), dict(more_until=NOW + 0.3), WAIT, "the batches that fit before a slower member's", 0.3, False),
    (Mode(1), dict(computing=False, more_until=NOW + 0.3, linger_due=True), TAKE, "", None, False),  # (due now)
    (Mode(1), dict(computing=False, more_until=NOW + 0.3, leaving=True), TAKE, "", None, False),
    (Mode(1), dict(accumulated=0, oldest=None, more_until=NOW + 0.3), WAIT, "lingering for a batch", LINGER_S,
     False),  # (nothing yet: as without)
    # a batch in progress begun because it belongs in this round is waited for, lockstep or not
    (Mode(1), dict(filling=True), WAIT, "the batch in progress", LATE, False),
    (Mode(2), dict(filling=True), WAIT, "the batch in progress", LATE, False),
    (Mode(1), dict(filling=True, step_end=NOW - PATIENCE_S), TAKE, "", None, False),  # (patience out)
]

LOCAL = [
    (Mode(0, local_steps=True), {}, TAKE, "", None, False),  # (the pseudo-gradient is in)
    (Mode(1, local_steps=True), dict(accumulated=0, oldest=None, computing=False), WAIT, "inner steps", None,
     False),
    (Mode(1, local_steps=True), dict(accumulated=0, oldest=None), WAIT, "inner steps", LATE, False),
    # not stepping (past the patience): an empty contribution, unless the cluster is idle
    (Mode(1, local_steps=True), dict(accumulated=0, oldest=None, step_end=NOW - 3.0), TAKE, "", None, False),
    (Mode(1, local_steps=True), dict(accumulated=0, oldest=None, step_end=NOW - 3.0, idle_rounds=2), WAIT,
     "lingering for a batch", 4 * LINGER_S, False),
    (Mode(1, local_steps=True), dict(accumulated=0, oldest=None, step_end=NOW - 3.0, idle_rounds=2,
                                     linger_due=True), TAKE, "", None, False),
    (Mode(0, local_steps=True), dict(accumulated=0, oldest=None, computing=False, leaving=True), TAKE, "", None,
     False),
    # local steps never drop a stale pseudo-gradient (staleness bounds gradients, not inner steps)
    (Mode(1, local_steps=True), dict(oldest=1, committed=9), TAKE, "", None, False),
]


@pytest.mark.parametrize("mode, changes, action, why, retry, drop", ALWAYS + STALENESS_0 + STALE + LOCAL)
def test_decision_table(mode, changes, action, why, retry, drop):
    d = decide(view(**changes), mode, NOW)
    assert (d.action, d.why, d.drop_stale) == (action, why, drop)
    if retry is None:
        assert d.retry_at is None
    else:
        assert d.retry_at == pytest.approx(NOW + retry)


def test_patience_grows_with_a_slow_batch():
    """A member whose batches take long is waited for longer: 4 mean batches, at least PATIENCE_S."""
    assert patience(0.01) == PATIENCE_S
    assert patience(1.0) == 4.0
    slow = view(computing_on=4, compute_mean=1.0, step_end=NOW - 3.0)  # (3 s late: under 4 mean batches)
    d = decide(slow, Mode(1), NOW)
    assert (d.action, d.retry_at) == (WAIT, pytest.approx(NOW + 1.0))


def test_idle_linger_doubles_up_to_its_cap():
    assert [idle_linger(n) for n in range(4)] == [LINGER_S, 2 * LINGER_S, 4 * LINGER_S, 8 * LINGER_S]
    assert idle_linger(50) == LINGER_MAX_S


def test_the_clock_is_the_argument():
    """The same state decides differently only by ``now``: waited for, then not."""
    late = view(computing_on=4)
    assert decide(late, Mode(1), BASE.step_end + 1.0).action is WAIT
    assert decide(late, Mode(1), BASE.step_end + PATIENCE_S + 0.5).action is TAKE


@pytest.mark.parametrize("steps, every, accumulated, out, due", [
    (4, 4, 0, False, True), (5, 4, 0, False, True), (3, 4, 0, False, False),
    (4, 4, 8, False, False), (4, 4, 0, True, False),
])
def test_pseudo_gradient_due(steps, every, accumulated, out, due):
    assert pseudo_gradient_due(steps=steps, every=every, accumulated=accumulated, out=out) is due


# Rounds by time (sync_every a window or auto): due once the window since our last contribution
# (``since``) has passed and at least one inner step was taken; never while ours is accumulated or out.
@pytest.mark.parametrize("steps, since, accumulated, out, due", [
    (1, NOW - 2.0, 0, False, True),  # the window just passed, one step in it: a slow member's
    (40, NOW - 2.5, 0, False, True),  # a fast member's many steps
    (40, NOW - 1.9, 0, False, False),  # not yet: however many steps (a count plays no part)
    (0, NOW - 9.0, 0, False, False),  # no inner step since: nothing to contribute
    (5, NOW - 3.0, 8, False, False), (5, NOW - 3.0, 0, True, False),  # ours not taken, or still out
])
def test_pseudo_gradient_by_time_is_due_once_the_window_has_passed(steps, since, accumulated, out, due):
    assert pseudo_gradient_due(steps=steps, every=None, accumulated=accumulated, out=out, window_s=2.0,
                               since=since, now=NOW) is due


# A window ends at the step whose end is nearest to it: a slow member's step that ends less than
# half a step before the window's end is its last (the next would overshoot by more).
@pytest.mark.parametrize("since, step_s, due", [
    (NOW - 1.8, 0.6, True),  # 0.2 s before the end; the next step would end 0.4 s past it
    (NOW - 1.6, 0.6, False),  # 0.4 s before; the next would end 0.2 s past: that one is nearer
    (NOW - 1.997, 0.01, True), (NOW - 1.993, 0.01, False),  # a fast member's: within half its step
])
def test_pseudo_gradient_by_time_is_due_at_the_step_whose_end_is_nearest_the_windows(since, step_s, due):
    assert pseudo_gradient_due(steps=3, every=None, accumulated=0, out=False, window_s=2.0, since=since, now=NOW,
                               step_s=step_s) is due
