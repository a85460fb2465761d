"""A peer alone applies each batch inside ``step`` and the cluster commits its rounds after
(``cluster``: SoloTrainer; ``leader``: solo): the same chain and records as rounds of one member,
checkpoints at their own version, the run's last round exactly, and a joiner that ends it."""

import asyncio

import pytest
import torch
import torch.nn.functional as F
from helpers import until

from p2ptrain.cluster.fingerprint import param_checksum
from p2ptrain.cluster.membership import History
from p2ptrain.trainer.peer import AsyncPeer

pytestmark = pytest.mark.timeout(60)


def made(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


async def train(peer, steps, seed=0):
    g = torch.Generator().manual_seed(seed)
    applied = []
    for _ in range(steps):
        x, y = torch.randn(5, 8, generator=g), torch.randint(0, 3, (5,), generator=g)
        F.cross_entropy(peer.model(x), y).backward()
        applied.append(await peer.step(batch_size=len(x)))
    return applied


def alone(**options):
    return AsyncPeer(*made(), listen="127.0.0.1:0", discovery=False, secret="s", **options)


async def with_a_partner_then_alone(a, updates, **options):
    """A second peer joins ``a``; both train to ``updates``; it leaves. Returns once ``a``,
    training on alone, has gone solo."""
    b = AsyncPeer(*made(), listen="127.0.0.1:0", discovery=False, secret="s",
                  peers=[f"127.0.0.1:{a.cluster.port}"], **options)
    async with b:
        await until(lambda: a.cluster.members == 2 and b.cluster.members == 2)

        async def both(peer, seed):
            while peer.version < updates:
                await train(peer, 1, seed)
        await asyncio.wait_for(asyncio.gather(both(a, 1), both(b, 2)), 30)
        assert a.cluster.rounds.last().members == 2 and not a.cluster.machine.solo
        owed = a.cluster.rings.residual
    for _ in range(200):  # b said goodbye: a trains on alone, soon without rounds
        await train(a, 1, seed=3)
        if a.cluster.machine.solo:
            return owed
        await asyncio.sleep(0.01)
    raise AssertionError("not solo after 200 steps alone")


async def test_a_peer_alone_applies_each_batch_in_step_and_its_rounds_are_those_of_one_member():
    async with alone() as peer:
        await until(lambda: peer.cluster.machine.solo)
        start = peer.cluster.machine.sync_point()
        assert await train(peer, 12) == [1] * 12 and peer.version == 12  # (applied before step returned)
        assert peer.metrics.version == 12 and peer.metrics.samples == 5
        await until(lambda: peer.cluster.machine.version == 12)  # committed within a tick
        records = peer.cluster.rounds.since(0)
        assert [r.samples for r in records] == [5] * 12 and [r.members for r in records] == [1] * 12
        digest = start.digest  # the chain: as rounds of this peer alone would make it
        for r in records:
            digest = History.next_digest(digest, r.round, (peer.peer_id,), r.samples)
        assert peer.cluster.machine.history.digest == digest
        assert [r.round for r in records] == list(range(start.round + 1, start.round + 13))
        state = peer.state_dict()
        assert state["version"] == state["sync"][0] == 12 and state["sync"][1] == digest.hex()


async def test_a_peer_alone_that_stood_still_trains_on():
    """A lid closed (or the process held up) while alone: there is no member who could have
    decided a round without us, so nothing is voided and the peer stays solo. Stepping down
    from solo was no transition: the cluster stopped with "no transition from solo on step_down"
    (``bench/uneven.py``'s fast peer alone, once)."""
    async with alone() as peer:
        await until(lambda: peer.cluster.machine.solo)
        await train(peer, 2)
        loop = asyncio.get_running_loop()
        await peer.cluster._carry_out(peer.cluster.machine.on_woken(loop.time(), 15.0))
        assert peer.cluster.machine.solo
        assert await train(peer, 3) == [1] * 3 and peer.version == 5
        await until(lambda: peer.cluster.machine.version == 5)


async def test_a_checkpoint_taken_alone_is_at_its_own_version():
    async with alone() as peer:
        await until(lambda: peer.cluster.machine.solo)
        await train(peer, 3)
        state = peer.state_dict()  # (the rounds of those batches are committed first)
        point = peer.cluster.machine.sync_point()
        assert state["version"] == 3 and state["sync"] == [point.version, point.digest.hex(), point.round, point.epoch]


async def test_a_peer_alone_ends_at_the_runs_last_round_exactly():
    async with alone(max_rounds=7) as peer:
        steps = 0
        while not peer.finished:
            await train(peer, 1)
            steps += 1
        assert steps == 7 and peer.version == 7 and peer.cluster.finished.version == 7
        assert peer.cluster.machine.ended == 7


async def test_a_joiner_ends_solo_and_both_train_on_as_identical_replicas():
    async with alone() as a:
        await until(lambda: a.cluster.machine.solo)
        await train(a, 6, seed=1)
        b = AsyncPeer(*made(), listen="127.0.0.1:0", discovery=False, secret="s",
                      peers=[f"127.0.0.1:{a.cluster.port}"])
        target = None

        async def a_trains():  # (on: a leader waits for its own batch before it serves a joiner)
            while target is None or a.version < target:
                await train(a, 1, seed=2)
                await asyncio.sleep(0.005)

        async def b_trains():  # once it holds a's state
            nonlocal target
            await until(lambda: b.cluster.members == 2 and b.cluster.loads)
            assert not a.cluster.machine.solo and not b.cluster.machine.solo
            target = max(a.version, b.version) + 4
            while b.version < target:
                await train(b, 1, seed=3)

        async with b:
            await asyncio.wait_for(asyncio.gather(a_trains(), b_trains()), 30)
            assert a.version == b.version == target > 6
            assert param_checksum(a.model) == param_checksum(b.model)
            assert a.cluster.rounds.last().members == 2


async def test_a_peer_alone_ends_once_its_duration_is_over():
    async with alone(duration=0.5) as peer:
        began = asyncio.get_running_loop().time()
        while not peer.finished:
            await train(peer, 1)
            await asyncio.sleep(0.002)
        took = asyncio.get_running_loop().time() - began
        assert 0.4 < took < 3.0 and peer.version == peer.cluster.finished.version > 10
        assert peer.cluster.machine.version == peer.version  # (every batch applied alone is in the chain)


async def test_a_peer_left_alone_goes_solo_and_a_newcomer_ends_it_again():
    a = alone()
    async with a:
        await with_a_partner_then_alone(a, 5)
        before = a.version
        assert await train(a, 4, seed=4) == [1] * 4 and a.version == before + 4
        c = AsyncPeer(*made(), listen="127.0.0.1:0", discovery=False, secret="s",
                      peers=[f"127.0.0.1:{a.cluster.port}"])
        target = None

        async def a_trains():
            while target is None or a.version < target:
                await train(a, 1, seed=5)
                await asyncio.sleep(0.005)

        async def c_trains():
            nonlocal target
            await until(lambda: c.cluster.members == 2 and c.cluster.loads)
            target = max(a.version, c.version) + 3
            while c.version < target:
                await train(c, 1, seed=6)

        async with c:
            await asyncio.wait_for(asyncio.gather(a_trains(), c_trains()), 30)
            assert a.version == c.version == target
            assert param_checksum(a.model) == param_checksum(c.model)
            assert a.cluster.machine.history.digest == c.cluster.machine.history.digest


def test_the_lane_numbers_batches_from_its_round_and_stops_at_the_last_version():
    from p2ptrain.trainer.solo import SoloLane
    lane = SoloLane()
    assert not lane.on
    with pytest.raises(RuntimeError):
        lane.applied(4, 1, 0.0)
    lane.begin(7, last_version=3)
    assert lane.applied(4, 1, 1.0) == (7, False) and lane.applied(5, 2, 2.0) == (8, False)
    assert lane.take() == [(7, 4, 1.0), (8, 5, 2.0)] and lane.take() == []
    assert lane.applied(6, 3, 3.0) == (9, True) and not lane.on and lane.flush
    assert lane.take() == [(9, 6, 3.0)]
    lane.begin(20, last_version=0)  # (no last version: on for good)
    assert lane.applied(1, 10_000, 4.0) == (20, False) and lane.on and not lane.flush
    lane.stop()
    assert not lane.on and lane.take() == [(20, 1, 4.0)]


async def test_error_feedback_owed_from_rounds_with_others_goes_in_a_round_before_solo():
    a = alone(compression="int8")
    async with a:
        began = []
        real_begin = a.cluster.machine.begin_solo

        def begin_solo(now):
            began.append(a.cluster.rings.residual)
            real_begin(now)
        a.cluster.machine.begin_solo = begin_solo
        owed = await with_a_partner_then_alone(a, 4, compression="int8")
        assert owed is not None  # (int8 dropped something in the rounds with b: owed)
        assert began and all(owed is None for owed in began)  # (carried by a round first)
