"""Uneven peers: does a slower machine help? Time to a fixed evaluation loss with one peer slowed,
against the fast peer(s) alone, in one run.

    python bench/uneven.py                                        # 9 M-parameter MLP, 2 peers, slow 3.7x and 10x
    python bench/uneven.py --slow 3.7 --delay 0.3                 # the slow peer sleeps 0.3 s a step (not a factor)
    python bench/uneven.py --n 2,4 --model 1m                     # 4 peers, one slow; the task's default size
    python bench/uneven.py --runs "--compression int8 --staleness 1;--staleness 1 --sync-every 2s"
    python bench/uneven.py --netns 1gbit --gpu-like               # a GPU's regime across emulated 1 Gbit/s hosts
    python bench/uneven.py --target 0.75 --also 0.9,0.8,0.7       # and the time to earlier and later losses
    python bench/uneven.py --quick                                # seconds: the CI smoke run

Every peer is a process running the library's ``p2ptrain.Peer`` on the built-in ``synthetic`` task
(a student MLP 32 -> w -> w -> 10, labels from a fixed random teacher; ``--model 9m``: 9.0 M
parameters, ``1m`` the task's default size), AdamW (lr 1e-3), ``--batch-size`` (64) fresh samples a
step, one torch thread. The last peer is the slow one: it sleeps after each step, ``(factor - 1)`` times
a fast peer's step time in the ``fast alone`` row of the same N (for N > 2 that row's steps include
its synchronous rounds; ``--delay`` gives the seconds instead). A sleep frees its core, as a slower
device on another machine would. Rows, per N and factor:

- ``fast alone``: the N - 1 fast peers without the slow one, synchronous fp32 (for N = 2 one lone
  peer: the plain loop). The time every other row is read against (``time / fast``).
- ``slow alone``: the slow peer by itself for ``--slow-seconds``: only its samples/s.
- ``fast alone, K batches a step`` (``--control``): the fast peers alone again, each step on K
  batches (K the factor rounded: about the fast batches a gradient-mode round beside the slow
  peer holds). Larger updates with no slower machine: where a pair leads the fast alone only as
  this row does, the lead is the batch behind an update, not the slower machine's samples.
- a row per ``--runs`` entry: all N peers, flags passed to every peer as the library's keywords
  (``--compression``, ``--staleness``, ``--sync-every`` H, a duration such as ``2s`` or ``auto``,
  ``--outer-lr``, ``--outer-momentum``, ``--target-batch-size``; ``--lookahead 0|1`` and
  ``--outer-whole 0|1``: the trainer's ``P2PTRAIN_LOOKAHEAD`` and ``P2PTRAIN_OUTER_WHOLE``). A
  setting this tree refuses is a row saying so (its one-line ``ConfigError``), so one command can
  A/B trees that differ.
- ``sync fp32``: the N peers at staleness 0, no compression and no delay (at staleness 0 a round
  takes one batch from each member whatever their speed: the same mathematics), run to
  ``--samples``: the loss the ``loss @ S`` column is read against.

Figures: ``time to loss``, wall seconds from the moment every member is present until rank 0's
parameters (a fast peer's; snapshots taken every ``--eval-period`` s, evaluated after the run on
1024 samples of the task's validation set, smoothed by a centered running mean of five snapshots,
the crossing interpolated between two) first reach ``--target``;
``samples/s``, every peer's samples over the run after its first tenth; ``vs sum alone``, that over
the fast alone's plus the slow alone's; ``loss @ S``, the evaluation loss once the cluster has
computed ``--samples`` samples in all (interpolated between smoothed snapshots), and its ratio to
sync fp32's; ``final loss``, the mean of the last five snapshots; with ``--also``, a second table
of the time to each of those losses and its ratio to the fast alone's (updates at a slower
member's pace lose early and can win late: one target alone ranks the modes by where it lies). A
snapshot's loss moves about 0.013 (a standard deviation) about that running mean (1m, batch 64,
one peer), and near the 1m target the loss falls about 0.004 a second: read raw, the first
crossing moved by about 3 s of the 22-44 s the fast peer alone takes to it.
Every run is bounded: the cluster's ``duration`` (``--seconds``), a kill ``--timeout`` s later.
The 2-core machines here are shared: compare rows of one run only.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common  # noqa: E402
import train  # noqa: E402  (its emulated device time)

EVAL_SAMPLES = 1024
SMOOTH = 5  # snapshots in the running mean that time to loss, loss @ S and the final loss are read on
LR = 1e-3
# --model: the task's size, a target evaluation loss, and the S of the loss @ S column. The 1m
# target takes the fast peer alone 22-28 s (2 cores, quiet: 4,200-4,800 steps) to 31-44 s (the
# same machine slower) of the 50, so a run holds a dozen or more 2 s rounds, not one: a target
# reached within the first window measures the first round's delay, not how the pair trains. The
# 9m one about 13,000 samples of the fast peer's (its loss 0.76 after 6,400, 0.71 after 12,800: a
# third to a half of its 60 s).
MODELS = {"9m": {"size": "9m", "target": 0.7, "seconds": 60.0, "samples": 15000},
          "1m": {"size": "1m", "target": 0.53, "seconds": 50.0, "samples": 100000}}
DEFAULT_RUNS = "--compression int8 --staleness 1;--compression int8 --staleness 1 --sync-every 16"


# ------------------------------------------------------------------ worker (one per peer process)
def run_flags() -> argparse.ArgumentParser:
    """The flags of a ``--runs`` entry: the library's keywords, passed on as given (``--sync-every``
    as an int where it is one, else the text: ``2s``, ``auto``)."""
    p = argparse.ArgumentParser(prog="--runs entry", add_help=False, exit_on_error=False)
    p.add_argument("--compression", default="none")
    p.add_argument("--staleness", type=int, default=0)
    p.add_argument("--sync-every")
    p.add_argument("--outer-lr", type=float)
    p.add_argument("--outer-momentum", type=float)
    p.add_argument("--target-batch-size", type=int)
    p.add_argument("--lookahead", choices=("0", "1"))  # (P2PTRAIN_LOOKAHEAD: by time's look-ahead off or on)
    p.add_argument("--outer-whole", choices=("0", "1"))  # (P2PTRAIN_OUTER_WHOLE: ``LocalSteps.divisor``)
    return p


def peer_keywords(flags: str) -> dict:
    """``p2ptrain.Peer``'s keywords of a ``--runs`` entry (unknown flags: ``argparse.ArgumentError``)."""
    f = run_flags().parse_args(shlex.split(flags))
    kw = {"compression": f.compression, "staleness": f.staleness}
    if f.sync_every is not None:
        kw["sync_every"] = int(f.sync_every) if f.sync_every.isdigit() else f.sync_every
    for key in ("outer_lr", "outer_momentum", "target_batch_size"):
        if getattr(f, key) is not None:
            kw[key] = getattr(f, key)
    return kw


def build(a):
    """The synthetic task of ``model_size`` (the built-in ``join --task synthetic``: a student MLP, a
    fixed random teacher, a fixed validation set) and its model, with ``--device-ms`` of emulated
    device time a step after it (bench/train.py's: a third in forward, two thirds in backward)."""
    import torch.nn as nn

    from p2ptrain.tasks import load_task

    task = load_task("synthetic", {"model_size": a.model_size, "seed": 0, "batch_size": a.batch_size,
                                   "device": "cpu"})
    model = nn.Sequential(task.model, train._DeviceTime(a.device_ms)) if a.device_ms else task.model
    return task, model


def _worker(a) -> None:
    import torch
    import torch.nn.functional as F

    import p2ptrain
    from p2ptrain.errors import ConfigError

    torch.set_num_threads(1)
    task, model = build(a)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    batches = task.train_batches(1000 + a.rank, 1, a.batch_size, 0)
    addrs = a.addrs.split(",")
    kw = peer_keywords(a.flags)
    switches = run_flags().parse_args(shlex.split(a.flags))
    for env, value in (("P2PTRAIN_LOOKAHEAD", switches.lookahead), ("P2PTRAIN_OUTER_WHOLE", switches.outer_whole)):
        if value is not None:
            os.environ[env] = value
    ends = {"max_rounds": a.max_rounds} if a.max_rounds else {"duration": a.seconds}
    snaps, timeline, out = [], [], {"rank": a.rank}
    try:
        peer = p2ptrain.Peer(model, optimizer, listen=addrs[a.rank], peers=[p for p in addrs if p != addrs[a.rank]],
                             discovery=False, min_peers=len(addrs), secret="bench", step_timeout=60.0,
                             reconcile_every=0, **kw, **ends)
    except ConfigError as e:  # (a setting this tree does not know: the row says so)
        Path(a.result).write_text(json.dumps({**out, "refused": str(e)}))
        return
    with peer:
        deadline = time.monotonic() + 60
        while peer.members < len(addrs) and time.monotonic() < deadline:
            time.sleep(0.01)
        t0 = time.time()
        samples, next_snap, last_mark = 0, t0, 0.0
        while not peer.finished:
            if a.rank == 0 and a.snapshots and time.time() >= next_snap:
                path = Path(a.snapshots) / f"{len(snaps)}.f32"
                torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy().tofile(path)
                snaps.append([time.time(), str(path)])
                next_snap += a.eval_period
            taken = 0
            for _ in range(a.accumulate):  # (--control: one step on K batches, their mean gradient)
                x, y = next(batches)
                (F.cross_entropy(model(x), y) / a.accumulate).backward()
                taken += len(x)
            peer.step(batch_size=taken)
            samples += taken
            if a.delay:
                time.sleep(a.delay)
            now = time.time()
            if now - last_mark >= 0.01:  # (a bounded timeline: at most 100 points a second)
                timeline.append([now, samples])
                last_mark = now
        timeline.append([time.time(), samples])
        if a.rank == 0 and a.snapshots:  # (the end too: a run to --max-rounds ends at exactly S samples)
            path = Path(a.snapshots) / f"{len(snaps)}.f32"
            torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy().tofile(path)
            snaps.append([time.time(), str(path)])
        out.update(t0=t0, timeline=timeline, snaps=snaps, updates=peer.version, dropped=peer.dropped)
    # (a file, not stdout: a result line of 100 KB came back broken from the pipe once in a few runs)
    Path(a.result).write_text(json.dumps(out))


# ------------------------------------------------------------------ one run: N processes
@dataclass
class Result:
    label: str
    n: int
    t0: float = 0.0
    end: float = 0.0
    timelines: list = field(default_factory=list)   # per rank: [[unix time, samples so far], ...]
    snaps: list = field(default_factory=list)       # rank 0's: [[unix time, file], ...]
    refused: str | None = None
    updates: int = 0
    dropped: int = 0
    snap_dir: Path | None = None                    # where the snapshots are (removed once read)

    def samples_at(self, t: float) -> float:
        """Samples the whole cluster had computed by time ``t`` (each peer's interpolated)."""
        total = 0.0
        for tl in self.timelines:
            total += _interp(t, [p[0] for p in tl], [p[1] for p in tl])
        return total

    def samples_per_s(self) -> float:
        """Every peer's samples per second after the first tenth of the run (start-up aside)."""
        rate = 0.0
        for tl in self.timelines:
            if len(tl) < 2:
                continue
            (t_a, s_a), (t_b, s_b) = _at(tl, tl[0][0] + 0.1 * (tl[-1][0] - tl[0][0])), tl[-1]
            rate += (s_b - s_a) / max(t_b - t_a, 1e-9)
        return rate


def _at(tl: list, t: float) -> list:
    return next((p for p in tl if p[0] >= t), tl[-1])


def _interp(x: float, xs: list, ys: list) -> float:
    if not xs or x <= xs[0]:
        return 0.0 if not ys else (ys[0] if x >= xs[0] else 0.0)
    for i in range(1, len(xs)):
        if x <= xs[i]:
            f = (x - xs[i - 1]) / max(xs[i] - xs[i - 1], 1e-12)
            return ys[i - 1] + f * (ys[i] - ys[i - 1])
    return ys[-1]


def run_peers(a, label: str, n: int, flags: str, delays: list[float], *, lan=None, group: int | None = None,
              seconds: float | None = None, max_rounds: int = 0, snapshots: bool = True, accumulate: int = 1) -> Result:
    """Start ``n`` workers (rank i sleeps ``delays[i]`` after each step, a step on ``accumulate``
    batches), wait, kill in ``finally``."""
    if lan is not None:
        addrs = [f"{h.addr}:{29800 + i}" for i, h in enumerate(lan.hosts[:n])]
    else:
        base = _common.free_port()
        addrs = [f"127.0.0.1:{base + i}" for i in range(n)]
    snap_dir = Path(tempfile.mkdtemp(prefix="p2pt-uneven-", dir=a.tmp))
    seconds = seconds or a.seconds
    cmd = [sys.executable, __file__, "--worker", "--addrs", ",".join(addrs), "--flags", flags,
           "--model-size", a.model_size, "--batch-size", str(a.batch_size),
           "--device-ms", str(a.device_ms), "--seconds", str(seconds), "--max-rounds", str(max_rounds),
           "--eval-period", str(a.eval_period), "--accumulate", str(accumulate)] + (
               ["--snapshots", str(snap_dir)] if snapshots else [])
    from p2ptrain.commands.heap import with_kept_heap

    env = with_kept_heap(dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]), OMP_NUM_THREADS="1"))
    procs, outs = [], []
    result = Result(label, group or n)  # (group: the N of the rows it belongs with)
    try:
        for r in range(n):
            argv = cmd + ["--rank", str(r), "--delay", str(delays[r]),
                          "--result", str(snap_dir / f"result-{r}.json")]
            if lan is not None:
                procs.append(lan.popen(r, argv, env=lan.env(r, env), stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, text=True))
            else:
                procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                              text=True))
        deadline = time.monotonic() + seconds + a.timeout
        for p in procs:
            outs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic())))
        found = []
        for r, (p, (out, err)) in enumerate(zip(procs, outs)):
            result_file = snap_dir / f"result-{r}.json"
            if p.returncode != 0 or not result_file.exists():
                raise RuntimeError(f"{label}: worker failed (exit {p.returncode}):\n{(out + err)[-3000:]}")
            found.append(json.loads(result_file.read_text()))
        if any("refused" in f for f in found):
            result.refused = next(f["refused"] for f in found if "refused" in f)
            return result
        found.sort(key=lambda f: f["rank"])
        result.t0 = found[0]["t0"]
        result.timelines = [f["timeline"] for f in found]
        result.end = found[0]["timeline"][-1][0]
        result.snaps = found[0]["snaps"]
        result.updates, result.dropped = found[0]["updates"], max(f["dropped"] for f in found)
        result.snap_dir = snap_dir
        return result
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        if result.snap_dir is None:
            shutil.rmtree(snap_dir, ignore_errors=True)


# ------------------------------------------------------------------ reading a run
class Evaluator:
    """Evaluation losses of a run's snapshots (after the run, in the launcher: no worker's time is
    spent on it)."""

    def __init__(self, a):
        import torch
        self.torch = torch
        torch.set_num_threads(1)
        from p2ptrain.tasks import seeded_generator, synthetic

        self.task = build(argparse.Namespace(model_size=a.model_size, batch_size=a.batch_size, device_ms=0))[0]
        # (the task's validation set is drawn so: these are its first EVAL_SAMPLES)
        self.x, self.y = synthetic.Teacher(0).batch(EVAL_SAMPLES, seeded_generator(0, "synthetic-validation"))

    def loss(self, path: str) -> float:
        import numpy as np
        import torch.nn.functional as F
        flat = self.torch.from_numpy(np.fromfile(path, dtype=np.float32))
        with self.torch.no_grad():
            self.torch.nn.utils.vector_to_parameters(flat, self.task.model.parameters())
            return float(F.cross_entropy(self.task.model(self.x), self.y))


def smoothed(losses: list[float], width: int = SMOOTH) -> list[float]:
    """The centered running mean of ``width`` snapshots' losses; near the ends, of as many on each
    side as there are (the first snapshot alone: a falling curve's mean is not pulled down early)."""
    out = []
    for i in range(len(losses)):
        h = min(width // 2, i, len(losses) - 1 - i)
        out.append(statistics.fmean(losses[i - h:i + h + 1]))
    return out


def crossing(times: list[float], loss: list[float], target: float, t0: float) -> float | None:
    """Seconds from ``t0`` until the smoothed ``loss`` first falls below ``target`` (interpolated
    between two snapshots; None: never)."""
    k = next((i for i, v in enumerate(loss) if v < target), None)
    if k is None:
        return None
    if k == 0:
        return times[0] - t0
    f = (loss[k - 1] - target) / max(loss[k - 1] - loss[k], 1e-12)
    return times[k - 1] - t0 + f * (times[k] - times[k - 1])


def read_run(ev: Evaluator, res: Result, target: float, samples: int, also: tuple[float, ...] = ()) -> dict:
    """Time to ``target`` (and to each of ``also``) and the loss at ``samples``, all read on the
    smoothed losses of every snapshot (the module docstring says why)."""
    snaps = res.snaps
    out = {"samples_per_s": res.samples_per_s(), "seconds": res.end - res.t0, "time_to_target": None,
           "loss_at_samples": None, "final_loss": None, "updates": res.updates, "dropped": res.dropped}
    if not snaps:
        return out
    raw = [ev.loss(path) for _, path in snaps]
    loss = smoothed(raw)
    times = [t for t, _ in snaps]
    out["final_loss"] = statistics.fmean(raw[-SMOOTH:])
    out["time_to_target"] = crossing(times, loss, target, res.t0)
    out["times_to"] = {f"{t:g}": crossing(times, loss, t, res.t0) for t in also}
    counts = [res.samples_at(t) for t in times]
    out["curve"] = [[t - res.t0, v, c] for t, v, c in zip(times, raw, counts)]  # (--json only: per snapshot)
    k = next((i for i, c in enumerate(counts) if c >= samples), None)
    if k is not None and k > 0:
        f = (samples - counts[k - 1]) / max(counts[k] - counts[k - 1], 1e-9)
        out["loss_at_samples"] = loss[k - 1] + f * (loss[k] - loss[k - 1])
    elif k == 0:
        out["loss_at_samples"] = loss[0]
    return out


# ------------------------------------------------------------------ launcher
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", default="2", help="peer counts, comma-separated, the last peer slow (default 2)")
    p.add_argument("--slow", default="3.7,10", help="how much slower the slow peer is, comma-separated factors "
                   "of the fast peer's step time (default 3.7,10)")
    p.add_argument("--delay", type=float, help="the slow peer's sleep per step in seconds (overrides the "
                   "factor's; with one --slow value)")
    p.add_argument("--runs", default=DEFAULT_RUNS, help="';'-separated flag sets, one row each (default: "
                   f"{DEFAULT_RUNS!r})")
    p.add_argument("--model", default="9m", choices=sorted(MODELS))
    p.add_argument("--batch-size", type=int, help="samples a step on each peer (default 64; 8 with --gpu-like)")
    p.add_argument("--target", type=float, help="evaluation loss to reach (default: the model's)")
    p.add_argument("--also", default="", help="more target losses, comma-separated: a second table of the time "
                   "to each against the fast alone's (an early target and a late one can rank the modes apart)")
    p.add_argument("--samples", type=int, help="the loss @ S column's S, in all peers' samples (default: the model's)")
    p.add_argument("--seconds", type=float, help="each run's duration (default: the model's)")
    p.add_argument("--slow-seconds", type=float, default=15.0, help="the slow peer alone, for its samples/s")
    p.add_argument("--eval-period", type=float, default=1.0, help="seconds between rank 0's snapshots")
    p.add_argument("--device-ms", type=float, default=0.0, help="emulated device time per step on every peer "
                   "(bench/train.py's: the host idle, as while a GPU computes)")
    p.add_argument("--gpu-like", action="store_true", help="a GPU's regime: little compute a step (batch 8 unless "
                   "--batch-size) and 30 ms of emulated device time; with --netns, the wire decides")
    p.add_argument("--netns", metavar="RATE", help="each peer on an emulated host, links capped at RATE (root)")
    p.add_argument("--no-reference", dest="reference", action="store_false", help="skip the sync fp32 runs")
    p.add_argument("--control", action="store_true", help="a row of the fast peers alone stepping on K batches "
                   "at a time, K the factor rounded: larger updates without the slower machine")
    p.add_argument("--reps", type=int, default=1, help="repetitions, interleaved; each row shows the median")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds past a run's duration before it is killed")
    p.add_argument("--quick", action="store_true", help="the 1m model, a few seconds a run (the CI smoke run)")
    p.add_argument("--json", help="write the rows to this file, each with its curve: [seconds, raw loss, samples] per snapshot")
    for hidden in ("--worker",):
        p.add_argument(hidden, action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--accumulate", type=int, default=1, help=argparse.SUPPRESS)
    for hidden in ("--rank", "--max-rounds"):
        p.add_argument(hidden, type=int, default=0, help=argparse.SUPPRESS)
    for hidden in ("--addrs", "--flags", "--snapshots", "--result"):
        p.add_argument(hidden, help=argparse.SUPPRESS)
    p.add_argument("--model-size", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        _worker(a)
        return 0
    _common.finally_on_sigterm()  # (stopped, it still kills its workers)
    model = dict(MODELS["1m" if a.quick else a.model])
    if a.quick:
        model.update(seconds=2.0, samples=1000, target=1.5)
        a.slow_seconds, a.eval_period = 1.5, 0.5
    if a.gpu_like:
        a.batch_size, a.device_ms = a.batch_size or 8, a.device_ms or 30.0
    a.batch_size = a.batch_size or 64
    a.model_size = model["size"]
    a.target = a.target if a.target is not None else model["target"]
    a.samples = a.samples or model["samples"]
    a.seconds = a.seconds or model["seconds"]
    try:
        ns = [int(x) for x in a.n.split(",")]
        factors = [float(x) for x in a.slow.split(",")]
        runs = [r.strip() for r in a.runs.split(";") if r.strip()]
        a.also = tuple(float(x) for x in a.also.split(",") if x.strip())
        for r in runs:
            peer_keywords(r)
    except (ValueError, argparse.ArgumentError) as e:
        p.error(f"--n, --slow or --runs: {e}")
    if any(n < 2 for n in ns) or any(f < 1 for f in factors) or (a.delay is not None and len(factors) != 1):
        p.error("--n values must be >= 2, --slow factors >= 1, and --delay goes with one --slow value")
    a.tmp = tempfile.mkdtemp(prefix="p2pt-uneven-")
    try:
        return _measure(a, ns, factors, runs)
    finally:
        shutil.rmtree(a.tmp, ignore_errors=True)


def _measure(a, ns: list[int], factors: list[float], runs: list[str]) -> int:
    import netns

    ev = Evaluator(a)
    rows: list[dict] = []

    def measure(res: Result, **extra) -> dict:
        row = {"label": res.label, "n": res.n, **extra}
        if res.refused:
            row["refused"] = res.refused
        else:
            try:
                row.update(read_run(ev, res, a.target, a.samples, a.also))
            finally:
                shutil.rmtree(res.snap_dir, ignore_errors=True)
        print(f"  { {k: v for k, v in row.items() if k != 'curve'} }", file=sys.stderr, flush=True)
        return row

    sync0 = "--staleness 0 --compression none"
    for n in ns:
        lan = netns.EmulatedLan(n_hosts=n, rate=a.netns) if a.netns else None
        try:
            if lan is not None:
                lan.start()
            for _ in range(a.reps):
                alone = measure(run_peers(a, f"fast alone ({n - 1} peer{'s' * (n > 2)})", n - 1, sync0,
                                          [0.0] * (n - 1), lan=lan, group=n),
                                factor=None)
                rows.append(alone)
                step_s = a.batch_size / max(alone["samples_per_s"] / (n - 1), 1e-9)
                for factor in factors:
                    delay = a.delay if a.delay is not None else (factor - 1) * step_s
                    slow = measure(run_peers(a, "slow alone", 1, sync0, [delay], lan=lan, seconds=a.slow_seconds,
                                             snapshots=False, group=n), factor=factor, delay=delay)
                    slow.update(time_to_target=None, loss_at_samples=None, final_loss=None)
                    rows.append(slow)
                    for flags in runs:
                        row = measure(run_peers(a, flags, n, flags, [0.0] * (n - 1) + [delay], lan=lan),
                                      factor=factor, delay=delay)
                        row["vs_sum"] = _ratio(row.get("samples_per_s"),
                                               (alone["samples_per_s"] + slow["samples_per_s"]))
                        rows.append(_against(row, alone))
                    if a.control:
                        k = max(1, round(factor))
                        rows.append(_against(measure(run_peers(a, f"fast alone, {k} batches a step", n - 1, sync0,
                                                               [0.0] * (n - 1), lan=lan, group=n, accumulate=k),
                                                     factor=None), alone))
                if a.reference:
                    rounds = max(2, -(-a.samples // (n * a.batch_size)))
                    rows.append(measure(run_peers(a, "sync fp32", n, sync0, [0.0] * n, lan=lan, max_rounds=rounds,
                                                  seconds=a.seconds * 4), factor=None))
        finally:
            if lan is not None:
                lan.close()
    _report(a, rows)
    return 0


def _against(row: dict, alone: dict) -> dict:
    """``row`` with its time to the target and to each ``--also`` loss over ``alone``'s."""
    row["vs_alone"] = _ratio(row.get("time_to_target"), alone.get("time_to_target"))
    row["vs_alone_at"] = {t: _ratio(x, alone.get("times_to", {}).get(t)) for t, x in row.get("times_to", {}).items()}
    return row


def _ratio(x, y):
    return None if x is None or not y else x / y


def _time_and_ratio(seconds, ratio) -> str:
    """A cell of the ``--also`` table: the time to a loss, and its ratio to the fast alone's."""
    if seconds is None:
        return "-"
    return f"{seconds:.1f} s" + ("" if ratio is None else f" ({ratio:.2f}x)")


def _report(a, rows: list[dict]) -> None:
    task = build(argparse.Namespace(model_size=a.model_size, batch_size=a.batch_size, device_ms=0))[0]
    print(f"model: {task.info}, AdamW, batch "
          f"{a.batch_size} a peer, target evaluation loss {a.target:g}, S = {a.samples} samples, runs of "
          f"{a.seconds:g} s, {a.netns or 'loopback'}" + (f", emulated device time {a.device_ms:g} ms a step"
                                                           if a.device_ms else ""))
    refs = {r["n"]: r.get("loss_at_samples") for r in rows if r["label"] == "sync fp32"}
    out = []
    for r in rows:
        fmt = lambda v, f: "-" if v is None else f.format(v)  # noqa: E731
        if r.get("refused"):
            out.append([r["n"], r["label"], fmt(r.get("factor"), "{:g}x"), "refused: " + r["refused"][:90],
                        *["-"] * 7])
            continue
        ref = refs.get(r["n"])
        slow = "-" if r.get("factor") is None else f"{r['factor']:g}x ({r['delay']:.2f} s)"
        out.append([r["n"], r["label"], slow,
                    fmt(r.get("time_to_target"), "{:.1f} s"), fmt(r.get("vs_alone"), "{:.2f}"),
                    fmt(r.get("samples_per_s"), "{:.0f}"), fmt(r.get("vs_sum"), "{:.2f}"),
                    fmt(r.get("loss_at_samples"), "{:.4f}"),
                    fmt(_ratio(r.get("loss_at_samples"), ref) if r["label"] != "sync fp32" else None, "{:.3f}"),
                    fmt(r.get("final_loss"), "{:.4f}"), f"{r.get('updates', 0)}"])
    print(_common.table(out, ["N", "run", "slow", "time to loss", "time / fast", "samples/s", "vs sum alone",
                              "loss @ S", "vs sync", "final loss", "updates"]))
    if a.also:
        keys = [f"{t:g}" for t in a.also]
        more = [[r["n"], r["label"], "-" if r.get("factor") is None else f"{r['factor']:g}x",
                 *[_time_and_ratio(r.get("times_to", {}).get(k), r.get("vs_alone_at", {}).get(k)) for k in keys]]
                for r in rows if not r.get("refused") and r["label"] != "slow alone"]
        print(_common.table(more, ["N", "run", "slow", *[f"to {k}" for k in keys]]))
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    sys.exit(main())
