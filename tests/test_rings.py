"""Rings: a round's ring leaves its sum in the round's record; commit hands it over, cancel forgets it; what a lossy ring dropped is owed to the next."""

import asyncio

import numpy as np
import pytest

from test_allreduce import meshes

from p2ptrain.cluster.rings import Round, Rings
from p2ptrain.codecs import parse_codec
from p2ptrain.collective.linkpace import LinkPace
from p2ptrain.taskset import TaskSet

pytestmark = pytest.mark.timeout(10)


def rings_alone(done):
    return Rings("a", mesh=None, codec=parse_codec("none"), timeout=1.0, tasks=TaskSet(),
                 on_done=lambda r, ok, checksum, void: done.append((r, ok)))


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


async def test_a_lossy_ring_whose_chunks_all_went_exact_owes_nothing_and_one_that_encoded_owes_what_it_dropped(monkeypatch):
    ids, ms = await meshes(2)
    rings = [Rings(m.peer_id, mesh=m, codec=parse_codec("int8"), timeout=5.0, tasks=TaskSet(),
                   on_done=lambda *a: None) for m in ms]
    rng = np.random.default_rng(1)
    try:
        for r, raw in ((1, True), (2, False), (3, True)):
            monkeypatch.setattr(LinkPace, "send_raw", lambda self, *args, raw=raw: raw)
            vectors = [rng.standard_normal(300_000).astype(np.float32) for _ in rings]
            owed = [x.residual if x.residual is not None else np.zeros_like(v) for x, v in zip(rings, vectors)]
            rounds = [Round(r, taken=(v, 1)) for v in vectors]
            for x, rnd in zip(rings, rounds):
                x.start(rnd, tuple(ids))
            await asyncio.gather(*[rnd.ring for rnd in rounds])
            sums = [x.commit(rnd, total=2) for x, rnd in zip(rings, rounds)]
            assert np.array_equal(sums[0], sums[1])
            if raw:  # exact: the sum itself, nothing owed afterwards
                assert np.array_equal(sums[0], (vectors[0] + owed[0]) + (vectors[1] + owed[1]))
                assert all(x.residual is None for x in rings)
            else:  # what int8 dropped is owed to the next round
                assert all(x.residual is not None for x in rings)
                left = sums[0] + rings[0].residual + rings[1].residual
                assert np.allclose(left, vectors[0] + vectors[1], atol=1e-5)
    finally:
        for m in ms:
            await m.close()


async def test_a_defect_in_the_ring_is_said_with_its_traceback_and_ends_the_round_at_once(monkeypatch, caplog):
    """A bug (here an AttributeError, as a link missing ``same_host`` raised) used to vanish into
    the task set: no line, and the round waited out its deadline on every member."""
    import p2ptrain.collective.allreduce as allreduce

    def broken(link):
        raise AttributeError("'ChunkChannel' object has no attribute 'same_host'")

    monkeypatch.setattr(allreduce, "pace_of", broken)
    ids, ms = await meshes(2)
    done = []
    rings = [Rings(m.peer_id, mesh=m, codec=parse_codec("int8"), timeout=60.0, tasks=TaskSet(),
                   on_done=lambda r, ok, checksum, void: done.append((r, ok))) for m in ms]
    try:
        rounds = [Round(5, taken=(np.ones(1000, np.float32), 1)) for _ in rings]
        for x, rnd in zip(rings, rounds):
            x.start(rnd, tuple(ids))
        await asyncio.wait_for(asyncio.gather(*[rnd.ring for rnd in rounds]), 5)
    finally:
        await asyncio.gather(*[m.close() for m in ms])
    assert done == [(5, False), (5, False)]
    failed = [rec for rec in caplog.records if "ring failed on an internal error" in rec.getMessage()]
    assert len(failed) == 2 and all("same_host" in str(rec.exc_info[1]) for rec in failed)
