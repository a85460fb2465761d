"""Synchronous training at little compute per parameter (the GPU regime, on a CPU): p2ptrain
beside DDP over gloo, and beside the same steps with no communication, in the same run.

    python bench/train.py                                  # N = 2 on loopback, fp32, 10 M parameters, batch 8
    python bench/train.py --n 2,4 --codecs none,int8 --netns 1gbit
    python bench/train.py --device cuda --steps 200        # on a GPU machine (peers share the device)
    python bench/train.py --quick                          # seconds: the CI smoke run
    python bench/train.py --modes ddp,p2ptrain,overlap --device-ms 60   # overlap, with a GPU's idle host

The model is a deep MLP (``--depth`` linear layers of ``--width``; the defaults give 10.0 M
parameters, 40 MB of fp32 gradients, in ten layers of about 1 M, so that gradients arrive in
order through backward as a transformer's do), AdamW, batches of ``--batch-size`` (default 8)
labelled by a fixed random teacher. At batch 8 a step's compute is a few milliseconds and its
gradient tens of megabytes: as on a GPU, the wire and whatever a round does over the whole
vector decide the speed, not the arithmetic.

Rows, per N and codec: ``ddp`` (DistributedDataParallel, gloo, fp32), ``p2ptrain`` (the
synchronous ``p2ptrain.Peer`` at ``--staleness``, default 0, with the codec), and ``alone``
(each process runs the same steps with no communication at all: the floor). Every process
runs ``--warmup`` steps, then ``--steps`` timed ones; a run's time is the slowest process's,
a row's the median of ``--reps`` runs, the modes interleaved. ``cpu ms / step`` is the CPU
time a process spent per timed step (all its threads; the mean over processes, in that
median run): on a shared machine it says what each mode costs when wall times swing.
``loss`` is the evaluation loss after the run (rank 0's; at staleness 0 and fp32 p2ptrain's
equals DDP's: the same mathematics, so equal steps are equal time to a loss). ``overlap`` is
p2ptrain with ``overlap=True`` (the ring starts on the gradients backward made first).

``--device-ms T`` emulates a device that computes while the host waits (a GPU): every step's
forward and backward also sleep T ms in all (a third in forward, two thirds in backward, spread
over the layers, between them), the host's cores idle meanwhile, as while a GPU computes. What
overlaps with backward (DDP's bucketed allreduce, p2ptrain's ``overlap``) runs in that time; on
these 2 cores real backward leaves no core idle for it. An emulation: it shows the scheduling,
not a GPU's figures.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common  # noqa: E402

MARK = "P2PT_TRAIN "
_KEPT: list = []  # objects a worker never frees (see the ddp mode)
P2PTRAIN_MODES = ("p2ptrain", "overlap")
INPUTS, CLASSES = 64, 10


# ------------------------------------------------------------------ worker (one per process)
def _model(a):
    import torch.nn as nn
    wait = [_DeviceTime(a.device_ms / a.depth)] if getattr(a, "device_ms", 0) else []
    layers = [nn.Linear(INPUTS, a.width), nn.ReLU(), *wait]
    for _ in range(a.depth - 2):
        layers += [nn.Linear(a.width, a.width), nn.ReLU(), *wait]
    return nn.Sequential(*layers, nn.Linear(a.width, CLASSES))


def _DeviceTime(ms: float):
    """A layer that sleeps ms/3 in forward and 2ms/3 in backward, values unchanged (``--device-ms``)."""
    import torch

    class Sleep(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            time.sleep(ms / 3e3)
            return x.view_as(x)

        @staticmethod
        def backward(ctx, g):
            time.sleep(2 * ms / 3e3)
            return g

    class DeviceTime(torch.nn.Module):
        def forward(self, x):
            return Sleep.apply(x)
    return DeviceTime()


def _data(a, rank: int, device):
    """Batches for ``rank`` (its own stream, the same in every mode) and a fixed evaluation set."""
    import torch
    gen = torch.Generator().manual_seed(12345)
    teacher = torch.randn(INPUTS, CLASSES, generator=gen)
    gen.manual_seed(1000 + rank)
    batches = []
    for _ in range(a.warmup + a.steps):
        x = torch.randn(a.batch_size, INPUTS, generator=gen)
        batches.append((x.to(device), (x @ teacher).argmax(1).to(device)))
    xe = torch.randn(1024, INPUTS, generator=torch.Generator().manual_seed(7))
    return batches, (xe.to(device), (xe @ teacher).argmax(1).to(device))


def _minor_faults() -> int:
    """Pages this process touched for the first time (a fresh large tensor faults its pages in,
    about 13 ms per 40 MB on a CPU); 0 where the OS does not count them."""
    try:
        import resource
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    except (ImportError, AttributeError):  # (Windows)
        return 0


def _worker(a) -> None:
    import torch
    import torch.nn.functional as F

    from p2ptrain.device import pick_device, synchronize

    torch.set_num_threads(a.threads)
    device = pick_device(a.device)
    torch.manual_seed(0)
    model = _model(a).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches, (xe, ye) = _data(a, a.rank, device)
    addrs = a.addrs.split(",")

    def run(step) -> float:
        for x, y in batches[: a.warmup]:
            step(x, y)
        synchronize(device)
        t0, c0, f0 = time.perf_counter(), time.process_time(), _minor_faults()
        for x, y in batches[a.warmup:]:
            step(x, y)
        synchronize(device)  # note: a sync point, so the clock sees the device's work
        extra["cpu_s"] = time.process_time() - c0  # (every thread of this process)
        extra["faults"] = _minor_faults() - f0
        return time.perf_counter() - t0

    extra: dict = {}
    if a.mode == "alone":
        def step(x, y):
            optimizer.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
        seconds = run(step)
    elif a.mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel
        host, port = addrs[0].rsplit(":", 1)
        with _common.gloo_group(host, int(port), a.rank, len(addrs), 300):
            ddp = DistributedDataParallel(model)
            # Never freed (the worker leaves by os._exit): freeing it joins gloo's thread, which
            # waits for the GIL its freeing holds (a CI run hung so, 2026-11-29, in ~Reducer).
            _KEPT.append(ddp)

            def step(x, y):
                optimizer.zero_grad(set_to_none=True)
                F.cross_entropy(ddp(x), y).backward()
                optimizer.step()
            seconds = run(step)
    else:
        import p2ptrain
        from p2ptrain.trace import NO_TRACE, Tracer
        with p2ptrain.Peer(model, optimizer, listen=addrs[a.rank], peers=[p for p in addrs if p != addrs[a.rank]],
                           discovery=False, min_peers=len(addrs), secret="bench", staleness=a.staleness,
                           compression=a.codec, reconcile_every=a.reconcile_every,
                           **({"overlap": True} if a.mode == "overlap" else {})) as peer:  # (older trees lack it)
            trace = NO_TRACE
            if a.trace:
                trace = peer.cluster.trace = Tracer(str(Path(a.trace) / f"rank{a.rank}.json"), f"rank {a.rank}")
                began = []
                optimizer.register_step_pre_hook(lambda *_: began.append(trace.now()))
                optimizer.register_step_post_hook(lambda *_: trace.span("optimizer", "apply", began.pop(), trace.now()))

            def step(x, y):
                with trace("batch", "compute"):
                    F.cross_entropy(model(x), y).backward()
                with trace("step", "compute"):
                    peer.step(batch_size=len(x))
            seconds = run(step)
            extra.update(updates=peer.version, wire_bytes=peer.cluster.wire_bytes)
        if a.trace:
            trace.write()
    with torch.no_grad():
        loss = float(F.cross_entropy(model(xe), ye))
    print(MARK + json.dumps({"seconds": seconds, "loss": loss, **extra}), flush=True)


# ------------------------------------------------------------------ launcher
def run_mode(a, mode: str, n: int, codec: str = "none", lan=None, tree: str | None = None) -> dict:
    """Launch n processes of one mode (locally, or one per host of ``lan``); the slowest's time."""
    if lan is not None:
        addrs = [f"{h.addr}:{29700 + i}" for i, h in enumerate(lan.hosts[:n])]
    else:
        base = _common.free_port()
        addrs = [f"127.0.0.1:{base + i}" for i in range(n)]
    cmd = [sys.executable, __file__, "--worker", "--mode", mode, "--addrs", ",".join(addrs), "--codec", codec,
           "--width", str(a.width), "--depth", str(a.depth), "--batch-size", str(a.batch_size),
           "--steps", str(a.steps), "--warmup", str(a.warmup), "--device", a.device, "--threads", str(a.threads),
           "--staleness", str(a.staleness), "--reconcile-every", str(a.reconcile_every),
           "--device-ms", str(a.device_ms)]
    if a.trace and mode in P2PTRAIN_MODES:
        trace_dir = Path(a.trace) / f"n{n}-{mode}{'-baseline' if tree else ''}-{codec}"
        trace_dir.mkdir(parents=True, exist_ok=True)
        cmd += ["--trace", str(trace_dir.resolve())]
    from p2ptrain.commands.heap import with_kept_heap

    # (every mode on the heap ``join`` gives itself: no step faults in fresh pages, as on a GPU)
    env = with_kept_heap(dict(os.environ, PYTHONPATH=tree or str(Path(__file__).resolve().parents[1]),
                              OMP_NUM_THREADS=str(a.threads)))
    procs = []
    try:
        for r in range(n):
            argv = cmd + ["--rank", str(r)]
            if lan is not None:
                envr = dict(env, GLOO_SOCKET_IFNAME=lan.hosts[r].ifname)
                procs.append(lan.popen(r, argv, env=envr, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
            else:
                procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                              text=True))
        outs = [p.communicate(timeout=a.timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    results = []
    for p, out in zip(procs, outs):
        line = next((l for l in out.splitlines() if l.startswith(MARK)), None)
        if p.returncode != 0 or line is None:
            raise RuntimeError(f"{mode} worker failed (exit {p.returncode}):\n{out[-3000:]}")
        results.append(json.loads(line[len(MARK):]))
    seconds = max(r["seconds"] for r in results)
    return {"mode": mode if tree is None else f"{mode} (baseline)", "n": n,
            "codec": codec if mode in P2PTRAIN_MODES else "fp32" if mode == "ddp" else "-",
            "seconds": seconds, "steps_per_s": a.steps / seconds, "loss": results[0]["loss"],
            "cpu_ms_per_step": 1e3 * sum(r["cpu_s"] for r in results) / len(results) / a.steps,
            "faults_per_step": sum(r.get("faults", 0) for r in results) / len(results) / a.steps,
            "wire_bytes": results[0].get("wire_bytes")}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", default="2", help="process counts, comma-separated (default 2)")
    p.add_argument("--codecs", default="none", help="p2ptrain codecs, comma-separated (default none)")
    p.add_argument("--netns", metavar="RATE", help="run across network namespaces capped at RATE (e.g. 1gbit)")
    p.add_argument("--width", type=int, default=1000)
    p.add_argument("--depth", type=int, default=12)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--reps", type=int, default=3, help="runs per mode, interleaved; the median is shown")
    p.add_argument("--staleness", type=int, default=0)
    p.add_argument("--reconcile-every", type=int, default=10,
                   help="p2ptrain's reconcile_every (default 10, the library's: a parameter sketch every 10 updates)")
    p.add_argument("--device", default="cpu", help="cpu, cuda, mps, auto (every process on it)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--modes", default="ddp,p2ptrain,alone", help="of ddp, p2ptrain, overlap (p2ptrain with "
                   "overlap=True), alone")
    p.add_argument("--device-ms", type=float, default=0.0, help="emulated device time per step (see the docstring)")
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--quick", action="store_true", help="a tiny model, a few steps")
    p.add_argument("--json", help="write the rows to this file")
    p.add_argument("--trace", metavar="DIR", help="p2ptrain workers write Chrome traces here "
                   "(DIR/nN-MODE-CODEC/rankR.json; "
                                                  "the last run of each kept)")
    p.add_argument("--baseline-tree", help="also run p2ptrain (and overlap) from this source tree (before/after, "
                   "same run)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mode", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--addrs", help=argparse.SUPPRESS)
    p.add_argument("--codec", default="none", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        _worker(a)
        if a.mode == "ddp":  # (its figures are out: gloo's threads can hang the interpreter's exit)
            _common.exit_now(0)
        return 0
    _common.finally_on_sigterm()  # (stopped, it still kills its workers)
    if a.quick:
        a.width, a.depth, a.steps, a.warmup = 64, 3, 5, 2
    rows = []
    import netns
    for n in [int(x) for x in a.n.split(",")]:
        lan = netns.EmulatedLan(n_hosts=n, rate=a.netns) if a.netns else None
        try:
            if lan is not None:
                lan.start()
            runs: dict[tuple, list[dict]] = {}
            for _ in range(a.reps):  # interleaved: a busy machine slows every mode alike
                for mode in a.modes.split(","):
                    for codec in (a.codecs.split(",") if mode in P2PTRAIN_MODES else ["none"]):
                        runs.setdefault((mode, codec), []).append(run_mode(a, mode, n, codec, lan))
                        print(f"  {runs[(mode, codec)][-1]}", file=sys.stderr, flush=True)
                        if mode in P2PTRAIN_MODES and a.baseline_tree:
                            runs.setdefault((f"base {mode}", codec), []).append(
                                run_mode(a, mode, n, codec, lan, tree=a.baseline_tree))
                            print(f"  {runs[(f'base {mode}', codec)][-1]}", file=sys.stderr, flush=True)
            for rs in runs.values():
                rs.sort(key=lambda r: r["seconds"])
                rows.append(dict(rs[len(rs) // 2], rep_seconds=[r["seconds"] for r in rs]))
        finally:
            if lan is not None:
                lan.close()
    params = sum(p.numel() for p in _model(a).parameters())
    print(f"model: {params / 1e6:.1f} M parameters ({a.depth} layers of width {a.width}), batch {a.batch_size}, "
          f"{a.steps} timed steps, device {a.device}, {a.netns or 'loopback'}, staleness {a.staleness}"
          + (f", emulated device time {a.device_ms:g} ms a step" if a.device_ms else ""))
    ddp = {r["n"]: r["seconds"] for r in rows if r["mode"] == "ddp"}
    alone = {r["n"]: r["seconds"] for r in rows if r["mode"] == "alone"}
    out = [[r["n"], r["mode"], r["codec"], f"{r['seconds']:.2f} s", f"{r['steps_per_s']:.1f}",
            f"{r['seconds'] / ddp[r['n']]:.2f}" if r["n"] in ddp else "-",
            f"{r['seconds'] / alone[r['n']]:.2f}" if r["n"] in alone else "-", f"{r['cpu_ms_per_step']:.0f}",
            f"{r.get('faults_per_step', 0):.0f}", f"{r['loss']:.4f}"] for r in rows]
    print(_common.table(out, ["N", "mode", "codec", "time", "steps/s", "time / ddp", "time / alone",
                              "cpu ms / step", "faults / step", "loss"]))
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
