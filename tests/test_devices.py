"""The trainer on each device this machine has: the same guarantees on a GPU as on the CPU.

A model on CUDA takes other paths than one on the CPU: a peer alone applies the gradients
backward left on the device, a ring copies the accumulator to pinned host memory and the
averaged gradient back (``HostStaging``, ``apply.AveragedGradient``), and sketches are read
asynchronously. Each test runs on the CPU everywhere (so it is known to pass and to check
something) and on CUDA where there is one; CI has none, so the CUDA cases say so and skip.
``bench/device_check.sh`` runs this file on a lent GPU machine."""

import asyncio

import pytest
import torch
import torch.nn.functional as F

from helpers import async_peers_on_loopback

from p2ptrain import Peer

pytestmark = pytest.mark.timeout(90)

NO_CUDA = "needs a CUDA device (run bench/device_check.sh on a GPU machine)"
DEVICES = [pytest.param("cpu", id="cpu"),
           pytest.param("cuda", id="cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA))]


def make(device, opt="adam", width=32):
    torch.manual_seed(0)  # every replica starts from the same parameters
    model = torch.nn.Sequential(torch.nn.Linear(8, width), torch.nn.ReLU(), torch.nn.Linear(width, 3)).to(device)
    if opt == "adam":
        return model, torch.optim.Adam(model.parameters(), lr=1e-2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def batches(rank, rounds, device, size=None):
    g = torch.Generator().manual_seed(100 + rank)
    size = size or 4 + 3 * rank  # batches of different sizes count for their samples
    return [(torch.randn(size, 8, generator=g).to(device), torch.randint(0, 3, (size,), generator=g).to(device))
            for _ in range(rounds)]


@pytest.mark.parametrize("device", DEVICES)
def test_a_peer_alone_trains_bit_for_bit_as_the_plain_loop(device):
    """Alone at staleness 0 the batch's gradients are the mean: applied where backward left
    them, not scaled by the batch size and divided again (3 is not a power of two: that rounds),
    not copied. The parameters equal the plain loop's on the same device after every step."""
    plain, ours = make(device), make(device)
    with Peer(*ours, listen="127.0.0.1:0", discovery=False) as peer:
        assert peer.device.type == device
        for x, y in batches(0, 6, device, size=3):
            plain[1].zero_grad(set_to_none=True)
            F.cross_entropy(plain[0](x), y).backward()
            plain[1].step()
            F.cross_entropy(peer.model(x), y).backward()
            assert peer.step(batch_size=3) == 1
            assert all(p.grad is None for p in peer.model.parameters())
            assert all(torch.equal(a, b) for a, b in zip(plain[0].parameters(), peer.model.parameters()))


async def train_together(n, device, rounds, **options):
    """``n`` AsyncPeers on loopback, each on ``device``; each steps through its ``rounds``
    batches, or with ``max_rounds`` in ``options`` round and round them until the cluster's run
    ends (every member leaves after the same update). Returns the peers, closed, and the data."""
    data = [batches(r, rounds, device) for r in range(n)]
    async with async_peers_on_loopback([make(device) for _ in range(n)], **options) as peers:
        async def train(rank):
            peer, k = peers[rank], 0
            while not peer.finished if "max_rounds" in options else k < rounds:
                x, y = data[rank][k % rounds]
                F.cross_entropy(peer.model(x), y).backward()
                await peer.step(batch_size=len(x))
                k += 1

        await asyncio.wait_for(asyncio.gather(*[train(r) for r in range(n)]), 60)
    return peers, data


def replicas_equal(peers) -> bool:
    return all(torch.equal(a, b) for p in peers[1:] for a, b in zip(peers[0].model.parameters(), p.model.parameters()))


@pytest.mark.parametrize("device", DEVICES)
async def test_two_peers_at_staleness_0_train_as_one_process_on_the_union(device):
    """fp32 at staleness 0: DDP's mathematics, whatever the device, and bit-identical replicas."""
    rounds = 4
    peers, data = await train_together(2, device, rounds)
    reference, opt = make(device)
    for k in range(rounds):
        opt.zero_grad()
        F.cross_entropy(reference(torch.cat([d[k][0] for d in data])), torch.cat([d[k][1] for d in data])).backward()
        opt.step()
    assert all(p.version == rounds for p in peers)
    for mine, ref in zip(peers[0].model.parameters(), reference.parameters()):
        torch.testing.assert_close(mine, ref, rtol=1e-5, atol=1e-6)
    assert replicas_equal(peers)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("options", [dict(compression="int8"), dict(staleness=1, compression="int8"),
                                     dict(sync_every=3, staleness=1)], ids=["int8", "staleness-1", "local-steps"])
async def test_replicas_stay_bit_identical(device, options):
    """Lossy codecs, stale updates and local steps change the mathematics, never the agreement:
    the run ends with the cluster's (``max_rounds``) and every replica holds the same bits."""
    peers, _ = await train_together(2, device, 9, max_rounds=6, **options)
    assert [p.version for p in peers] == [6, 6]
    assert replicas_equal(peers)


@pytest.mark.parametrize("device", DEVICES)
def test_the_rings_sums_land_in_pinned_memory_on_cuda(device):
    """On CUDA the ring writes its sums into pinned host arrays the peer hands it, so the averaged
    gradient is copied back at the bus's full speed; elsewhere the ring's own arrays serve."""
    from p2ptrain.trainer.accumulator import Accumulator

    model, _ = make(device)
    acc = Accumulator([p for p in model.parameters()], torch.device(device))
    arrays = acc.result_buffers(2)
    if device == "cpu":
        assert arrays == []
    else:
        assert len(arrays) == 2 and all(a.dtype == "float32" and a.size == acc.numel for a in arrays)
        assert all(torch.from_numpy(a).is_pinned() for a in arrays)
