"""``p2ptrain.integrations.buffers``: BatchNorm's statistics averaged each round, so that the
replicas are alike, buffers included (without it each peer's follow its own batches)."""

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from helpers import ports

import p2ptrain
from p2ptrain.integrations.buffers import AveragedBuffers


def train_pair(sync_buffers: bool, steps: int = 3):
    """Two peers of one process on loopback, each on its own batches; their models."""
    addresses = [f"127.0.0.1:{p}" for p in ports(2)]
    made = []
    for rank in range(2):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
        buffers = AveragedBuffers(model) if sync_buffers else None
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        peer = p2ptrain.Peer(buffers.wrap() if buffers else model, optimizer, listen=addresses[rank],
                             peers=addresses, discovery=False, min_peers=2, secret="s")
        made.append((model, buffers, optimizer, peer))
    barrier = threading.Barrier(2)

    def train(rank):
        model, buffers, optimizer, peer = made[rank]
        g = torch.Generator().manual_seed(rank)
        with peer:
            if buffers:
                buffers.install(optimizer)
            barrier.wait(30)
            for _ in range(steps):
                x = torch.randn(16, 4, generator=g) * (1 + 3 * rank)  # (the peers' statistics differ)
                model(x).square().mean().backward()
                if buffers:
                    buffers.contribute()
                peer.step(batch_size=len(x))
        return model

    with ThreadPoolExecutor(2) as pool:
        return [f.result(90) for f in [pool.submit(train, r) for r in range(2)]]


@pytest.mark.timeout(120)
def test_buffers_are_averaged_each_round():
    a, b = train_pair(sync_buffers=True)
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(x, y), name  # parameters and BatchNorm's statistics alike
    own_a, own_b = train_pair(sync_buffers=False)
    assert torch.equal(own_a[0].weight, own_b[0].weight)  # (the parameters are alike either way)
    assert not torch.allclose(own_a[1].running_var, own_b[1].running_var)  # the buffers are each peer's own
    assert torch.allclose(a[1].running_var, (own_a[1].running_var + own_b[1].running_var) / 2, rtol=0.2)
