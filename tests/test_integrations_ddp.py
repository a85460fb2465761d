"""``p2ptrain.integrations.ddp``: DDP's gradient buckets averaged across machines by a p2ptrain
ring, without blocking the autograd thread; the same result as DDP on gloo."""

import contextlib
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from helpers import ports, run_ranks

from p2ptrain.errors import ConfigError
from p2ptrain.integrations.ddp import P2PHook


class Bucket:  # (what DDP hands a hook: its flat gradient buffer)
    def __init__(self, tensor):
        self.tensor = tensor

    def buffer(self):
        return self.tensor


@pytest.mark.timeout(60)
def test_hook_returns_at_once_and_the_ring_completes_it():
    addresses = [f"127.0.0.1:{p}" for p in ports(2)]
    hooks = [P2PHook(a, addresses, secret="s") for a in addresses]
    with contextlib.ExitStack() as stack:
        with ThreadPoolExecutor(2) as pool:  # (each waits for the other to form the ring)
            for entered in [pool.submit(h.__enter__) for h in hooks]:
                stack.callback(entered.result(60).close)
        began = time.perf_counter()
        first = P2PHook.hook(hooks[0], Bucket(torch.tensor([1.0, 2.0, 3.0])))
        assert time.perf_counter() - began < 0.5  # handed to the ring's loop: the autograd thread goes on
        time.sleep(0.2)
        assert not first.done()  # (the other machine has not given its bucket yet)
        second = P2PHook.hook(hooks[1], Bucket(torch.tensor([3.0, 4.0, 5.0])))
        assert torch.equal(first.wait(), torch.tensor([2.0, 3.0, 4.0]))  # DDP's mean
        assert torch.equal(second.wait(), torch.tensor([2.0, 3.0, 4.0]))
        hooks[0].batch_size, hooks[1].batch_size = 1, 3  # weighted by samples
        first = P2PHook.hook(hooks[0], Bucket(torch.tensor([4.0])))
        second = P2PHook.hook(hooks[1], Bucket(torch.tensor([8.0])))
        assert first.wait().item() == second.wait().item() == 7.0


def test_register_refuses_what_would_part_the_replicas():
    hook = P2PHook("127.0.0.1:1", ["127.0.0.1:1"])
    with pytest.raises(ConfigError, match="enter the P2PHook"):
        hook.register(object())


@pytest.mark.timeout(150)
def test_ddp_script_with_the_hook_is_ddp(tmp_path):
    (r0, r1) = run_ranks("ddp_hook", "p2p,ddp", tmp_path, 3)
    p2p, ddp = r0["p2p"]["state"], r0["ddp"]["state"]
    for k, v in p2p.items():
        assert torch.equal(v, r1["p2p"]["state"][k]), k  # replicas bit-identical, buffers averaged too
        if "running" not in k:
            assert torch.equal(v, ddp[k]), k  # DDP's arithmetic (each gradient / 2, then summed): bit for bit
    own = [r["p2p"]["own_buffers"]["1.running_mean"] for r in (r0, r1)]
    assert not torch.equal(*own)  # each machine's BatchNorm saw its own batches
    assert torch.allclose(p2p["1.running_mean"], (own[0] + own[1]) / 2)


@pytest.mark.timeout(150)
def test_two_desktops_of_two_gpus_are_ddp_of_four(tmp_path):
    runs = run_ranks("ddp_hook_desktops", "p2p,ddp", tmp_path, 7, ranks=4)
    first = runs[0]["p2p"]["state"]
    for r in runs[1:]:
        for k, v in first.items():
            if "running" not in k:  # (BatchNorm's statistics: each rank its own, as under DDP)
                assert torch.equal(v, r["p2p"]["state"][k]), k
    for k, v in first.items():
        if "running" not in k:  # summed in another order than gloo's world of four: float tolerance
            assert torch.allclose(v, runs[0]["ddp"]["state"][k], rtol=1e-5, atol=1e-6), k
