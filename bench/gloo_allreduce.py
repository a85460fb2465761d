"""The baseline: torch.distributed gloo allreduce of float32 tensors, N processes.

    python bench/gloo_allreduce.py --local 2 --sizes 1,16,64,256 --reps 5 --json out.json
    python bench/gloo_allreduce.py --netns 1gbit --hosts 4 --sizes 16,64
    python bench/gloo_allreduce.py --rates 1gbit,1gbit,100mbit --sizes 16

``--local N`` runs N processes on 127.0.0.1 (gloo on ``lo``); ``--netns RATE --hosts N``
runs one process per host of an ``EmulatedLan`` (see netns.py), gloo on ``eth0``, the
rendezvous on host 0's address. From Python (bench/ on sys.path)::

    from gloo_allreduce import run_gloo
    rows = run_gloo(4, [16, 64], reps=5, netns_rate="1gbit")   # or lan=<a running EmulatedLan>

Per size, each rep is: fill the tensor, barrier, time one ``allreduce`` on every rank;
the rep's time is the slowest rank's; we report the median over ``reps`` after
``warmup`` untimed reps. algbw = bytes / time, busbw = algbw * 2(N-1)/N (what each link
carries in a ring), ``busbw_frac_of_link`` = busbw / nominal tbf rate of the slowest link
(the TCP ceiling under tbf is about 0.956 of it).

Failure: any worker that exits non-zero or outlives the timeout gets every worker killed
and a RuntimeError with the tail of its output. Workers always die in ``finally``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Sequence

import _common
import netns

RESULT_MARK = "GLOO_RESULT "
PORT = 29500  # inside fresh namespaces any port is free


# ---------------------------------------------------------------- worker (one per rank)

def _worker(a: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # 2 cores, N processes: keep torch's own pool out of the way
    rows = []
    with _common.gloo_group(a.master, a.port, a.rank, a.world, a.timeout):
        for mib in _parse_sizes(a.sizes):
            nbytes = _size_bytes(mib)
            t = torch.empty(nbytes // 4, dtype=torch.float32)
            times = []
            for k in range(a.warmup + a.reps):
                t.fill_(1.0)
                dist.barrier()
                t0 = time.perf_counter()
                dist.all_reduce(t)
                dt = time.perf_counter() - t0
                if k == 0 and not (t[0].item() == a.world and t[-1].item() == a.world):
                    raise SystemExit(f"rank {a.rank}: wrong allreduce result {t[0].item()}")
                if k >= a.warmup:
                    times.append(dt)
            slowest = torch.tensor(times, dtype=torch.float64)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            rows.append({"size_bytes": nbytes, "times_s": slowest.tolist()})
            del t
    if a.rank == 0:
        print(RESULT_MARK + json.dumps(rows), flush=True)


# ---------------------------------------------------------------- launcher

def _parse_sizes(s: str | Sequence[float]) -> list[float]:
    if isinstance(s, str):
        s = [float(x) for x in s.split(",") if x.strip()]
    sizes = [float(x) for x in s]
    if not sizes or any(x <= 0 for x in sizes):
        raise ValueError(f"sizes must be positive MiB values, got {s!r}")
    return sizes


def _size_bytes(mib: float) -> int:
    return max(4, int(mib * _common.MiB) // 4 * 4)


def _default_timeout(n: int, sizes: list[float], reps: int, warmup: int,
                     link_bps: int | None) -> float:
    # Generous: assume half the link (or 100 MB/s on loopback) and triple it.
    rate = link_bps / 8 * 0.5 if link_bps else 100e6
    per_op = [2 * (n - 1) / n * _size_bytes(m) / rate for m in sizes]
    return 60 + 3 * sum((reps + warmup + 1) * t for t in per_op)


def run_gloo(n: int, sizes_mib: Sequence[float], reps: int, netns_rate: str | None = None,
             rates: Sequence[str | None] | None = None, *, warmup: int = 1,
             timeout_s: float | None = None, lan: "netns.EmulatedLan | None" = None
             ) -> list[dict]:
    """Measure gloo allreduce; one dict per size (keys below). Blocks; bounded by timeout_s.

    Where: ``lan`` (an already running EmulatedLan, hosts 0..n-1 used), else ``rates``
    (per host) or ``netns_rate`` (all hosts) build one for the call, else loopback.
    Dict keys: size_bytes, n, median_s, min_s, max_s, reps, algbw_Bps, busbw_Bps,
    link_bps (nominal bits/s of the slowest link, None on loopback or uncapped),
    busbw_frac_of_link, where ("loopback" or "netns").
    """
    if n < 2:
        raise ValueError("gloo allreduce needs n >= 2")
    if reps < 1 or warmup < 0:
        raise ValueError("reps must be >= 1 and warmup >= 0")
    sizes = _parse_sizes(sizes_mib)
    use_netns = lan is not None or rates is not None or netns_rate is not None
    if rates is not None and len(rates) != n:
        raise ValueError(f"{len(rates)} rates for n={n}")
    with ExitStack() as stack:
        if use_netns and lan is None:
            lan = stack.enter_context(netns.EmulatedLan(n, rates or [netns_rate] * n))
        if lan is not None and len(lan.hosts) < n:
            raise ValueError(f"lan has {len(lan.hosts)} hosts, need {n}")
        caps = ([netns.parse_rate(h.rate) for h in lan.hosts[:n] if h.rate is not None]
                if lan is not None else [])
        link_bps = min(caps) if caps else None
        if timeout_s is None:
            timeout_s = _default_timeout(n, sizes, reps, warmup, link_bps)
        master = lan.hosts[0].addr if lan is not None else "127.0.0.1"
        port = PORT if lan is not None else _common.free_port()
        rows = _launch(n, sizes, reps, warmup, timeout_s, lan, master, port)
    out = []
    for r in rows:
        med = _common.median(r["times_s"])
        algbw = r["size_bytes"] / med
        bus = _common.busbw(algbw, n)
        out.append({
            "size_bytes": r["size_bytes"], "n": n, "median_s": med,
            "min_s": min(r["times_s"]), "max_s": max(r["times_s"]), "reps": reps,
            "algbw_Bps": algbw, "busbw_Bps": bus, "link_bps": link_bps,
            "busbw_frac_of_link": bus * 8 / link_bps if link_bps else None,
            "where": "netns" if lan is not None else "loopback",
        })
    return out


def _launch(n, sizes, reps, warmup, timeout_s, lan, master, port) -> list[dict]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--_worker", "--world", str(n),
           "--master", master, "--port", str(port), "--sizes", ",".join(map(str, sizes)),
           "--reps", str(reps), "--warmup", str(warmup), "--timeout", str(timeout_s)]
    procs: list[subprocess.Popen] = []
    logs = []
    try:
        for rank in range(n):
            log = tempfile.TemporaryFile(mode="w+", prefix="gloo-allreduce-")
            logs.append(log)
            rcmd = [*cmd, "--rank", str(rank)]
            kw = dict(stdout=log, stderr=subprocess.STDOUT, text=True)
            if lan is not None:
                procs.append(lan.popen(rank, rcmd, env=_env(lan.env(rank)), **kw))
            else:
                env = _env(dict(os.environ, GLOO_SOCKET_IFNAME="lo"))
                procs.append(subprocess.Popen(rcmd, env=env, start_new_session=True, **kw))
        deadline = time.monotonic() + timeout_s
        while any(p.poll() is None for p in procs):
            bad = [i for i, p in enumerate(procs) if p.poll() not in (None, 0)]
            if bad:
                raise RuntimeError(f"gloo rank {bad[0]} exited with {procs[bad[0]].returncode}: "
                                   + _tail(logs[bad[0]]))
            if time.monotonic() > deadline:
                raise RuntimeError(f"gloo allreduce timed out after {timeout_s:.0f} s; rank 0: "
                                   + _tail(logs[0]))
            time.sleep(0.05)
        for i, p in enumerate(procs):
            if p.returncode != 0:
                raise RuntimeError(f"gloo rank {i} exited with {p.returncode}: " + _tail(logs[i]))
        logs[0].seek(0)
        for line in logs[0]:
            if line.startswith(RESULT_MARK):
                return json.loads(line[len(RESULT_MARK):])
        raise RuntimeError("gloo rank 0 printed no result: " + _tail(logs[0]))
    finally:
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait(timeout=10)
        for log in logs:
            log.close()


def _env(env: dict) -> dict:
    env = dict(env)
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env


def _tail(log, n: int = 800) -> str:
    log.seek(0)
    return log.read()[-n:].strip().replace("\n", " | ")


# ---------------------------------------------------------------- command line

def print_rows(rows: list[dict]) -> None:
    body = [[_common.fmt_size(r["size_bytes"]), r["n"], r["where"],
             f"{r['median_s'] * 1e3:.1f}", _common.fmt_rate(r["algbw_Bps"]),
             _common.fmt_rate(r["busbw_Bps"]),
             f"{r['busbw_frac_of_link']:.3f}" if r["busbw_frac_of_link"] else "-"]
            for r in rows]
    print(_common.table(body, ["size", "N", "where", "median ms", "algbw", "busbw",
                               "busbw / nominal link"]), flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = ap.add_mutually_exclusive_group()
    where.add_argument("--local", type=int, metavar="N", help="N processes on loopback")
    where.add_argument("--netns", metavar="RATE", help="an EmulatedLan capped at RATE")
    where.add_argument("--rates", help="an EmulatedLan with per-host caps, e.g. 1gbit,100mbit")
    ap.add_argument("--hosts", type=int, default=2, help="N for --netns")
    ap.add_argument("--sizes", default="1,16,64,256", help="MiB, comma-separated")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=None, help="seconds for the whole run")
    ap.add_argument("--json", help="write the result rows here")
    # worker mode (internal)
    ap.add_argument("--_worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--world", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--master", help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a._worker:
        _worker(a)
        return 0
    _common.finally_on_sigterm()  # (stopped, it still kills its workers)
    try:
        if a.rates:
            rates = [None if r.lower() == "none" else r for r in a.rates.split(",")]
            rows = run_gloo(len(rates), _parse_sizes(a.sizes), a.reps, rates=rates,
                            warmup=a.warmup, timeout_s=a.timeout)
        elif a.netns:
            rows = run_gloo(a.hosts, _parse_sizes(a.sizes), a.reps, netns_rate=a.netns,
                            warmup=a.warmup, timeout_s=a.timeout)
        else:
            rows = run_gloo(a.local or 2, _parse_sizes(a.sizes), a.reps, warmup=a.warmup,
                            timeout_s=a.timeout)
    except netns.NetnsUnavailable as e:
        print(f"gloo_allreduce: {e}", file=sys.stderr)
        return 2
    print_rows(rows)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
