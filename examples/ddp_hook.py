"""A ``DistributedDataParallel`` script on p2ptrain: DDP stays, its hook sends (marked ``# p2ptrain``).

    python examples/ddp_hook.py --rank 0 --peers 127.0.0.1:7100,127.0.0.1:7101 &
    python examples/ddp_hook.py --rank 1 --peers 127.0.0.1:7100,127.0.0.1:7101

Those two lines train one model on two "machines" of this one; on a LAN give each machine its
own ``--rank`` and the machines' addresses. DDP's world is the machine (here a process group of
one; ``torchrun --nproc-per-node 2`` on a desktop with two GPUs, each rank then listing its
counterparts' addresses), and the hook averages DDP's gradient buckets between machines over a
p2ptrain ring while backward still runs. The loop is the DDP loop it was.
"""

import argparse

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from p2ptrain.integrations.ddp import P2PHook, init_local_group


def main(a):
    torch.manual_seed(0)  # the same starting weights on every machine (DDP copies rank 0's within one)
    model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.BatchNorm1d(64), torch.nn.ReLU(), torch.nn.Linear(64, 2))
    init_local_group()  # p2ptrain: DDP's world is this machine (torchrun's, where it started this process)
    ddp = DistributedDataParallel(model, find_unused_parameters=True)  # (the same bucket order on every machine)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    data = torch.Generator().manual_seed(100 + a.rank)  # each machine its own batches
    w = torch.randn(20, generator=torch.Generator().manual_seed(1))
    peers = a.peers.split(",")
    with P2PHook(listen=peers[a.rank], peers=peers) as hook:  # p2ptrain: the ring between machines
        hook.register(ddp)  # p2ptrain
        for step in range(a.steps):
            x = torch.randn(32, 20, generator=data)
            loss = F.cross_entropy(ddp(x), (x @ w > 0).long())
            loss.backward()  # the buckets cross the ring while backward runs
            optimizer.step()
            optimizer.zero_grad()
            if step % 50 == 0 or step == a.steps - 1:
                print(f"rank {a.rank} step {step:3d}  loss {loss.item():.4f}", flush=True)
        hook.average_buffers(model)  # p2ptrain: BatchNorm's statistics alike on every machine
    digest = torch.cat([t.flatten().float() for t in model.state_dict().values()]).sum().item()
    print(f"rank {a.rank}: done, state sum {digest:.6f} (the same on every machine)", flush=True)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rank", type=int, required=True, help="this machine's place in --peers")
    p.add_argument("--peers", required=True, help="every machine's ring address, this one's included, host:port,...")
    p.add_argument("--steps", type=int, default=200)
    main(p.parse_args())
