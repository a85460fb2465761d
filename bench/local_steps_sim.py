"""Local steps (DiLoCo) without a network: how many inner steps a worker needs to a loss, by
``sync_every`` H and by how late the outer update lands, beside synchronous training.

    python bench/local_steps_sim.py                                     # N = 4, H = 8 and 16, delays 0..16
    python bench/local_steps_sim.py --n 4 --sync-every 8 --delays 2,6,10 --outer 0.8/0.6,0.7/0.9

N workers train the ``synthetic`` task's student in one process, in lockstep, each with its own
Adam (lr 1e-3) on its own batches, each holding a ``trainer.local_steps.LocalSteps`` (the
library's outer step, not a copy of it). Every worker contributes once it has taken H inner steps
and its last contribution is applied; the mean pseudo-gradient (samples are equal) lands ``delay``
inner steps later, as it does when a round's ring and commit take that long while the peers step
on. With ``delay`` >= H a worker takes ``delay`` steps per round. Synchronous training is one
Adam on the N batches together (DDP's mathematics). The figure is worker 0's inner steps until
its smoothed loss (an exponential average, beta 0.9 per step, bias-corrected, of the loss of its
own batches: what ``lan.py``'s "to loss" reads) first falls below ``--target``; the mean over
``--seeds``. A slower round in a real run shows here as a larger delay: read what it costs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from p2ptrain.tasks.synthetic import make_task  # noqa: E402
from p2ptrain.trainer.local_steps import LocalSteps  # noqa: E402

LR = 1e-3


class SmoothedLoss:
    """Worker 0's loss as ``lan.py`` reads it: an exponential average, beta 0.9 per step,
    bias-corrected."""

    BETA = 0.9

    def __init__(self):
        self.average, self.steps = 0.0, 0

    def add(self, loss: float) -> float:
        """Take one step's loss in; the smoothed loss now."""
        self.average, self.steps = self.BETA * self.average + (1 - self.BETA) * loss, self.steps + 1
        return self.average / (1 - self.BETA ** self.steps)


def synchronous(a, seed: int) -> int | None:
    """Steps of one Adam on the N workers' batches together."""
    task = make_task({"model_size": a.model_size})
    opt = torch.optim.Adam(task.model.parameters(), lr=LR)
    streams = [task.train_batches(1000 * seed + r, a.n, a.batch_size, 0) for r in range(a.n)]
    smoothed = SmoothedLoss()
    for step in range(1, a.max_steps + 1):
        batches = [next(s) for s in streams]
        x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
        opt.zero_grad()
        each = F.cross_entropy(task.model(x), y, reduction="none")
        each.mean().backward()
        opt.step()
        if smoothed.add(float(each[: a.batch_size].mean())) < a.target:  # (worker 0's own batch, as below)
            return step
    return None


def local_steps(a, seed: int, every: int, delay: int, outer_lr: float, momentum: float,
                periods: list[int] | None = None, by: str = "samples") -> int | None:
    """Ticks until worker 0's smoothed loss reaches the target, with ``LocalSteps`` on every
    worker. Worker r takes an inner step every ``periods[r]`` ticks (default: every tick; worker 0
    must be a fastest one). ``by`` says when a round forms: ``samples`` (as p2ptrain does) once
    every worker has taken ``every`` inner steps since its last contribution, so a faster one
    brings more; ``time`` every ``every`` ticks, each worker bringing what it has (nothing, if it
    took no step). Pseudo-gradients are averaged weighted by samples, as the ring does."""
    periods = periods or [1] * a.n
    tasks = [make_task({"model_size": a.model_size}) for _ in range(a.n)]  # (the same start on each)
    params = [[p for p in t.model.parameters()] for t in tasks]
    opts = [torch.optim.Adam(p, lr=LR) for p in params]
    outer = [LocalSteps(p, every, outer_lr, momentum) for p in params]
    streams = [tasks[0].train_batches(1000 * seed + r, a.n, a.batch_size, 0) for r in range(a.n)]
    smoothed = SmoothedLoss()
    landing: tuple[int, torch.Tensor] | None = None  # (at tick, the mean pseudo-gradient)
    for k in range(1, a.max_steps * max(periods) + 1):
        reached = False
        for r in range(a.n):
            if k % periods[r]:
                continue
            x, y = next(streams[r])
            opts[r].zero_grad()
            loss = F.cross_entropy(tasks[r].model(x), y)
            loss.backward()
            opts[r].step()
            outer[r].stepped(len(x))
            if r == 0:
                reached = smoothed.add(float(loss.detach())) < a.target
        if reached:
            return k
        if landing is not None and k >= landing[0]:
            for o in outer:
                o.apply(landing[1].clone())
            landing = None
        due = all(o.due() for o in outer) if by == "samples" else k % every == 0
        if landing is None and due:
            sums, total = None, 0
            for o in outer:
                if not o.samples:  # (a slow worker with no step since its last contribution)
                    continue
                delta, samples = o.contribute()
                flat = torch.cat([d.reshape(-1) for d in delta]) * samples
                sums, total = (flat if sums is None else sums + flat), total + samples
            landing = (k + delay, sums / total)
    return None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=4, help="workers (default 4)")
    p.add_argument("--sync-every", default="8,16", help="H values, comma-separated")
    p.add_argument("--delays", default="0,2,6,10,16", help="inner steps until the outer update lands")
    p.add_argument("--outer", default="0.8/0.6", help="outer lr/momentum pairs, comma-separated")
    p.add_argument("--seeds", default="1,2,3")
    p.add_argument("--model-size", default="1m")
    p.add_argument("--batch-size", type=int, default=16, help="per worker (default 16)")
    p.add_argument("--target", type=float, default=1.0, help="smoothed loss (default 1.0, lan.py's)")
    p.add_argument("--max-steps", type=int, default=300, help="worker 0's steps before giving up")
    p.add_argument("--periods", help="ticks per inner step, per worker, e.g. 1,1,1,4 (a last worker 4x "
                                     "slower; worker 0 must be a fastest); default every worker every tick")
    p.add_argument("--rounds-by", default="samples", help="samples (p2ptrain's rule), time, or both: samples,time")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    seeds = [int(s) for s in a.seeds.split(",")]

    def mean(xs):
        return f"{sum(x or a.max_steps for x in xs) / len(xs):.0f}" + ("" if all(xs) else " (some never)")

    periods = [int(x) for x in a.periods.split(",")] if a.periods else [1] * a.n
    if len(periods) != a.n or min(periods) < 1 or periods[0] != min(periods):
        p.error(f"--periods needs {a.n} whole numbers >= 1, the first a smallest")
    slowest = max(periods)
    sync = [synchronous(a, s) for s in seeds]  # (each of its steps waits for the slowest worker)
    sync = [None if x is None else x * slowest for x in sync]
    rows = [["synchronous", f"batch {a.n} x {a.batch_size}", "-", mean(sync), " ".join(map(str, sync))]]
    print(f"  {rows[-1]}", file=sys.stderr, flush=True)
    for pair in a.outer.split(","):
        outer_lr, momentum = (float(v) for v in pair.split("/"))
        for by in a.rounds_by.split(","):
            for every in (int(h) for h in a.sync_every.split(",")):
                for delay in (int(d) for d in a.delays.split(",")):
                    got = [local_steps(a, s, every, delay, outer_lr, momentum, periods, by) for s in seeds]
                    rows.append([f"H = {every}" + (f", rounds by {by}" if a.rounds_by != "samples" else ""),
                                 f"outer {outer_lr}/{momentum}", str(delay), mean(got), " ".join(map(str, got))])
                    print(f"  {rows[-1]}", file=sys.stderr, flush=True)
    speeds = "" if slowest == 1 else f", ticks per step {a.periods} (H: worker steps, or ticks when by time)"
    print(f"N = {a.n} workers, synthetic {a.model_size}, batch {a.batch_size} each, Adam {LR}{speeds}; ticks "
          f"(worker 0's inner steps) until its smoothed loss is below {a.target} (seeds {a.seeds})")
    widths = [max(len(r[i]) for r in rows + [["mode", "", "delay", "ticks", "per seed"]]) for i in range(5)]
    for r in [["mode", "", "delay", "ticks", "per seed"], ["-" * w for w in widths]] + rows:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
