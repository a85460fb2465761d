"""A parameter without a gradient follows DDP's rule: where no member had a gradient for it in a
round, its ``grad`` stays None on every peer and the optimizer skips it (no momentum, no weight
decay); where some did, the others count as zeros in the weighted mean. Two peers on loopback
against torch DDP on gloo (``find_unused_parameters=True``) with the same per-rank batches."""

import multiprocessing

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from helpers import ports
from test_trainer_staleness import close_all, open_peers, run_threads

from p2ptrain.cluster import used
from p2ptrain.errors import RemoteProtocolError
from p2ptrain.collective import ring

pytestmark = pytest.mark.timeout(120)
STEPS = 12


class TwoHeads(torch.nn.Module):
    """A trunk, a head used on every step, a second head used on some (``use_b``), and a third
    that no step uses."""

    def __init__(self):
        super().__init__()
        self.trunk, self.a = torch.nn.Linear(8, 32), torch.nn.Linear(32, 3)
        self.b, self.never = torch.nn.Linear(32, 3), torch.nn.Linear(32, 3)

    def forward(self, x, use_b):
        h = torch.tanh(self.trunk(x))
        return self.a(h) + self.b(h) if use_b else self.a(h)


def make():
    torch.manual_seed(0)
    model = TwoHeads()
    return model, torch.optim.Adam(model.parameters(), lr=0.01, weight_decay=0.1)


def uses_b(rank: int, step: int) -> bool:
    """Rank 0 uses the second head on even steps, rank 1 on every fourth: on odd steps nobody
    does (None), on steps 2, 6, 10 one rank does (the other counts as zeros), on 0, 4, 8 both."""
    return step % (2 + 2 * rank) == 0


def batches(rank):
    g = torch.Generator().manual_seed(100 + rank)  # (equal sizes: DDP's mean weighs ranks alike)
    return [(torch.randn(8, 8, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(STEPS)]


def _ddp_rank(rank: int, port: int, path: str) -> None:
    import datetime

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    try:
        model, opt = make()
        ddp = DistributedDataParallel(model, find_unused_parameters=True)
        for step, (x, y) in enumerate(batches(rank)):
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(ddp(x, uses_b(rank, step)), y).backward()
            opt.step()
        if rank == 0:
            torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, path)
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ddp(tmp_path_factory) -> dict:
    """The parameters DDP on gloo ends with (two processes on loopback), once for the module."""
    ctx = multiprocessing.get_context("spawn")
    port, path = ports(1)[0], str(tmp_path_factory.mktemp("ddp") / "ddp.pt")
    procs = [ctx.Process(target=_ddp_rank, args=(rank, port, path)) for rank in range(2)]
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.join(90)
        assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    return torch.load(path, weights_only=True)


def train_peers(monkeypatch, never_used=False, **options) -> list[dict]:
    """Two peers' parameters after ``STEPS`` steps of ``uses_b``'s plan (``never_used``: the
    second head too is never used)."""
    if options.get("overlap"):
        monkeypatch.setattr(ring, "BUCKET_ELEMS", 64)  # (several buckets for this small model)
    peers = open_peers([make, make], **options)
    data = [batches(r) for r in range(2)]
    try:
        def loop(rank):
            peer = peers[rank]
            for step, (x, y) in enumerate(data[rank]):
                F.cross_entropy(peer.model(x, uses_b(rank, step) and not never_used), y).backward()
                peer.step(batch_size=len(x))
        run_threads([lambda r=r: loop(r) for r in range(2)])
        return [{k: v.detach().clone() for k, v in peer.model.state_dict().items()} for peer in peers]
    finally:
        close_all(peers)


def relative(a: dict, b: dict) -> float:
    diff = torch.sqrt(sum(((a[k] - b[k]) ** 2).sum() for k in a))
    return float(diff / torch.sqrt(sum((b[k] ** 2).sum() for k in b)))


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
def test_staleness_0_equals_ddp_with_unused_parameters(overlap, monkeypatch, ddp):
    peers = train_peers(monkeypatch, overlap=overlap)
    for k in peers[0]:
        assert torch.equal(peers[0][k], peers[1][k]), k  # replicas bit-identical
    assert relative(peers[0], ddp) < 1e-5, relative(peers[0], ddp)
    for k in ddp:
        torch.testing.assert_close(peers[0][k], ddp[k], rtol=1e-4, atol=1e-5)
    assert torch.equal(peers[0]["never.weight"], make()[0].never.weight)  # (no step moved it)


def test_at_staleness_1_a_parameter_nobody_used_stays_put(monkeypatch):
    """Rounds at the network's pace sum whatever batches they hold: a head no batch used is not
    moved by Adam's weight decay (it was, with a zero gradient), and replicas stay identical."""
    peers = train_peers(monkeypatch, never_used=True, staleness=1)
    initial = make()[0].state_dict()
    for k in peers[0]:
        assert torch.equal(peers[0][k], peers[1][k]), k
    for k in ("b.weight", "b.bias", "never.weight", "never.bias"):
        assert torch.equal(peers[0][k], initial[k]), k
    assert not torch.equal(peers[0]["a.weight"], initial["a.weight"])  # (it trained)


def test_a_peer_alone_skips_a_parameter_without_a_gradient():
    """One process's rule for a peer alone (its batch applied at once, no ring)."""
    from p2ptrain import Peer

    model, opt = make()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with Peer(model, opt, listen="127.0.0.1:0", discovery=False, min_peers=1) as peer:
        for x, y in batches(0)[:3]:
            F.cross_entropy(peer.model(x, False), y).backward()
            peer.step(batch_size=len(x))
    assert torch.equal(model.b.weight, before["b.weight"]) and torch.equal(model.never.bias, before["never.bias"])
    assert not torch.equal(model.a.weight, before["a.weight"])


# -- the mask itself (``p2ptrain.cluster.used``) -----------------------------------------------
def test_a_mask_of_all_parameters_is_none_and_costs_nothing():
    assert used.encode([True] * 9) is None
    assert used.decode(None, 9) is None


@pytest.mark.parametrize("count", [1, 7, 8, 9, 17, 1000])
def test_a_mask_decodes_to_its_flags(count):
    rng = np.random.default_rng(count)
    flags = rng.random(count) < 0.5
    flags[0] = False  # (not all true)
    mask = used.encode(flags)
    assert len(mask) == (count + 7) // 8
    assert np.array_equal(used.decode(mask, count), flags)


def test_masks_merge_by_or_and_a_member_with_every_gradient_absorbs():
    a = used.encode([True, False, False, True, False])
    b = used.encode([False, False, True, True, False])
    assert np.array_equal(used.decode(used.merge(a, b), 5), [True, False, True, True, False])
    assert used.merge(a, None) is None and used.merge(None, b) is None
    assert used.decode(used.merge(a, used.encode([False, True, True, False, True])), 5) is None  # (all: None)


def test_bad_masks_are_refused():
    with pytest.raises(ValueError, match="another length|bytes for"):
        used.decode(b"\x01\x00", 5)
    with pytest.raises(ValueError, match="past its parameters"):
        used.decode(b"\x21", 5)  # (bit 5 of 5 parameters)
    with pytest.raises(RemoteProtocolError, match="models differ"):
        used.merge(b"\x01", b"\x01\x00")
    assert used.merge(used.NONE_YET, b"\x01") == b"\x01"  # (the leader's start: no DONE yet)


def test_the_leader_ors_the_members_masks_into_its_commit():
    """Each member's DONE says which of its parameters had a gradient; the leader's COMMIT carries
    the OR, and every member applies that one mask (replicas stay alike)."""
    from roundnet import Net  # (the round machines on a fake bus)

    from p2ptrain.cluster import roundmsg as M

    net = Net("abc", auto=False)
    net.found()
    net.tick()
    net.settle()
    for peer in "abc":
        net.contribute(peer, 4)
    net.settle()
    net.finish_ring("a", used=used.encode([True, False, False, False]))
    net.finish_ring("b", used=used.encode([False, False, True, False]))
    net.finish_ring("c", used=used.encode([False, False, False, False]))  # (a batch of nothing but the trunk's)
    net.settle()
    commit = net.sent("a", M.COMMIT)[0]
    assert used.decode(commit["used"], 4).tolist() == [True, False, True, False]
    for peer in "abc":
        assert [a.used for a in net.of(peer, M.Apply)] == [commit["used"]]


def test_a_member_that_had_every_gradient_makes_the_commit_carry_no_mask():
    from roundnet import Net

    from p2ptrain.cluster import roundmsg as M

    net = Net("ab", auto=False)
    net.found()
    net.tick()
    net.settle()
    for peer in "ab":
        net.contribute(peer, 4)
    net.settle()
    net.finish_ring("a", used=used.encode([True, False]))
    net.finish_ring("b")  # (no mask: all of its parameters had one)
    net.settle()
    assert "used" not in net.sent("a", M.COMMIT)[0]
    assert [a.used for a in net.of("b", M.Apply)] == [None]


def test_error_feedback_keeps_what_was_owed_on_parameters_nobody_used():
    """With a lossy codec, what a peer's encodes dropped is owed to its next contribution. A round
    whose sum is not applied on some parameters (nobody had a gradient for them) applied none of
    what was owed there: it is still owed, not replaced by that ring's residual."""
    from p2ptrain.cluster.rings import Round, Rings
    from p2ptrain.codecs import parse_codec
    from p2ptrain.taskset import TaskSet

    rings = Rings("a", mesh=None, codec=parse_codec("int8"), timeout=1.0, tasks=TaskSet(), on_done=lambda *a: None)
    before, dropped = np.arange(8, dtype=np.float32), np.full(8, -1.0, np.float32)
    rings.residual = before.copy()
    rnd = Round(0, taken=(np.zeros(8, np.float32), 1))
    rnd.summed, rnd.residual = np.ones(8, np.float32), dropped.copy()
    rings.commit(rnd, total=2)
    rings.keep_owed([(2, 5)])
    assert rings.residual.tolist() == [-1, -1, 2, 3, 4, -1, -1, -1]
    rings.residual = before.copy()  # (a ring that went exact: nothing dropped, nothing owed after it)
    rnd.summed, rnd.residual = np.ones(8, np.float32), None
    rings.commit(rnd, total=2)
    rings.keep_owed([(6, 8)])
    assert rings.residual.tolist() == [0, 0, 0, 0, 0, 0, 6, 7]
    rnd.summed, rnd.residual = np.ones(8, np.float32), dropped.copy()
    rings.commit(rnd, total=0)  # (nobody had anything: nothing applied, what was owed is owed still)
    rings.keep_owed([(0, 8)])
    assert rings.residual.tolist() == [0, 0, 0, 0, 0, 0, 6, 7]
