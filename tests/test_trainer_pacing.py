"""The staleness pacing rule (``trainer.pacing``): when ``step`` waits, from the measured means."""

from __future__ import annotations

import pytest

from p2ptrain.trainer.pacing import OVERLAP_MIN, Pacing, must_wait, share


def wait(**kw) -> bool:
    args = dict(staleness=1, local_steps=False, finished=False, held=0, out=False, share=32, lockstep=False)
    return must_wait(**{**args, **kw})


def test_share_is_the_target_over_the_members_in_whole_batches():
    assert share(None, 2, 16) == 16  # DDP's global batch, by default
    assert share(128, 2, 16) == 64
    assert share(100, 2, 16) == 48  # whole batches, rounded down
    assert share(8, 4, 16) == 16  # at least one batch
    assert share(None, 0, 16) == 16  # (no members known yet: one)


def test_staleness_0_waits_while_its_batch_is_held_or_out():
    assert wait(staleness=0, held=16)
    assert wait(staleness=0, out=True)
    assert not wait(staleness=0)


def test_staleness_1_waits_only_with_its_share_held_or_in_lockstep():
    assert not wait(held=16)
    assert wait(held=32)
    assert wait(held=16, lockstep=True)
    assert wait(out=True, lockstep=True)
    assert not wait(lockstep=True)  # nothing of ours in a round: compute on


def test_local_steps_wait_at_staleness_0_only():
    assert wait(local_steps=True, staleness=0, held=8)
    assert not wait(local_steps=True, staleness=1, held=8, lockstep=True)


def test_a_finished_run_never_waits():
    assert not wait(staleness=0, held=16, finished=True)


def test_lockstep_needs_a_ring_measured_quicker_than_overlap_min_of_a_batch():
    p = Pacing()
    assert not p.lockstep()  # no ring seen yet
    for _ in range(100):
        p.computed(1.0)
    assert p.compute_mean == pytest.approx(1.0, rel=1e-4)
    p.ring_took(OVERLAP_MIN * 1.2)
    assert not p.lockstep()
    for _ in range(100):
        p.ring_took(OVERLAP_MIN * 0.5)
    assert p.lockstep()
