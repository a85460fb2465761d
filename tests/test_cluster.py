"""Cluster: the round machine driven over a real mesh on loopback, with a fake trainer."""

import asyncio

import numpy as np
import pytest

from helpers import pending_tasks, until

from p2ptrain.cluster import rings as rings_module
from p2ptrain.cluster.cluster import Cluster
from p2ptrain.errors import GroupError
from p2ptrain.cluster.rounds import RoundConfig

pytestmark = pytest.mark.timeout(60)
LENGTH = 5000


class FakeTrainer:
    """Contributes (rank+1) per value and one sample each round; applies sums to ``params``."""

    def __init__(self, rank):
        self.rank = rank
        self.params = np.zeros(LENGTH, np.float64)
        self.given = 0.0
        self.samples_given = 0
        self.applied = []
        self.put_backs = 0

    def take(self, members=1, alone=False):
        self.given += self.rank + 1
        self.samples_given += 1
        return np.full(LENGTH, self.rank + 1, np.float32), 1

    def used(self, contribution):  # (every parameter had a gradient)
        return None

    def apply(self, summed, total, used=None, spread=None):
        self.params += summed / total
        self.applied.append((float(summed[0]), total))

    def put_back(self, contribution, samples, not_finite=False):  # (staleness 0: the next take re-contributes)
        self.given -= float(contribution[0])
        self.samples_given -= samples
        self.put_backs += 1




def make(ids, config=None):
    trainers = [FakeTrainer(i) for i in range(len(ids))]
    clusters = [Cluster(peer_id=pid, trainer=t, checksum=b"same-start", secret=b"k", config=config)
                for pid, t in zip(ids, trainers)]
    return trainers, clusters


async def linked(ids, config):
    """Started clusters that were each told every address (their own too: skipped)."""
    trainers, clusters = make(ids, config)
    for c in clusters:
        await c.__aenter__()
    for c in clusters:
        for d in clusters:
            c.propose("127.0.0.1", d.port)
    return trainers, clusters


async def test_three_peers_commit_the_same_rounds():
    trainers, clusters = await linked(["a", "b", "c"], RoundConfig(min_peers=3))
    try:
        await until(lambda: all(len(t.applied) >= 5 for t in trainers), timeout=20)
        n = min(len(t.applied) for t in trainers)
        assert all(t.applied[:n] == trainers[0].applied[:n] for t in trainers)
        assert trainers[0].applied[0] == (6.0, 3)  # 1 + 2 + 3, three samples
    finally:
        for c in clusters:
            await c.close()
    assert pending_tasks() == []  # (closed while rounds ran: actors, tickers, rings, mesh readers, pings)



async def test_a_machine_that_slept_says_so_and_its_peers_go_on_with_it(monkeypatch, caplog):
    """A suspended machine's monotonic clock stops, so the loop's time shows no gap when its lid
    opens; its wall clock went on. The cluster tells its round machine (``SleepWatch``,
    ``on_woken``) before the next event, which says so; rounds go on with both peers after."""
    import logging
    from p2ptrain.cluster import cluster as cluster_module

    trainers, clusters = await linked(["a", "b"], RoundConfig(min_peers=2))
    try:
        await until(lambda: all(len(t.applied) >= 3 for t in trainers), timeout=20)
        real = cluster_module.time.time
        with caplog.at_level(logging.INFO, logger="p2ptrain.cluster.cluster"):
            monkeypatch.setattr(cluster_module.time, "time", lambda: real() + 15.0)  # the lid opens
            await until(lambda: "this peer stood still for 15 s" in caplog.text, timeout=5)
            counts = [len(t.applied) for t in trainers]
            await until(lambda: all(len(t.applied) >= c + 3 for t, c in zip(trainers, counts)), timeout=20)
        n = min(len(t.applied) for t in trainers)
        assert trainers[0].applied[:n] == trainers[1].applied[:n]
    finally:
        for c in clusters:
            await c.close()

@pytest.mark.parametrize("how", ["goodbye", "crash"])
async def test_a_peer_that_leaves_or_dies_is_dropped_and_no_sample_is_lost(how):
    trainers, clusters = await linked(["a", "b", "c"], RoundConfig(min_peers=2))
    try:
        await until(lambda: all(len(t.applied) >= 3 for t in trainers), timeout=20)
        if how == "goodbye":
            await clusters[2].close()
        else:  # no goodbye: its links just go dead
            for task in clusters[2]._tasks:
                task.cancel()
            for link in list(clusters[2].mesh._links.values()):
                link._transport.abort()
                link._close_io()
        before = len(trainers[0].applied)
        await until(lambda: len(trainers[0].applied) >= before + 3, timeout=20)
        assert trainers[0].applied[-1] == trainers[1].applied[-1] == (3.0, 2)  # a and b: 1 + 2, two samples
        assert all(len(c._rounds) <= 2 for c in clusters[:2])  # rounds applied or put back are let go
        n = min(len(trainers[0].applied), len(trainers[1].applied))
        assert trainers[0].applied[:n] == trainers[1].applied[:n]
    finally:
        for c in clusters[:2]:
            await c.close()
        if how == "crash":
            await clusters[2].mesh.close()
    for t in trainers[:2]:  # every sample given was applied or is the one still in flight
        assert t.samples_given - len(t.applied) in (0, 1), (t.samples_given, len(t.applied), t.put_backs)


async def test_a_peer_that_stopped_reading_holds_up_no_one():
    """The leader (a) freezes as a pulled cable leaves it: silent, its links open, reading
    nothing; b's link to it is busy (as with a ring chunk its kernel buffer cannot take). b
    notices a's silence and trains alone. Before, b's one actor awaited its next message to a
    (a STATUS to a leader gone quiet) behind that chunk, up to the ring's timeout and then 10 s a
    message, and heard no one meanwhile: a peer cut off from its leader went a minute without a
    round (once, a leader cut off from the others went 80 s)."""
    trainers, clusters = await linked(["a", "b"], RoundConfig(min_peers=1, peer_timeout=2.0))
    a, b = clusters
    busy = None
    try:
        await until(lambda: all(len(t.applied) >= 3 for t in trainers), timeout=20)
        a._tasks.cancel()  # a: no more rounds, no keepalives, nothing read; its links stay open
        for task in a.mesh._tasks:
            if task.get_coro().__name__ == "_ping":
                task.cancel()
        for link in a.mesh._links.values():
            link._transport.pause_reading()
        busy = b.mesh._links["a"]._send_lock
        await busy.acquire()
        frozen = asyncio.get_running_loop().time()
        await until(lambda: "a" not in b.mesh.peers and trainers[1].applied[-1] == (2.0, 1), timeout=15)
        assert asyncio.get_running_loop().time() - frozen < 2.0 + 3.0
    finally:
        if busy is not None and busy.locked():
            busy.release()
        await b.close()
        await a.mesh.close()


class QueuedTrainer:
    """Contributes ``rounds`` fixed random vectors, then nothing; a put-back one comes again first."""

    def __init__(self, seed, rounds):
        rng = np.random.default_rng(seed)
        self.queue = [rng.standard_normal(LENGTH).astype(np.float32) for _ in range(rounds)]
        self.given = np.sum(self.queue, axis=0, dtype=np.float64)
        self.applied = []
        self.put_backs = 0

    def take(self, members=1, alone=False):
        return (self.queue.pop(0), 1) if self.queue else None

    def used(self, contribution):  # (every parameter had a gradient)
        return None

    def apply(self, summed, total, used=None, spread=None):
        self.applied.append(summed.copy())

    def put_back(self, contribution, samples, not_finite=False):
        self.queue.insert(0, contribution.copy())
        self.put_backs += 1


@pytest.mark.parametrize("abort", [False, True])
async def test_a_lossy_codec_loses_nothing_over_rounds_error_feedback_carries_it(abort, monkeypatch):
    """Nothing lost: with top-k, what the rounds applied plus what each peer still owes (its
    residual) adds up to every gradient contributed. Without error feedback 90% is gone.
    With ``abort``, a round whose rings both ran (and wrote residuals) is aborted: it leaves
    the residual owed before it as it was, and its contributions come back."""
    if abort:
        class FailsOnce(rings_module.RingAllreduce):
            calls = 0

            async def run(self):
                stats = await super().run()
                FailsOnce.calls += 1
                if FailsOnce.calls == 5:  # (the third round: each peer's ring is one call)
                    raise GroupError("injected after the ring ran")
                return stats

        monkeypatch.setattr(rings_module, "RingAllreduce", FailsOnce)
    trainers = [QueuedTrainer(seed, 6) for seed in (1, 2)]
    applied, owed, given = await topk_books(trainers, 6)
    for a, b in zip(*(t.applied for t in trainers)):
        assert np.array_equal(a, b)  # every peer applied the same sums
    assert np.abs(applied + owed[0] + owed[1] - given).max() < 1e-3
    assert np.abs(applied - given).max() > 1.0  # (what the feedback carries is not small)
    assert all(np.count_nonzero(o) > LENGTH // 2 for o in owed)  # both owe, each its own part
    assert all(t.put_backs == (1 if abort else 0) for t in trainers)


async def topk_books(trainers, rounds):
    """Two top-k clusters on loopback, one per trainer, until each applied ``rounds`` updates:
    (the sum applied, what each peer still owes, the sum of every gradient contributed)."""
    clusters = [Cluster(peer_id=pid, trainer=t, checksum=b"same-start", secret=b"k", compression="topk:0.1",
                        config=RoundConfig(min_peers=2)) for pid, t in zip("ab", trainers)]
    try:
        for c in clusters:
            await c.__aenter__()
        clusters[0].propose("127.0.0.1", clusters[1].port)
        await until(lambda: all(len(t.applied) == rounds for t in trainers), timeout=30)
        applied = np.sum(trainers[0].applied, axis=0, dtype=np.float64)
        owed = [np.zeros(LENGTH) if c.rings.residual is None else c.rings.residual for c in clusters]
        return applied, owed, trainers[0].given + trainers[1].given
    finally:
        for c in clusters:
            await c.close()


class IdleEveryOther(QueuedTrainer):
    """As ``QueuedTrainer``, but every other round it has nothing (zeros, 0 samples), as every
    member of an idle round at staleness >= 1; a round of total 0 applies nothing."""

    def __init__(self, seed, rounds):
        super().__init__(seed, rounds)
        self.idle_next, self.idle = False, 0

    def take(self, members=1, alone=False):
        if not self.queue:
            return None
        self.idle_next = not self.idle_next
        return (np.zeros(LENGTH, np.float32), 0) if self.idle_next else super().take()

    def apply(self, summed, total, used=None, spread=None):
        if total:
            super().apply(summed, total)
        else:
            self.idle += 1

    def put_back(self, contribution, samples, not_finite=False):
        if samples:
            super().put_back(contribution, samples)


async def test_an_idle_round_keeps_what_error_feedback_owes():
    """A round in which nobody had anything (total 0) applies nothing, so what each peer owed
    before it is still owed after it: its ring carried the owed residual, and that sum is
    dropped with the round. (It was replaced by the idle round's own residual: the part of the
    owed that the ring carried was lost, about 90% of it with top-k.)"""
    trainers = [IdleEveryOther(seed, 4) for seed in (1, 2)]
    applied, owed, given = await topk_books(trainers, 4)
    assert all(t.idle >= 3 for t in trainers)  # (idle rounds between the updates)
    assert np.abs(applied + owed[0] + owed[1] - given).max() < 1e-3


class SlowTrainer(FakeTrainer):
    """Its first batch comes ``late`` seconds after the first round asks for it (a slow device)."""

    def __init__(self, rank, late):
        super().__init__(rank)
        self.late, self.asked, self.computed, self.cluster = late, False, False, None

    def take(self, members=1, alone=False):
        if not self.asked:
            self.asked = True
            asyncio.get_running_loop().call_later(self.late, self._computed)
        return super().take(members, alone) if self.computed else None

    def _computed(self):
        self.computed = True
        self.cluster.contribution_available()


async def test_a_ring_begun_early_waits_for_a_batch_later_than_its_chunk_timeout():
    """Rings start as members contribute: the quicker member's ring waits for the slower one's
    batch however long the round does (its chunk timeout does not count while the round
    collects), so the round commits rather than fail at that timeout and be tried again."""
    fast, slow = FakeTrainer(0), SlowTrainer(1, late=1.0)
    clusters = [Cluster(peer_id=pid, trainer=t, checksum=b"same-start", secret=b"k", ring_timeout=0.3,
                        config=RoundConfig(min_peers=2)) for pid, t in (("a", fast), ("b", slow))]
    slow.cluster = clusters[1]
    try:
        for c in clusters:
            await c.__aenter__()
        for c in clusters:
            for d in clusters:
                c.propose("127.0.0.1", d.port)
        await until(lambda: fast.applied and slow.applied, timeout=20)
        assert fast.applied[0] == slow.applied[0] == (3.0, 2)  # both batches, in the first round applied
        assert fast.put_backs == 0 and slow.put_backs == 0  # no ring failed at its 0.3 s timeout
    finally:
        for c in clusters:
            await c.close()


async def test_a_caller_that_stops_waiting_for_the_cluster_does_not_stop_it():
    """``commit_solo`` (and ``close``, after 2 s) wait on a future the actor resolves; a waiter
    cancelled first cancels that future, and resolving it raised InvalidStateError, which
    stopped the cluster ("cluster stopped: InvalidStateError", seen as an opening cut short
    under load left its listener open)."""
    _, (c,) = make(["a"])
    await c.__aenter__()
    try:
        waiter = asyncio.ensure_future(c.commit_solo())
        await asyncio.sleep(0)  # (posted; now waiting)
        waiter.cancel()
        await asyncio.sleep(0.2)  # (the actor has served the event)
        assert c.failure is None
        await asyncio.wait_for(c.commit_solo(), 5)  # still serving
    finally:
        await c.close()
    assert pending_tasks() == []
