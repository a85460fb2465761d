"""``p2ptrain.cluster.sleepwatch``: a machine's sleep told from its two clocks."""

from p2ptrain.cluster.sleepwatch import SleepWatch


def test_a_wall_clock_ahead_of_the_monotonic_one_past_the_least_is_a_sleep():
    watch = SleepWatch(least=5.0)
    assert watch.slept(100.0, 1000.0) == 0.0  # (the first call: nothing to compare with)
    assert watch.slept(100.1, 1000.1) == 0.0  # a tick
    assert abs(watch.slept(100.2, 1015.2) - 15.0) < 1e-9  # suspended 15 s: the monotonic clock stood still
    assert watch.slept(100.3, 1015.3) == 0.0  # once only


def test_a_gap_in_both_clocks_small_steps_and_a_clock_set_back_are_no_sleep():
    watch = SleepWatch(least=5.0)
    watch.slept(0.0, 50.0)
    assert watch.slept(20.0, 70.0) == 0.0  # SIGSTOP: both clocks ran (the round machine sees that gap)
    assert watch.slept(20.1, 73.1) == 0.0  # NTP stepped 3 s forward: under the least
    assert watch.slept(20.2, 10.0) == 0.0  # set back
