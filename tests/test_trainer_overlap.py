"""Overlap (``overlap=True``): gradients go into the round's buffer as backward makes them and
the ring starts before ``step``. Real peers on loopback (the synchronous ``Peer``, one thread
each): the parameters must be bit for bit those of the same run without overlap, whatever the
loop does between backward and step (another batch size, two backwards, a parameter without a
gradient)."""

import time

import pytest
import torch
import torch.nn.functional as F

from test_trainer_staleness import close_all, open_peers, run_threads

from p2ptrain import ConfigError, Peer
from p2ptrain.collective import ring
from p2ptrain.trainer import peer as peer_module

pytestmark = pytest.mark.timeout(120)


class Net(torch.nn.Module):
    """Two layers, and one layer a flag leaves out of the graph (no gradient in that step)."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.unused = torch.nn.Linear(16, 64), torch.nn.Linear(64, 4), torch.nn.Linear(4, 4)

    def forward(self, x, skip=True):
        y = self.b(torch.tanh(self.a(x)))
        return y if skip else self.unused(y)


def make():
    torch.manual_seed(0)
    model = Net()
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


def batches(rank, steps):
    g = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(steps)]


def train(overlap: bool, plan, monkeypatch, steps=12, compression="none", device="cpu", between=None):
    """Two peers take ``steps`` steps; ``plan(i, x)`` gives step i's list of (x, skip) backwards
    (several: accumulated) and its batch size. Returns each peer's parameters, and whether a round
    was withdrawn anywhere."""
    monkeypatch.setattr(ring, "BUCKET_ELEMS", 512)  # (several buckets for this small model)
    ids = iter(["00000000000000a1", "00000000000000b2"])  # (the ring's order: int8 rounds by it)
    monkeypatch.setattr(peer_module, "new_peer_id", lambda: next(ids))
    peers = open_peers([make, make], overlap=overlap, compression=compression, device=device)
    data = [batches(r, steps) for r in range(2)]
    try:
        def loop(rank):
            peer = peers[rank]
            for i, (x, y) in enumerate(data[rank]):
                parts, size = plan(i, x, rank)
                for part, skip in parts:
                    F.cross_entropy(peer.model(part.to(device), skip), y[:len(part)].to(device)).backward()
                if plan is awkward:  # (time for a ring to end before step, were the guess not held)
                    time.sleep(0.03)
                if between is not None:  # (the loop's own work on the gradients, before step)
                    between(peer.model)
                peer.step(batch_size=size)
        run_threads([lambda r=r: loop(r) for r in range(2)])
        return [[p.detach().cpu().clone() for p in peer.model.parameters()] for peer in peers]
    finally:
        close_all(peers)


def same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


def plain(i, x, rank):
    return [(x, True)], len(x)


def awkward(i, x, rank):
    """A smaller batch now and then (on one peer: a wrong guess would weigh the two batches
    wrongly), two backwards in one step, a layer used once in a while."""
    if i % 4 == 1 and rank == 0:  # (every layer used: every range written before step, but the held one)
        return [(x[:5], False)], 5
    if i % 4 == 2:
        return [(x[:4], True), (x[4:], True)], 8
    return [(x, i % 4 not in (1, 3))], 8


NO_CUDA = "needs a CUDA device (run bench/device_check.sh on a GPU machine)"
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)


@pytest.mark.parametrize("plan, compression, device", [
    (plain, "none", "cpu"), (awkward, "none", "cpu"), (plain, "int8", "cpu"),
    pytest.param(plain, "none", "cuda", marks=CUDA), pytest.param(awkward, "none", "cuda", marks=CUDA)],
    ids=["plain", "awkward", "int8", "plain-cuda", "awkward-cuda"])
def test_overlapped_peers_end_with_the_bits_of_peers_without_overlap(plan, compression, device, monkeypatch):
    without = train(False, plan, monkeypatch, compression=compression, device=device)
    with_overlap = train(True, plan, monkeypatch, compression=compression, device=device)
    assert same(without[0], without[1]) and same(with_overlap[0], with_overlap[1])
    assert same(with_overlap[0], without[0])


def test_gradients_the_loop_changes_before_step_go_in_as_changed(monkeypatch, caplog):
    """Overlap's hooks read each gradient as backward makes it: a loop that clipped them itself
    before ``step`` (or unscaled them, ``GradScaler.unscale_``) had its change lost without a
    word, and trained on other numbers than without overlap. Such a step now goes in without
    overlap, as changed (the same bits as without overlap), and a warning says so once."""
    import logging

    def clip(model):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)

    caplog.set_level(logging.WARNING, "p2ptrain.trainer.overlap")
    without = train(False, plain, monkeypatch, between=clip)
    assert not caplog.records
    with_overlap = train(True, plain, monkeypatch, between=clip)
    assert same(with_overlap[0], with_overlap[1]) and same(with_overlap[0], without[0])
    said = [r.getMessage() for r in caplog.records if "changed them before step()" in r.getMessage()]
    assert len(said) == 2  # (once on each peer)


def make_deep():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh(),
                                torch.nn.Linear(64, 4))
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


def test_a_round_takes_the_batch_before_step_once_the_rings_first_bucket_is_written(monkeypatch):
    """Our contribution is out before step() (taken while backward ran: a pause before step
    gives the cluster's thread time to take it), and its ring runs on the last layers' values."""
    monkeypatch.setattr(ring, "BUCKET_ELEMS", 512)  # (the first bucket: the last layer and part of the middle one)
    peers = open_peers([make_deep, make_deep], overlap=True)
    data = [batches(r, 6) for r in range(2)]
    seen = [[], []]
    try:
        def loop(rank):
            peer = peers[rank]
            inner = peer._peer
            for x, y in data[rank]:
                F.cross_entropy(peer.model(x), y).backward()
                time.sleep(0.05)
                with inner._state.lock:
                    seen[rank].append(inner._state.out is not None and inner._state.out.filling is not None)
                peer.step(batch_size=len(x))
        run_threads([lambda r=r: loop(r) for r in range(2)])
    finally:
        close_all(peers)
    # (the first step has no batch size to guess; a peer whose partner is not stepping yet may
    # find no round asking: most steps must have gone out before step())
    assert sum(seen[0][1:]) + sum(seen[1][1:]) >= 5, seen


def test_overlap_is_refused_where_the_ring_already_overlaps():
    model, opt = make()
    for options in [{"staleness": 1}, {"sync_every": 4}]:
        with pytest.raises(ConfigError, match="overlap is for staleness 0"):
            Peer(model, opt, overlap=True, discovery=False, **options)
    with pytest.raises(ConfigError, match="overlap must be True or False"):
        Peer(model, opt, overlap="yes", discovery=False)


async def test_a_filling_lets_the_ring_read_a_range_once_written_and_the_first_only_once_confirmed():
    import asyncio

    from p2ptrain.errors import WithdrawnError
    from p2ptrain.trainer.overlap import Filling, offsets_of

    params = [torch.zeros(3), torch.zeros(4), torch.zeros(5)]
    buffer = torch.full((12,), float("nan"))
    views = [buffer[0:3], buffer[3:7], buffer[7:12]]
    f = Filling(views, offsets_of(params), guess=2, version=0, loop=asyncio.get_running_loop(), ring_from=1)
    last, middle, first = (asyncio.ensure_future(f.until(a, b)) for a, b in [(7, 12), (3, 9), (0, 2)])
    await asyncio.sleep(0.01)
    assert not (last.done() or middle.done() or first.done())
    assert not f.write(2, torch.ones(5)) and not f.takeable
    await asyncio.sleep(0.01)
    assert last.done() and not middle.done() and buffer[7:].tolist() == [2.0] * 5
    assert f.write(1, torch.ones(4)) and f.takeable  # (the ring's first bucket, from parameter 1, is written)
    assert not f.write(0, torch.ones(3))
    await asyncio.sleep(0.01)
    assert middle.done() and not first.done()  # (the first parameter's range waits for step)
    f.finish()
    await asyncio.wait_for(first, 1)
    g = Filling(views, offsets_of(params), guess=2, version=0, loop=asyncio.get_running_loop())
    waiting = asyncio.ensure_future(g.until(0, 12))
    await asyncio.sleep(0.01)
    g.withdraw("a batch of 3 samples after one of 2")
    with pytest.raises(WithdrawnError, match="a batch of 3 samples"):
        await asyncio.wait_for(waiting, 1)


def partner_leaves(overlap: bool) -> list[torch.Tensor]:
    """Six steps together, then the partner leaves while the seventh's backward is done: the
    seventh step comes once this peer is alone (solo may begin before it), then nine more.
    Returns the peer's parameters. (``Net``'s unused layer lies in the ring's first bucket: no
    round takes a batch before ``step``, so solo finds the seventh still being written.)"""
    peers = open_peers([make, make], overlap=overlap, min_peers=1)  # (alone, it trains on)
    data = [batches(r, 16) for r in range(2)]
    try:
        # (min_peers=1: a peer that stepped before meeting the other would step alone, and the
        # two runs would differ by when the peers met; they train from the moment they have)
        deadline = time.monotonic() + 10
        while any(p.members < 2 for p in peers) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert all(p.members == 2 for p in peers), "the two peers never met on loopback"
        def together(rank):
            peer = peers[rank]
            for x, y in data[rank][:6]:
                F.cross_entropy(peer.model(x), y).backward()
                peer.step(batch_size=len(x))
        run_threads([lambda r=r: together(r) for r in range(2)])
        a = peers[0]
        before = a.version
        x, y = data[0][6]
        F.cross_entropy(a.model(x), y).backward()  # (overlapped: the partner is still there)
        peers[1].close()
        deadline = time.monotonic() + 10
        while a.members > 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)
        a.step(batch_size=len(x))
        for x, y in data[0][7:]:
            F.cross_entropy(a.model(x), y).backward()
            a.step(batch_size=len(x))
        assert a.version == before + 10  # (one update a step, alone)
        return [p.detach().clone() for p in a.model.parameters()]
    finally:
        close_all(peers)


def test_a_peer_whose_partner_leaves_trains_on_alone_as_without_overlap(monkeypatch):
    """Overlapped rounds, then alone: no step hangs, and every batch is applied as without
    overlap (the one whose backward fed a round that never came is applied alone, as it is)."""
    monkeypatch.setattr(ring, "BUCKET_ELEMS", 512)
    ids = iter(["00000000000000a1", "00000000000000b2"] * 2)  # (the same ring order in both runs)
    monkeypatch.setattr(peer_module, "new_peer_id", lambda: next(ids))
    assert same(partner_leaves(True), partner_leaves(False))


def test_overlap_asked_for_a_model_of_one_bucket_says_it_does_nothing(monkeypatch, caplog):
    """``join --overlap`` on a model under 4 M parameters (the built-in tasks' sizes) changed
    nothing, without a word: such a model is one bucket of the ring, never overlapped."""
    import logging

    caplog.set_level(logging.INFO, "p2ptrain.trainer.overlap")
    said = lambda: [r.getMessage() for r in caplog.records if "not overlapped" in r.getMessage()]  # noqa: E731
    model, opt = make()
    Peer(model, opt, overlap=True, discovery=False).close()
    assert said() == ["overlap: this model's 1,368 parameters are one bucket of the ring (up to 4,194,304): its "
                      "ring is short, and backward is not overlapped with it"]
    caplog.clear()
    monkeypatch.setattr(ring, "BUCKET_ELEMS", 512)  # (several buckets: overlapped, nothing said)
    model, opt = make()
    Peer(model, opt, overlap=True, discovery=False).close()
    assert said() == []
