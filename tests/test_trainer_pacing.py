"""The staleness pacing rule (``trainer.pacing``): when ``step`` waits, from the measured means."""

from __future__ import annotations

import pytest

from p2ptrain.trainer.pacing import (COMPUTE_WEIGHT, HELD_FIRST, HELD_ROUNDS, LOCKSTEP_PERIODS, REALIZED_ROUNDS,
                                     RETRY_AFTER, RETRY_MAX, Pacing, must_wait, share)


def wait(**kw) -> bool:
    args = dict(staleness=1, local_steps=False, finished=False, accumulated=0, out=False, share=32, lockstep=False)
    return must_wait(**{**args, **kw})


def test_share_is_the_target_over_the_members_in_whole_batches():
    assert share(None, 2, 16) == 16  # DDP's global batch, by default
    assert share(128, 2, 16) == 64
    assert share(100, 2, 16) == 48  # whole batches, rounded down
    assert share(8, 4, 16) == 16  # at least one batch
    assert share(None, 0, 16) == 16  # (no members known yet: one)


def test_staleness_0_waits_while_its_batch_is_held_or_out():
    assert wait(staleness=0, accumulated=16)
    assert wait(staleness=0, out=True)
    assert not wait(staleness=0)


def test_staleness_1_waits_only_with_its_share_held_or_in_lockstep():
    assert not wait(accumulated=16)
    assert wait(accumulated=32)
    assert wait(accumulated=16, lockstep=True)
    assert wait(out=True, lockstep=True)
    assert not wait(lockstep=True)  # nothing of ours in a round: compute on


def formed(p: Pacing, members: int = 2) -> None:
    """The first round of a cluster of ``members`` (not timed: every member began its batch together)."""
    p.round_committed(0.0, 0.0, 0.0, members)
    assert p.others_due(0.0) is None


def test_the_first_round_of_a_cluster_formed_or_changed_is_not_timed():
    """A first batch says little of a member's pace: a slower member's first READY that came with
    ours, timed, would keep the faster ones from adding a batch for ``HELD_ROUNDS`` rounds (the
    earliest is trusted). The first round of a cluster (or after a peer joined or left) is skipped,
    and a change of members forgets what was timed (who is slower may have changed)."""
    p = Pacing(compute_mean=0.1)
    p.round_committed(1.0, 1.0, 0.0, 2)  # (formed: the slower member's first READY with ours)
    for t in (2.0, 3.0):
        p.round_committed(t, t, 0.3, 2)
    assert p.others_due(4.0) == pytest.approx(4.3) and p.fits(4.0, 4.0)
    p.round_committed(5.0, 5.0, 0.0, 3)  # (a peer joined: its first round, not timed, and the rest forgotten)
    assert p.others_due(6.0) is None
    for t in (6.0, 7.0):
        p.round_committed(t, t, 0.5, 3)
    assert p.others_due(8.0) == pytest.approx(8.5)


def test_beside_a_slower_member_a_member_computes_the_batches_that_end_before_its_ready():
    """Gradient mode at staleness >= 1: the others' READYs are timed from the moment our batches
    reached our share; while another batch of ours ends before the earliest of the last rounds'
    (by ``HELD_MIN_S``), ours is held and ``step`` computes on, on the same parameters."""
    p = Pacing(compute_mean=0.1)
    t = 100.0
    formed(p)
    for _ in range(HELD_ROUNDS):  # a member 3.7x slower: its READY 0.28 s after our share (ours sent then)
        t += 0.45
        p.round_committed(t, t, 0.28, 2)
        assert p.fits(t, t) == (_ >= HELD_FIRST - 1)  # (too few rounds timed: DDP's global batch)
    assert p.others_due(t) == pytest.approx(t + 0.28)
    assert p.fits(t, t) and p.fits(t + 0.1, t) and not p.fits(t + 0.2, t)  # two batches end before it
    assert p.others_due(None) is None and not p.fits(t, None)  # (our share not reached)
    # ours held two batches more, the last READY: the others' still came 0.28 s after our share
    p.round_committed(t + 0.2, t, -0.02, 2)
    assert p.others_due(t + 1) == pytest.approx(t + 1.18)
    p.round_committed(t + 0.2, t, -0.1, 2)  # (a round in which theirs came sooner: the earliest is trusted)
    assert p.others_due(t + 1) == pytest.approx(t + 1.1)
    # members alike: each READY about when ours is, whatever delayed both (a loaded host); nothing fits
    q = Pacing(compute_mean=0.1)
    formed(q)
    for i in range(2 * HELD_ROUNDS):
        after = 0.015 if i % 2 == 0 else -0.015  # (the other's READY 15 ms after ours, or before, in turn)
        q.round_committed(i + 0.3, i + 0.3, after, 2)
        assert not q.fits(i + 1.0, i + 1.0)
    q = Pacing(compute_mean=0.01)  # (batches of 10 ms: the other 15 ms later in every round still adds none)
    formed(q)
    for i in range(HELD_ROUNDS):
        q.round_committed(i + 0.04, i + 0.04, 0.015, 2)
        assert not q.fits(i + 1.0, i + 1.0)
    r = Pacing(compute_mean=0.1)  # (a leader that says no offsets: nothing timed)
    formed(r)
    for i in range(HELD_ROUNDS):
        r.round_committed(i + 0.4, i + 0.1, None, 2)
        assert r.others_due(i + 1.0) is None
    assert not Pacing(compute_mean=0.0).fits(0.0, 0.0)  # (nothing timed)
    # step: computes on while another batch fits and ours is not out, whatever it holds
    assert not wait(accumulated=32, lockstep=True, more=True)
    assert not wait(accumulated=96, more=True)  # (the share's bound is TrainerState.more's)
    assert wait(accumulated=32, lockstep=True, out=True, more=True)  # (ours out: as before)
    assert wait(accumulated=32, lockstep=True)


def test_once_a_batch_is_added_the_round_takes_any_that_begins_before_the_slower_ready():
    """Beside a member 3.7x slower: the first batch added ends before its READY; after it, one
    that begins before the READY is added too (the round waits up to a batch for ours), so the
    faster member never idles through the part of the slower step no whole batch fits in."""
    p = Pacing(compute_mean=0.1)
    t = 100.0
    formed(p)
    for _ in range(HELD_FIRST):  # (ours the last READY, 25 ms after the slower one, 0.3 s after our share)
        t += 0.45
        p.round_committed(t, t - 0.3, -0.025, 2)
    assert p.others_due(t) == pytest.approx(t + 0.275)
    assert p.fits(t, t) and p.fits(t + 0.15, t) and not p.fits(t + 0.2, t)  # the first added ends before it
    assert p.fits(t + 0.2, t, added=True) and p.fits(t + 0.26, t, added=True)  # later ones begin before it
    assert not p.fits(t + 0.27, t, added=True)  # (within HELD_MIN_S of it: the round would wait a whole batch)


def test_local_steps_wait_at_staleness_0_or_where_the_cores_are_short():
    assert wait(local_steps=True, staleness=0, accumulated=8)
    assert not wait(local_steps=True, staleness=1, accumulated=8, lockstep=True)
    assert wait(local_steps=True, staleness=1, out=True, cores_short=True)  # (waits for its outer update)
    assert wait(local_steps=True, staleness=1, accumulated=8, cores_short=True)
    assert not wait(local_steps=True, staleness=1, out=True)  # (steps on while the ring runs)
    assert not wait(local_steps=True, staleness=1, cores_short=True)  # (nothing of ours in a round: step on)


def test_cores_are_short_once_the_threads_wait_for_a_cpu_over_30_percent_of_the_time():
    p = Pacing()
    p.cpu_sampled(None)  # (no schedstat here: nothing known, never short)
    assert not p.cores_short()
    p.cpu_sampled((10.0, 1.0))  # (the first sample, at the first contribution: where the shares start from)
    assert p.queued_mean is None and p.cores_short()  # (until a share is measured: staleness 0's schedule)
    ran, queued = 10.0, 1.0
    for _ in range(3):  # a round: 1 s run, 0.1 s waited (a core to itself, nearly)
        ran, queued = ran + 1.0, queued + 0.1
        p.cpu_sampled((ran, queued))
        assert not p.cores_short()  # (a first share that low is trusted alone)
    assert p.queued_mean == pytest.approx(0.1 / 1.1) and not p.cores_short()
    for _ in range(5):  # then 1 s waited a second run (four peers on two cores: about half)
        ran, queued = ran + 1.0, queued + 1.0
        p.cpu_sampled((ran, queued))
    assert p.cores_short()
    for _ in range(10):  # and back
        ran, queued = ran + 1.0, queued + 0.05
        p.cpu_sampled((ran, queued))
    assert not p.cores_short()
    p.cpu_sampled((ran, queued))  # (no time passed: the mean stays)
    assert not p.cores_short()


def test_one_low_first_share_does_not_make_a_peer_step_on():
    """While every peer waits for the outer update, the last to finish its steps has the cores to
    itself for a while: its first share can be low. The mean starts from the larger of two."""
    p = Pacing()
    p.cpu_sampled((0.0, 0.0))
    p.cpu_sampled((0.85, 0.15))  # (15 %: the peer that stepped last, alone)
    assert p.cores_short()
    p.cpu_sampled((1.35, 0.65))  # (then half, as four peers on two cores wait)
    assert p.queued_mean == pytest.approx(0.5) and p.cores_short()
    q = Pacing()  # (two low shares: spare, from the second on)
    for times in ((0.0, 0.0), (0.85, 0.15), (1.65, 0.35)):
        q.cpu_sampled(times)
        assert q.cores_short() == (times[0] < 1.0)


def test_the_process_reads_how_long_its_threads_ran_and_waited_for_a_cpu():
    import os
    import sys

    from p2ptrain.trainer.cpu_queue import cpu_times

    times = cpu_times()
    if not sys.platform.startswith("linux"):
        assert times is None
        return
    sum(i * i for i in range(200_000))  # (some running, so the count grows)
    later = cpu_times()
    assert times[0] > 0 and times[1] >= 0 and later[0] > times[0] and later[1] >= times[1]
    assert cpu_times(os.getpid())[0] >= later[0]
    assert cpu_times(2 ** 22 + 1) is None  # (no such process)


def test_a_finished_run_never_waits():
    assert not wait(staleness=0, accumulated=16, finished=True)


def timed(compute: float, ring: float, predicted: bool = False) -> Pacing:
    """Means of a run that went in lockstep long enough to measure its period (compute + ring)."""
    p = Pacing(predicted=predicted)
    for _ in range(200):
        p.computed(compute)
        p.ring_took(ring)
        p.stepped(compute + ring, lockstep=True)
    return p


def test_a_batch_s_mean_compute_starts_from_the_second_batch():
    """The first batch (kernels compiled) is left out and the second starts the mean, so a slow
    member's mean is its step from the start (one from zero reached 1.5 s after some twenty
    batches, and meanwhile overlap looked as if it paid)."""
    p = Pacing()
    p.computed(4.0)  # (the first: warming up)
    assert p.compute_mean == 0.0
    p.computed(1.5)
    assert p.compute_mean == 1.5
    p.computed(2.5)
    assert p.compute_mean == pytest.approx(1.5 + COMPUTE_WEIGHT * 1.0)
    assert p.lockstep(2)  # (a ring untimed: as at staleness 0)
    p.ring_took(0.3)
    assert p.overlap_gain() == pytest.approx((1.6 + 0.3) / 1.6) and p.lockstep(2)


def test_nothing_timed_yet_waits_among_others_and_overlaps_alone():
    """A member's first round times the ring: until then it goes as at staleness 0, so that no
    batch comes an update late before the rule knows overlap pays. A peer alone has no ring
    of others to wait for."""
    assert Pacing().lockstep(members=2) and Pacing().lockstep(members=4)
    assert not Pacing().lockstep(members=1)
    assert not timed(1.0, 0.5, predicted=True).lockstep(members=2)  # (timed: where overlap pays)


@pytest.mark.parametrize("compute, ring", [(1.0, 0.1), (1.0, 0.45), (1.0, 0.7), (0.7, 1.0), (0.1, 1.0)])
def test_without_prediction_overlap_never_pays_for_the_delay(compute, ring):
    """Overlap gains (c + r) / max(c, r) < 2 unless r == c exactly, and a gradient one update
    late costs about 2x the updates (on loopback before: ring 70 ms against a 100 ms batch
    overlapped, gained 1.34x samples/s and needed 1.7x the samples to the loss)."""
    p = timed(compute, ring)
    assert p.overlap_gain() == pytest.approx((compute + ring) / max(compute, ring), rel=1e-3)
    assert p.lockstep(members=2)


@pytest.mark.parametrize("compute, ring, lockstep", [(1.0, 0.1, True), (1.0, 0.5, False), (0.5, 1.0, False),
                                                     (0.1, 1.0, True), (1.0, 0.2, True)])
def test_with_prediction_overlap_pays_where_it_hides_a_quarter_or_more(compute, ring, lockstep):
    assert timed(compute, ring, predicted=True).lockstep(members=2) is lockstep


def test_overlap_is_tried_only_once_lockstep_s_period_is_measured():
    """The realized gain needs lockstep's period to compare with: a member goes in lockstep
    for ``LOCKSTEP_PERIODS`` batches before it first overlaps, even where the model says it pays."""
    p = Pacing(predicted=True, compute_mean=1.0, round_mean=0.5)
    for _ in range(LOCKSTEP_PERIODS - 1):
        assert p.lockstep(members=2)
        p.stepped(1.5, lockstep=True)
    p.stepped(1.5, lockstep=True)
    assert not p.lockstep(members=2)


def overlapped(p: Pacing, period: float, rounds: int) -> None:
    for _ in range(rounds):
        p.stepped(period, lockstep=False)


def test_overlap_that_realizes_less_than_the_delay_costs_goes_back_to_lockstep():
    """The modelled gain (c + r) / max(c, r) leaves out step's own work. Measured on 2 cores
    with weight prediction, the host idle during compute: a modelled 1.5-1.8 realized about
    1.06 (a batch every 19.8 ms against 21 in lockstep), and the stale updates cost 17-19 %
    more rounds. Once ``REALIZED_ROUNDS`` periods say so, the member goes as at staleness 0."""
    p = timed(1.0, 0.5, predicted=True)
    assert not p.lockstep(members=2)  # (the model: 1.5x, above 1.25)
    overlapped(p, period=1.4, rounds=REALIZED_ROUNDS - 1)
    assert p.realized_gain() is None and not p.lockstep(members=2)  # (too few periods to overrule it)
    overlapped(p, period=9.0, rounds=1)  # (one odd period: the median is not moved by it)
    assert p.realized_gain() == pytest.approx(1.5 / 1.4)
    assert p.lockstep(members=2) and p.refuted
    overlapped(p, period=0.5, rounds=RETRY_AFTER - 1)  # (no figure turns it back before the retry)
    assert p.lockstep(members=2)


def in_lockstep(p: Pacing, period: float, batches: int) -> None:
    for _ in range(batches):
        assert p.lockstep(members=2)
        p.stepped(period, lockstep=True)


def test_refuted_overlap_is_measured_again_later_and_each_refutation_in_a_row_waits_twice_as_long():
    """A regime can change (a peer joins, a GPU's first steps end): after ``RETRY_AFTER`` batches
    in lockstep a member overlaps again and measures anew, from overlap's first period (the
    ones before the refutation are dropped); refuted again it waits twice as long, up to
    ``RETRY_MAX``; where the retry pays it goes on overlapping."""
    p = timed(1.0, 0.5, predicted=True)  # (lockstep's period measured: 1.5)
    waits = []
    for _ in range(8):  # refuted each time: overlap realizes 1.5 / 1.4
        overlapped(p, period=1.4, rounds=REALIZED_ROUNDS)
        assert p.lockstep(members=2) and p.refuted
        batches = 0
        while p.refuted and batches <= RETRY_MAX:  # (bounded: before, it never came back)
            in_lockstep(p, 1.5, 1)
            batches += 1
        waits.append(batches)
        assert not p.lockstep(members=2) and p.realized_gain() is None  # (overlap measured anew)
    assert waits == [min(RETRY_AFTER << i, RETRY_MAX) for i in range(8)]
    overlapped(p, period=1.05, rounds=REALIZED_ROUNDS)  # the regime changed: now overlap pays
    assert p.realized_gain() == pytest.approx(1.5 / 1.05)
    assert not p.lockstep(members=2) and not p.refuted
    overlapped(p, period=1.4, rounds=REALIZED_ROUNDS)  # and later it does not: the shortest wait again
    assert p.lockstep(members=2) and p._retry_in == RETRY_AFTER


def test_overlap_that_realizes_its_gain_goes_on():
    p = timed(1.0, 0.9, predicted=True)
    overlapped(p, period=1.05, rounds=3 * REALIZED_ROUNDS)
    assert p.realized_gain() == pytest.approx(1.9 / 1.05)
    assert not p.lockstep(members=2) and not p.refuted


def test_a_period_runs_from_one_steps_start_to_the_next_and_counts_as_the_first_ones_kind():
    p = Pacing()
    p.step_began(10.0, lockstep=True)
    p.step_began(10.5, lockstep=False)  # (0.5 s in lockstep)
    p.step_began(None)  # (a step that measures none: the next one starts anew)
    p.step_began(20.0, lockstep=False)
    p.step_began(20.25, lockstep=False)  # (0.25 s overlapping)
    assert list(p._periods[True]) == [0.5] and list(p._periods[False]) == [0.25]


def test_alone_a_member_overlaps_without_a_measured_period():
    p = Pacing(predicted=True, compute_mean=1.0, round_mean=0.5)
    assert not p.lockstep(members=1)


def test_the_state_marks_when_its_batches_reached_the_share_and_times_the_others_from_it():
    """``TrainerState.add_batch`` marks the batch that brings the accumulator to the share
    (``share_at``), not one added beyond it; the mark goes out with the contribution, the next
    contribution marks its own, and the commit times the others' READY from it: ours taken at
    ``taken_at``, theirs ``others_after`` later, so ``taken_at + others_after - share_at``."""
    import torch

    from p2ptrain.cluster.rounds import SyncPoint
    from p2ptrain.trainer.state import TrainerState
    params = [torch.zeros(4, requires_grad=True)]
    st = TrainerState(params, torch.device("cpu"), staleness=1, min_peers=2, target_batch_size=None,
                      members=lambda: 2)

    def batch(at: float) -> None:
        params[0].grad = torch.ones(4)
        with st.params_lock, st.lock:
            st.add_batch(32, at, keep=False)

    batch(10.0)
    assert st.share_at == 10.0  # (the share: DDP's global batch over two members, one batch of 32)
    batch(10.1)
    assert st.share_at == 10.0  # (a batch added beyond it)
    with st.lock:
        out = st.take_contribution(2)
    assert out.share_at == 10.0 and st.share_at is None and out.samples == 64
    batch(11.0)
    assert st.share_at == 11.0  # (the next contribution's own)
    st.acc.to_host(out)
    st.pacing.round_committed(0.0, 0.0, 0.0, 2)  # (the cluster's first round, not timed: ``formed``)
    with st.lock:
        assert st.update_committed(out.array, 96, SyncPoint(1, b"x" * 16, 0, 0), 0.01, False, 12.0,
                                   others_after=0.25)
    assert list(st.pacing._others) == [pytest.approx(out.taken_at + 0.25 - 10.0)]


def test_a_member_whose_rounds_come_at_a_slower_members_pace_says_so_once_with_what_to_do():
    """Gradient mode beside a slower member: rounds holding ``PACE_BATCHES`` of our batches or more,
    ``PACE_ROUNDS`` in a row, get one line naming the pace and local steps by time; a round of
    fewer starts the count anew, and once said it is not said again."""
    from p2ptrain.trainer.pacing import PACE_BATCHES, PACE_ROUNDS
    p = Pacing(compute_mean=0.12)
    assert all(p.paced(PACE_BATCHES, 1.3 * i) is None for i in range(PACE_ROUNDS))
    assert p.paced(PACE_BATCHES - 1, 20.0) is None  # (a round of fewer: the count starts anew)
    lines = [p.paced(11, 30.0 + 1.3 * i) for i in range(PACE_ROUNDS + 1)]
    assert lines[:-1] == [None] * PACE_ROUNDS and "--sync-every auto" in lines[-1], lines
    assert "11 of our batches a round (one each 0.12 s), a round every 1.3 s" in lines[-1]
    assert all(p.paced(11, 50.0 + i) is None for i in range(3 * PACE_ROUNDS))  # (said once)
    q = Pacing(compute_mean=0.12)  # members alike: one batch a round, never said
    assert all(q.paced(1, i) is None for i in range(4 * PACE_ROUNDS))


def test_the_state_says_once_when_its_rounds_hold_many_of_its_batches(caplog):
    """``TrainerState.update_committed`` feeds each committed round's count of our batches to
    ``Pacing.paced`` in gradient mode with others in the round, and logs its line once; not where
    ``target_batch_size`` makes those batches the share itself (no slower member added them)."""
    import torch

    from p2ptrain.cluster.rounds import SyncPoint
    from p2ptrain.trainer.pacing import PACE_BATCHES, PACE_ROUNDS
    from p2ptrain.trainer.state import TrainerState
    caplog.set_level("WARNING", logger="p2ptrain")

    def lines_said(target_batch_size: int | None) -> list[str]:
        caplog.clear()
        params = [torch.zeros(4, requires_grad=True)]
        st = TrainerState(params, torch.device("cpu"), staleness=1, min_peers=2, target_batch_size=target_batch_size,
                          members=lambda: 2)
        for r in range(PACE_ROUNDS + 3):
            for _ in range(PACE_BATCHES):
                params[0].grad = torch.ones(4)
                with st.params_lock, st.lock:
                    st.add_batch(32, float(r), keep=False)
            with st.lock:
                out = st.take_contribution(2)
            st.acc.to_host(out)
            with st.lock:
                st.update_committed(out.array, 2 * 32 * PACE_BATCHES, SyncPoint(r + 1, b"x" * 16, 0, 0), 0.01,
                                    False, float(r) + 0.5)
        return [r.getMessage() for r in caplog.records if "slower member's pace" in r.getMessage()]

    lines = lines_said(None)
    assert len(lines) == 1 and f"{PACE_BATCHES} of our batches a round" in lines[0], lines
    assert lines_said(2 * 32 * PACE_BATCHES) == []
