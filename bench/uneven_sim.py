"""Uneven peers in virtual time: ``uneven.py``'s question (does a slower machine help?) without
processes, sockets or a clock, so a mode can be read over several seeds in minutes.

    python bench/uneven_sim.py                                     # 1 M model, batch 8, a peer 10x slower
    python bench/uneven_sim.py --model 9m --batch-size 64 --ticks 600 --eval-every 5
    python bench/uneven_sim.py --modes alone,local --outer 0.8/0.6 --lookahead   # rounds by time's default
    python bench/uneven_sim.py --modes alone,switch,accumulate --from 400       # larger updates late

One tick is the fast peer's step; the slow peer takes ``--slow`` ticks a batch. Both train the
built-in ``synthetic`` task's student with AdamW (lr 1e-3), as ``uneven.py``'s peers do:

- ``alone``: the fast peer by itself, a step a tick (what every other row is read against).
- ``gradients``: gradient mode at staleness 1 beside the slower member: a round closes with each
  slow batch and holds every fast batch since the last one (the fill), the slow one computed on
  the parameters of when it began; the mean lands a tick later, so the fast batch of that tick is
  one update stale.
- ``local``: local steps by time (``--sync-every`` a window): every ``--window`` ticks each peer
  contributes its pseudo-gradient, averaged by samples, through the library's own outer step
  (``trainer.local_steps.LocalSteps``); it lands a tick later.
- ``switch``: ``local`` until ``--from``, then ``gradients`` from the outer parameters, the
  optimizer's state cleared (identical on every replica without a transfer).
- ``accumulate``: the fast peer alone, stepping once every ``--window`` batches from ``--from``:
  larger updates late with no second machine, the control for what a slow peer's long rounds do.

Each round costs the fast peer ``--ring`` ticks of compute (on the 2 shared cores here a 9 M int8
round takes about a fast step of CPU; 0 stands for separate machines). The figure is the tick at
which the evaluation loss (1,024 validation samples every ``--eval-every`` ticks, smoothed as
``uneven.py`` smooths it) first falls below each target, over the alone's of the same seed.

What it showed (bench/README, "The pair in virtual time"): gradient mode's early loss at 9 M,
batch 64 is its count of updates (3.4-4.1x the fast alone's ticks, as the processes gave); its
late lead is mostly the larger update, which the fast peer alone gets by ``accumulate``; local
steps with plain averaging keep the fast peer's pace, a 10x slower peer's 9 % of the samples
inside the seeds' own spread.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import uneven  # noqa: E402  (its smoothing and crossing: the figures read alike)
from p2ptrain.tasks import seeded_generator, synthetic  # noqa: E402
from p2ptrain.trainer.local_steps import LocalSteps  # noqa: E402

MODES = ("alone", "gradients", "local", "switch", "accumulate")


def gradients_of(model: torch.nn.Module, batch) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=False)
    x, y = batch
    F.cross_entropy(model(x), y).backward()
    return [p.grad.detach().clone() for p in model.parameters()]


def step_on(model, optimizer, grads: list[torch.Tensor]) -> None:
    for p, g in zip(model.parameters(), grads):
        p.grad = g
    optimizer.step()


def mean_of(batches: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    return [sum(gs) / len(batches) for gs in zip(*batches)]


class Run:
    """One mode, one seed: ``curve`` holds (tick, evaluation loss) of the fast peer's parameters."""

    def __init__(self, a, mode: str, seed: int):
        self.a, self.mode = a, mode
        task = synthetic.make_task({"model_size": a.model})
        self.x, self.y = synthetic.Teacher(0).batch(uneven.EVAL_SAMPLES, seeded_generator(0, "synthetic-validation"))
        self.streams = [task.train_batches(1000 * seed + r, 2, a.batch_size, 0) for r in range(2)]
        self.fast, self.slow = task.model, copy.deepcopy(task.model)
        self.opts = [torch.optim.AdamW(m.parameters(), lr=uneven.LR) for m in (self.fast, self.slow)]
        lr, momentum = a.outer
        self.outer = [LocalSteps(list(m.parameters()), None, lr, momentum, o, window_s=1.0)
                      for m, o in zip((self.fast, self.slow), self.opts)]
        for o in self.outer:
            o.lookahead = a.lookahead
        self.local = mode in ("local", "switch")
        self.pending: list[list[torch.Tensor]] = []  # batches since the last contribution or step
        self.slow_on: dict | None = None  # (gradient mode) the parameters the slow batch began on
        self.landing: tuple[int, object] | None = None  # (tick, what lands)
        self.busy = 0  # ticks of the fast peer's compute a round still takes
        self.curve: list[tuple[int, float]] = []

    def run(self) -> list[tuple[int, float]]:
        a = self.a
        for k in range(1, a.ticks + 1):
            if self.mode == "switch" and self.local and k >= a.start and self.landing is None:
                self.to_gradients()
            self.fast_tick(k)
            if self.mode in ("gradients", "switch") and not self.local and self.slow_on is None:
                self.slow_on = copy.deepcopy(self.fast.state_dict())  # (the slow batch begins before the update lands)
            slow_done = self.mode not in ("alone", "accumulate") and k % a.slow == 0
            if self.landing is not None and k >= self.landing[0]:
                self.land(self.landing[1])
            if slow_done:
                self.slow_batch(k)
            if self.local and k % a.window == 0 and self.landing is None:
                self.contribute(k)
            if k % a.eval_every == 0:
                with torch.no_grad():
                    self.curve.append((k, float(F.cross_entropy(self.fast(self.x), self.y))))
        return self.curve

    def fast_tick(self, k: int) -> None:
        if self.busy:
            self.busy -= 1
            return
        grads = gradients_of(self.fast, next(self.streams[0]))
        if self.mode == "alone" or self.mode == "accumulate" and k < self.a.start:
            self.opts[0].step()
        elif self.mode == "accumulate":
            self.pending.append(grads)
            if len(self.pending) == self.a.window:
                step_on(self.fast, self.opts[0], mean_of(self.pending))
                self.pending = []
        elif self.local:
            self.opts[0].step()
            self.outer[0].stepped(self.a.batch_size)
        else:
            self.pending.append(grads)

    def slow_batch(self, k: int) -> None:
        if self.local:
            gradients_of(self.slow, next(self.streams[1]))
            self.opts[1].step()
            self.outer[1].stepped(self.a.batch_size)
        elif self.landing is None and self.slow_on is not None:  # a round: the fill and the slow batch
            self.slow.load_state_dict(self.slow_on)
            self.pending.append(gradients_of(self.slow, next(self.streams[1])))
            self.landing, self.pending, self.slow_on = (k + 1, mean_of(self.pending)), [], None
            self.busy = self.a.ring

    def contribute(self, k: int) -> None:
        total, weighted = 0, None
        for o in self.outer:
            if o.samples:
                delta, samples = o.contribute()
                flat = torch.cat([d.reshape(-1) for d in delta]) * samples
                weighted, total = (flat if weighted is None else weighted + flat), total + samples
        if total:
            self.landing, self.busy = (k + 1, weighted / total), self.a.ring

    def land(self, what) -> None:
        if self.local:
            for o in self.outer:
                o.apply(what.clone())
        else:
            step_on(self.fast, self.opts[0], what)
        self.landing = None

    def to_gradients(self) -> None:
        for o in self.outer:
            o.finish()  # (both on the outer parameters)
        self.opts[0].state.clear()
        self.local, self.pending, self.slow_on = False, [], None


def ticks_to(curve: list[tuple[int, float]], target: float) -> float | None:
    ticks = [float(k) for k, _ in curve]
    return uneven.crossing(ticks, uneven.smoothed([loss for _, loss in curve]), target, 0.0)


def parse(argv=None) -> argparse.Namespace:
    """The options, ``modes``, ``targets`` and ``seeds`` as lists and ``outer`` as (lr, momentum)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="1m", help="the synthetic task's model size (1m, 9m, ...)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--slow", type=int, default=10, help="ticks a slow batch takes (the fast peer's steps)")
    p.add_argument("--ring", type=int, default=1, help="ticks of the fast peer's compute a round takes")
    p.add_argument("--window", type=int, default=10, help="ticks a local-steps round lasts (and accumulate's batches)")
    p.add_argument("--ticks", type=int, default=2000)
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--seeds", default="1,2")
    p.add_argument("--targets", default="1.0,0.9,0.85,0.8,0.75")
    p.add_argument("--outer", default="1/0", help="the outer step's lr/momentum (default plain averaging)")
    p.add_argument("--lookahead", action="store_true", help="LocalSteps.lookahead on (rounds by time's default)")
    p.add_argument("--modes", default="alone,gradients,local")
    p.add_argument("--from", dest="start", type=int, default=400, help="the tick switch and accumulate change at")
    a = p.parse_args(argv)
    try:
        a.modes = sorted(set(a.modes.split(",")), key=lambda m: MODES.index(m) if m in MODES else -1)
        a.outer = tuple(float(v) for v in a.outer.split("/"))
        a.targets = [float(t) for t in a.targets.split(",")]
        a.seeds = [int(s) for s in a.seeds.split(",")]
    except ValueError as e:
        p.error(f"--outer, --targets or --seeds: {e}")
    if "alone" not in a.modes or set(a.modes) - set(MODES) or len(a.outer) != 2 or min(a.slow, a.window) < 1:
        p.error(f"--modes: alone and any of {', '.join(MODES[1:])}; --outer LR/MOMENTUM; --slow, --window >= 1")
    return a


def main(argv=None) -> int:
    a = parse(argv)
    torch.set_num_threads(1)
    print(f"synthetic {a.model}, batch {a.batch_size}, a peer {a.slow}x slower, rounds cost {a.ring} tick(s), "
          f"window {a.window}, outer {a.outer[0]:g}/{a.outer[1]:g}{' with lookahead' if a.lookahead else ''}, "
          f"from tick {a.start}: ticks to each loss (x the fast alone's, same seed)")
    print("| seed | mode | " + " | ".join(f"to {t:g}" for t in a.targets) + " | final loss |")
    print("| - | - | " + " | ".join("-" for _ in a.targets) + " | - |")
    for seed in a.seeds:
        alone = None
        for mode in a.modes:
            curve = Run(a, mode, seed).run()
            cells = []
            for t in a.targets:
                got = ticks_to(curve, t)
                base = ticks_to(alone, t) if alone else got
                cells.append("-" if got is None else f"{got:.0f}" + (f" ({got / base:.2f}x)" if base else ""))
            alone = alone or curve
            final = statistics.fmean(loss for _, loss in curve[-uneven.SMOOTH:])
            print(f"| {seed} | {mode} | " + " | ".join(cells) + f" | {final:.3f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
