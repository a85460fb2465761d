"""Train with p2ptrain from an ordinary PyTorch loop: the same command on every machine.

    python examples/custom_loop.py --min-peers 2                    # on each machine of the LAN
    python examples/custom_loop.py --min-peers 2 --peers 10.0.0.2:7100 --staleness 1 --compression int8

The lines marked ``# p2ptrain`` are all it takes. ``peer.step`` contributes the batch's
gradient and applies the averaged updates that are ready: each one is clipped
(``clip_grad_norm``), then your optimizer steps, then your LR scheduler steps, once per
applied update. Your optimizer's own step hooks see the averaged gradient in ``p.grad``
before it is applied (this example logs its norm there). ``state_dict``/``load_state_dict``
checkpoint the peer the way you checkpoint anything: model, optimizer, scheduler and the
cluster's lineage, so that ``--checkpoint FILE`` resumes at the update, and the learning
rate, where the last run stopped. The loop counts the cluster's updates,
not its own steps: with staleness above 0 a faster peer takes more steps, and a peer that
stopped early would leave the others short of ``--min-peers``. Ctrl-C leaves the cluster after
the step in progress, saves the checkpoint and exits 0 (a second Ctrl-C quits at once).
"""

import argparse
import os
import signal
import sys
import threading

import torch
import torch.nn.functional as F

import p2ptrain


def stop_on_ctrl_c() -> threading.Event:
    """Ctrl-C sets the event: the loop leaves after the step in progress. (Python's own
    KeyboardInterrupt would land wherever the loop is, in the middle of an optimizer step
    too, and leave the parameters half updated.) A second Ctrl-C quits at once."""
    stop = threading.Event()

    def handler(signum, frame):
        if stop.is_set():
            raise KeyboardInterrupt
        stop.set()
        print("\nleaving after this step (Ctrl-C again to quit at once)", file=sys.stderr, flush=True)

    signal.signal(signal.SIGINT, handler)
    return stop


def main(args):
    torch.manual_seed(0)  # the same starting parameters on every peer
    model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.updates)
    grad_norm = [float("nan")]

    def log_grad_norm(opt, args, kwargs):  # an optimizer hook: the averaged, clipped gradient, before it is applied
        grad_norm[0] = torch.stack([p.grad.norm() for p in model.parameters()]).norm().item()

    optimizer.register_step_pre_hook(log_grad_norm)
    data = torch.Generator().manual_seed(args.data_seed)  # different batches on each peer
    w = torch.randn(20, generator=torch.Generator().manual_seed(1))

    peer = p2ptrain.Peer(model, optimizer, listen=args.listen, peers=args.peers.split(",") if args.peers else [],  # p2ptrain
                         discovery=args.discovery, min_peers=args.min_peers, staleness=args.staleness,  # p2ptrain
                         compression=args.compression, secret=args.secret,  # p2ptrain
                         clip_grad_norm=1.0, scheduler=scheduler)  # p2ptrain
    if args.checkpoint and os.path.exists(args.checkpoint):
        peer.load_state_dict(torch.load(args.checkpoint, weights_only=True))  # p2ptrain (before `with`)
        print(f"resumed at update {peer.version}, lr {scheduler.get_last_lr()[0]:.5f}", flush=True)
    stop = stop_on_ctrl_c()
    try:
        with peer:  # p2ptrain: listen, find the others, agree on a ring
            step = 0
            while peer.version < args.updates and not stop.is_set():  # p2ptrain: every peer sees the same updates
                x = torch.randn(32, 20, generator=data)
                y = (x @ w > 0).long()
                loss = F.cross_entropy(model(x.to(peer.device)), y.to(peer.device))
                loss.backward()
                peer.step(batch_size=len(x))  # p2ptrain: contribute; apply the averaged updates ready
                if step % 20 == 0 or peer.version >= args.updates:
                    print(f"step {step:4d}  loss {loss.item():.4f}  updates {peer.version}  "
                          f"lr {scheduler.get_last_lr()[0]:.5f}  grad norm {grad_norm[0]:.3f}", flush=True)
                step += 1
    finally:  # (after Ctrl-C too: the next run resumes here, at the scheduler's learning rate)
        if args.checkpoint:
            torch.save(peer.state_dict(), args.checkpoint)  # p2ptrain: model, optimizer, scheduler, lineage
    if stop.is_set():
        print(f"stopped by Ctrl-C at update {peer.version}" + (f"; saved to {args.checkpoint}" if args.checkpoint
                                                               else ""), flush=True)
    m = peer.metrics  # p2ptrain: the last round, as the peer saw it
    if m is not None:
        print(f"done: {peer.version} updates; last round {m.round}: {m.members} members, {m.samples} samples, "
              f"staleness {m.staleness}, {m.wire_bytes} bytes sent for {m.raw_bytes}", flush=True)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--listen", default="0.0.0.0:7100")
    p.add_argument("--peers", default="", help="the other peers, host:port,...")
    p.add_argument("--min-peers", type=int, default=1)
    p.add_argument("--no-discovery", dest="discovery", action="store_false", help="use --peers only")
    p.add_argument("--staleness", type=int, default=0, help="0: synchronous; 1, 2: rounds overlap compute")
    p.add_argument("--compression", default="none", help="none, fp16, bf16, int8, ...")
    p.add_argument("--secret", default=None)
    p.add_argument("--updates", type=int, default=100, help="train until the cluster applied this many (the "
                   "learning rate schedule's length; a resumed run counts from where it left off)")
    p.add_argument("--checkpoint", default=None, help="resume from this file if it exists; save to it at the end "
                   "(after Ctrl-C too)")
    p.add_argument("--data-seed", type=int, default=None, help="default: a random one")
    a = p.parse_args()
    if a.data_seed is None:
        a.data_seed = int(torch.randint(0, 2**31, (1,)).item())
    try:
        main(a)
    except p2ptrain.P2PTrainError as exc:  # (another peer's settings, a wrong secret, ...: one line, not a traceback)
        raise SystemExit(f"{p.prog}: {exc}") from None
    except KeyboardInterrupt:  # (a second Ctrl-C: at once, the checkpoint saved all the same)
        print(f"{p.prog}: interrupted", file=sys.stderr)
        raise SystemExit(130) from None
