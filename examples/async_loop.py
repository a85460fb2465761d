"""Train with p2ptrain from an asyncio program: the same command on every machine.

    python examples/async_loop.py --min-peers 2     # on each machine of the LAN: they find each other
    python examples/async_loop.py --min-peers 2 --peers 10.0.0.2:7100   # where multicast is blocked
    python examples/async_loop.py --min-peers 2 --staleness 1 --compression int8

Every peer starts from the same parameters (the same seed) and trains on its own batches.
With ``--staleness 0`` each ``await peer.step(...)`` returns once the round holding this
batch was applied, with the gradient averaged over every peer's samples (the mathematics of
DDP). With 1 or more it returns at once: the rounds run on the peer's own thread while the
loop computes, and the averaged updates are applied in later steps, at most that many
updates late. The cluster never runs on this program's event loop, so a forward and a
backward that hold it do not stall a ring. Ctrl-C cancels the loop at its next ``await``
(asyncio's way), the peer leaves the cluster politely, and the program exits 0.
"""

import argparse
import asyncio
import sys

import torch
import torch.nn.functional as F

import p2ptrain


async def main(args):
    torch.manual_seed(0)  # the same starting parameters on every peer
    model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    data = torch.Generator().manual_seed(args.data_seed)  # but different batches on each peer
    teacher = torch.Generator().manual_seed(1)
    w = torch.randn(20, generator=teacher)

    async with p2ptrain.AsyncPeer(model, optimizer, listen=args.listen, peers=args.peers.split(",") if args.peers else [],
                                  discovery=args.discovery, min_peers=args.min_peers, compression=args.compression,
                                  staleness=args.staleness, secret=args.secret) as peer:
        step = 0
        while peer.version < args.updates:  # the same updates on every peer: all stop together
            x = torch.randn(32, 20, generator=data)
            y = (x @ w > 0).long()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            await peer.step(batch_size=len(x))  # <- the only p2ptrain line in the loop
            if step % 20 == 0 or peer.version >= args.updates:
                print(f"step {step:4d}  loss {loss.item():.4f}  rounds applied {peer.version}", flush=True)
            step += 1


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--listen", default="0.0.0.0:7100")
    p.add_argument("--peers", default="", help="the other peers, host:port,...")
    p.add_argument("--min-peers", type=int, default=1)
    p.add_argument("--no-discovery", dest="discovery", action="store_false", help="use --peers only")
    p.add_argument("--compression", default="none")
    p.add_argument("--staleness", type=int, default=0, help="0: synchronous; 1, 2: rounds overlap compute")
    p.add_argument("--secret", default=None)
    p.add_argument("--updates", type=int, default=100, help="train until the cluster applied this many")
    p.add_argument("--data-seed", type=int, default=None, help="default: a random one")
    a = p.parse_args()
    if a.data_seed is None:
        a.data_seed = int(torch.randint(0, 2**31, (1,)).item())
    try:
        asyncio.run(main(a))
    except p2ptrain.P2PTrainError as exc:  # (another peer's settings, a wrong secret, ...: one line, not a traceback)
        raise SystemExit(f"{p.prog}: {exc}") from None
    except KeyboardInterrupt:  # (asyncio.run cancelled main at an await; ``async with`` left the cluster)
        print(f"\n{p.prog}: stopped by Ctrl-C; left the cluster", file=sys.stderr)
