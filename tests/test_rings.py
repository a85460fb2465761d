"""Rings: a round's ring leaves its sum in the round's record; commit hands it over, cancel forgets it."""

import asyncio

import numpy as np
import pytest

from p2ptrain.cluster.rings import Round, Rings
from p2ptrain.codecs import parse_codec
from p2ptrain.taskset import TaskSet

pytestmark = pytest.mark.timeout(10)


def rings_alone(done):
    return Rings("a", mesh=None, codec=parse_codec("none"), timeout=1.0, tasks=TaskSet(),
                 on_done=lambda r, ok, checksum, withdrawn: done.append((r, ok)))


async def test_a_ring_alone_leaves_its_sum_in_the_round_and_commit_hands_it_over():
    done = []
    rings = rings_alone(done)
    vector = np.arange(4, dtype=np.float32)
    rnd = Round(3, taken=(vector, 2))
    rings.start(rnd, ("a",))
    await rnd.ring
    assert done == [(3, True)] and rnd.ring is None and rnd.summed is vector and rnd.samples == 2
    assert rings.commit(rnd, total=2) is vector and rnd.summed is None
    assert rings.commit(rnd, total=2) is None  # (handed over once)


async def test_cancel_stops_the_ring_and_forgets_what_it_left():
    rings = rings_alone([])
    rnd = Round(4, taken=(np.ones(4, np.float32), 1), summed=np.ones(4, np.float32))
    rnd.ring = ring = asyncio.get_running_loop().create_task(asyncio.sleep(60))
    rings.cancel(rnd)
    with pytest.raises(asyncio.CancelledError):
        await ring
    assert rnd.ring is None and rnd.summed is None and rnd.stats is None
    assert rnd.taken is not None  # (the contribution is the cluster's to put back)
