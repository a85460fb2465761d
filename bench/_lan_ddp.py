"""The gloo baseline of bench/lan.py's training part: DDP over torch.distributed gloo, one rank.

    python bench/_lan_ddp.py --rank 0 --world 2 --master 10.0.0.1 --port 29760 \
        --model-size 1m --batch-size 128 --rounds 100 --metrics ddp.jsonl

The same task as ``python -m p2ptrain join --task synthetic`` (built by
``p2ptrain.tasks.load_task``), the same seed, batch size, optimizer and per-rank batch
stream (``train_batches(rank, world, ...)``: lan.py gives join ``--data-rank`` the rank), so
that the two loss curves differ only in how the gradients are averaged and how fast. It writes the metrics file in join's
format (one JSON object per step: time, round, members, samples, loss, round_seconds)
so both are read by the same code. ``--step-delay`` sleeps (with ``--step-busy``: computes)
before each backward pass: the slow-peer emulation; DDP has no staleness bound, so every rank
waits for the slowest.
"""

from __future__ import annotations

import argparse
import json
import time

import _common


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--master", required=True, help="rank 0's address (the rendezvous)")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--model-size", default="1m")
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, required=True)
    ap.add_argument("--metrics", required=True)
    ap.add_argument("--step-delay", type=float, default=0.0)
    ap.add_argument("--step-busy", action="store_true", help="the delay computes (a core busy) instead of sleeping")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--device", default="cpu", help="cpu, cuda[:i], mps, auto (as join's --device)")
    a = ap.parse_args(argv)

    import torch
    from torch.nn.parallel import DistributedDataParallel

    from p2ptrain.commands.join import burn
    from p2ptrain.device import pick_device, synchronize
    from p2ptrain.tasks import load_task

    if a.threads:
        torch.set_num_threads(a.threads)
    with _common.gloo_group(a.master, a.port, a.rank, a.world, a.timeout):
        device = pick_device(a.device)
        task = load_task("synthetic", {"seed": a.seed, "model_size": a.model_size,
                                       "batch_size": a.batch_size, "data": None, "device": str(device)})
        model = DistributedDataParallel(task.model.to(device))  # (gloo allreduces CUDA tensors through the host)
        optimizer = task.make_optimizer(model.parameters(), task.default_lr)
        batches = task.train_batches(a.rank, a.world, a.batch_size, a.seed)
        with open(a.metrics, "w", encoding="utf-8") as out:
            for step in range(1, a.rounds + 1):
                t0 = time.monotonic()
                optimizer.zero_grad(set_to_none=False)
                loss = task.loss(model, next(batches), device)
                if a.step_delay:  # before backward: DDP's allreduce starts inside it
                    burn(a.step_delay) if a.step_busy else time.sleep(a.step_delay)
                loss.backward()
                optimizer.step()
                synchronize(device)  # (the step's time includes the device's work)
                out.write(json.dumps({"time": time.time(), "round": step, "members": a.world,
                                      "samples": a.batch_size * a.world, "loss": float(loss.detach()),
                                      "round_seconds": time.monotonic() - t0}) + "\n")
                out.flush()
        del model
    return 0


if __name__ == "__main__":
    _common.exit_now(main())
