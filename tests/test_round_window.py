"""Rounds by time: auto's window (``round_window.auto_window``), pure, and the pacing rule that
a member with rounds by time steps on where the cores are short (``pacing.must_wait``)."""

import pytest

from p2ptrain.trainer.pacing import must_wait
from p2ptrain.trainer.round_window import AUTO_FIRST_S, AUTO_MAX_S, AUTO_MIN_S, auto_window

pytestmark = pytest.mark.timeout(10)


@pytest.mark.parametrize("previous, ring, compute, window", [
    (None, None, 0.1, AUTO_FIRST_S),  # no ring timed yet
    (None, None, 1.1, 4.4),  # ... but never under four of this member's steps (a 10x slower laptop)
    (None, 0.5, 0.1, 5.0),  # ten rings
    (None, 0.01, 0.01, AUTO_MIN_S),  # a fast ring: the floor
    (None, 0.2, 0.8, 3.2),  # a slow member: four of its steps
    (None, 50.0, 0.1, AUTO_MAX_S),  # a very slow ring: the ceiling
    (2.0, 5.0, 0.1, 4.0), (12.0, 0.01, 0.01, 6.0),  # at most x2 or /2 per contribution
    (2.0, 0.3, 0.1, 3.0),  # within x2: the target
])
def test_auto_window_is_ten_rings_at_least_four_steps_bounded_and_changes_at_most_twofold(
        previous, ring, compute, window):
    assert auto_window(previous, ring, compute) == pytest.approx(window)


@pytest.mark.parametrize("previous, ring, compute, window", [
    (None, None, 1.1, AUTO_FIRST_S),  # a 10x slower laptop's four steps do not lengthen it
    (None, 0.2, 0.8, AUTO_MIN_S), (None, 0.5, 0.8, 5.0), (2.0, 5.0, 0.8, 4.0),  # the rings and the bounds still do
])
def test_auto_window_where_the_members_wait_at_its_end_is_not_lengthened_by_a_slow_members_steps(
        previous, ring, compute, window):
    """Waited for at each window's end (three members or more), a slow member's longer window would
    idle every other member for the difference each round."""
    assert auto_window(previous, ring, compute, waits=True) == pytest.approx(window)


def test_auto_window_settles_on_its_target_from_any_start():
    w = None
    for _ in range(10):
        w = auto_window(w, 2.0, 0.1)
    assert w == pytest.approx(20.0)


@pytest.mark.parametrize("by_time, waits", [(False, True), (True, False)])
def test_short_cores_make_a_count_member_wait_for_its_round_but_not_one_with_rounds_by_time(by_time, waits):
    assert must_wait(staleness=1, local_steps=True, finished=False, accumulated=0, out=True, share=64,
                     lockstep=False, cores_short=True, by_time=by_time) is waits
    # (at staleness 0 both wait for the round holding their pseudo-gradient)
    assert must_wait(staleness=0, local_steps=True, finished=False, accumulated=0, out=True, share=64,
                     lockstep=False, cores_short=False, by_time=by_time)


@pytest.mark.parametrize("sync_every, expected", [
    (16, (0.7, 0.9)), ("16", (0.7, 0.9)),  # a count: DiLoCo's
    ("2s", (0.8, 0.6)), ("auto", (0.8, 0.6)),  # rounds by time: many short rounds, each a round late
])
def test_outer_defaults_by_count_and_by_time_and_what_is_given_wins(sync_every, expected):
    from p2ptrain.trainer.options import local_steps_defaults
    assert local_steps_defaults(None, None, sync_every) == expected
    assert local_steps_defaults(0.5, 0.0, sync_every) == (0.5, 0.0)


def test_a_ring_held_up_by_a_fault_does_not_stretch_autos_window():
    """A silent member holds a ring 5-10 s before it is left out: the exchange did not get slower
    (auto reads the median of the view's rings, ``RoundMachine.exchange_seconds``)."""
    from p2ptrain.cluster.membership import RoundTimer
    timer, w = RoundTimer(), None
    assert timer.median() is None
    for seconds in [0.05] * 8 + [9.6] + [0.05] * 3 + [5.1, 0.05, 0.05]:
        timer.record(seconds)
        w = auto_window(w, timer.median(), 0.001)
        assert w == AUTO_MIN_S
    for _ in range(20):  # a link that stays slower is the exchange: the window follows it
        timer.record(0.5)
        w = auto_window(w, timer.median(), 0.001)
    assert w == pytest.approx(5.0)


@pytest.mark.parametrize("members, min_peers, auto, waits", [
    (2, 1, True, False),  # two step on through the exchange (staleness 1 won there)
    (3, 1, True, True), (4, 1, True, True),  # three or more wait at a window's end, as at staleness 0
    (2, 3, True, True),  # (no round runs with fewer than min_peers)
    (4, 1, False, False),  # a window the user gave keeps the staleness the user gave
])
def test_auto_with_three_or_more_members_waits_for_its_round_at_a_windows_end(members, min_peers, auto, waits):
    import torch

    from p2ptrain.trainer.local_steps import LocalSteps
    from p2ptrain.trainer.state import TrainerState
    params = [torch.zeros(4, requires_grad=True)]
    local = LocalSteps(params, None, 0.8, 0.6, window_s=2.0, auto=auto)
    st = TrainerState(params, torch.device("cpu"), staleness=1, min_peers=min_peers, target_batch_size=None,
                      members=lambda: members, local=local)
    assert not st.must_wait()  # nothing of ours is out
    st.out = object()  # our pseudo-gradient is in a round
    assert st.must_wait() is waits


def test_the_time_a_member_waits_for_its_round_is_not_counted_in_its_next_window(monkeypatch):
    """A member that waits at its window's end for its round (``auto`` from three members on, or
    staleness 0) computes a whole window after the commit: its window begins as the step that
    contributed returns. Counted from the contribution, the wait took from each next window,
    and beside a slower member the waits grew until they filled it."""
    import torch

    from p2ptrain.trainer import state as state_module
    from p2ptrain.trainer.contribution_decision import pseudo_gradient_due
    from p2ptrain.trainer.local_steps import LocalSteps
    from p2ptrain.trainer.state import TrainerState
    clock = [100.0]
    monkeypatch.setattr(state_module.time, "perf_counter", lambda: clock[0])
    params = [torch.zeros(4, requires_grad=True)]
    local = LocalSteps(params, None, 0.8, 0.6, window_s=2.0)
    st = TrainerState(params, torch.device("cpu"), staleness=0, min_peers=1, target_batch_size=None,
                      members=lambda: 4, local=local)
    with torch.no_grad():
        params[0].add_(1.0)  # (an inner step)
    local.stepped(8)
    with st.params_lock, st.lock:
        assert st.add_pseudo_gradient()  # the window's end: our contribution at 100 s
    clock[0] = 101.5  # the step waits 1.5 s for the slower members and the commit
    st.step_ended()

    def due(now: float) -> bool:
        return pseudo_gradient_due(steps=1, every=None, accumulated=0, out=False, window_s=2.0, since=st.window_began,
                                   now=now)

    assert not due(103.4)  # 1.9 s of computing: not yet, though 3.4 s passed since the contribution
    assert due(103.5)
