"""What ``peer.step()`` costs a training loop: one peer alone, the same model and batches,
the same loop with and without p2ptrain.

    python bench/overhead.py                                 # join's default task (charlm, 0.86 M parameters)
    python bench/overhead.py --task synthetic --model-size 3m  # an MLP: little compute per parameter, the worst case
    python bench/overhead.py --quick                         # seconds: the CI smoke run

Rows: ``plain`` is ``zero_grad / loss / backward / optimizer.step``; ``p2ptrain sN`` is
``loss / backward / peer.step(batch_size=n)`` with ``p2ptrain.Peer`` at staleness N,
alone (``discovery=False, min_peers=1``), so every step still goes through a round (the
accumulator, the round machine, the update queue); only the ring has no one to talk to.
Each row is the median of ``--reps`` timed runs from fresh copies of the same model, the
modes interleaved so that a busy machine slows them alike; ``ratio`` is the rate over
``plain``'s. ``updates/step``: at staleness 0 every step applies one update, like
``plain``; above 0 a step applies what the rounds committed meanwhile, and fewer (bigger)
updates cost fewer optimizer steps, so compare s0 with ``plain`` for the cost of the same work.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
from _common import table

import p2ptrain
from p2ptrain.device import pick_device, synchronize
from p2ptrain.tasks import load_task


class Workload:
    """A task's model (fresh copies of its first parameters), its optimizer and fixed batches."""

    def __init__(self, args, device):
        self.task = load_task(args.task, {"seed": 0, "model_size": args.model_size, "batch_size": args.batch_size,
                                          "device": str(device)})
        self.device = device
        self.model = self.task.model.to(device)
        self.lr = self.task.default_lr
        batches = self.task.train_batches(0, 1, args.batch_size or self.task.batch_size, 0)
        self.data = [next(batches) for _ in range(8)]

    def fresh(self):
        model = copy.deepcopy(self.model)
        return model, self.task.make_optimizer(model.parameters(), self.lr)

    def loss(self, model, batch):
        return self.task.loss(model, batch, self.device)


def plain(work: Workload, seconds: float) -> tuple[float, float]:
    """Steps per second of the loop without p2ptrain (and one update per step)."""
    model, optimizer = work.fresh()

    def one(batch):
        optimizer.zero_grad(set_to_none=True)
        work.loss(model, batch).backward()
        optimizer.step()
    return timed(one, work, seconds)[0], 1.0


def with_peer(work: Workload, staleness: int, seconds: float) -> tuple[float, float]:
    """Steps per second with ``peer.step``, and updates applied per step."""
    model, optimizer = work.fresh()
    with p2ptrain.Peer(model, optimizer, listen="127.0.0.1:0", discovery=False, min_peers=1, secret="bench",
                       staleness=staleness) as peer:
        def one(batch):
            work.loss(model, batch).backward()
            peer.step(batch_size=work.task.batch_size_of(batch))
        counted = []
        rate, steps = timed(one, work, seconds, on_start=lambda: counted.append(peer.version))
        return rate, (peer.version - counted[0]) / steps


def timed(one, work: Workload, seconds: float, on_start=lambda: None) -> tuple[float, int]:
    for batch in work.data[:4]:  # warm-up: allocator, kernels, the first rounds
        one(batch)
    synchronize(work.device)
    on_start()
    steps, start = 0, time.perf_counter()
    while True:
        for batch in work.data:
            one(batch)
        steps += len(work.data)
        synchronize(work.device)  # note: a sync point, so the clock sees the device's work
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return steps / elapsed, steps


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--task", default="charlm", help="a built-in task (charlm, synthetic) or a task file")
    p.add_argument("--model-size", default=None, help="the task's model size (e.g. tiny, 1m, 10m)")
    p.add_argument("--batch-size", type=int, default=None, help="default: the task's")
    p.add_argument("--seconds", type=float, default=3.0, help="per timed run")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--staleness", default="0,1", help="the p2ptrain rows, e.g. 0,1,2")
    p.add_argument("--device", default="cpu", help="auto, cpu, cuda, mps, ...")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: steady numbers on a shared machine)")
    p.add_argument("--quick", action="store_true", help="a tiny model, short runs")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.quick:
        args.task, args.model_size, args.batch_size, args.seconds, args.reps = "synthetic", "100k", 16, 0.3, 1
    device = pick_device(args.device)
    work = Workload(args, device)
    staleness = [int(s) for s in args.staleness.split(",")]

    rates: dict[str, list] = {"plain": []} | {f"p2ptrain s{tau}": [] for tau in staleness}
    for _ in range(args.reps):  # interleaved: a busy machine slows every mode alike
        rates["plain"].append(plain(work, args.seconds))
        for tau in staleness:
            rates[f"p2ptrain s{tau}"].append(with_peer(work, tau, args.seconds))

    base = statistics.median(r for r, _ in rates["plain"])
    rows = []
    for mode, values in rates.items():
        rate = statistics.median(r for r, _ in values)
        rows.append([mode, f"{rate:.1f}", f"{1e3 / rate:.2f}", f"{rate / base:.3f}",
                     f"{min(r for r, _ in values):.1f}..{max(r for r, _ in values):.1f}",
                     f"{statistics.median(u for _, u in values):.2f}"])
    print(f"one peer alone on {device}: {work.task.info}; torch threads {torch.get_num_threads()}; "
          f"{args.reps} runs of {args.seconds:g} s\n")
    print(table(rows, ["loop", "steps/s", "ms/step", "ratio", "range (steps/s)", "updates/step"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
