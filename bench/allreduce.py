"""p2ptrain's ring-allreduce against torch.distributed gloo, same processes count, same sizes, same run.

    python bench/allreduce.py                                  # N = 2 and 4 on loopback, 1..256 MiB
    python bench/allreduce.py --n 2 --sizes 64,256 --reps 5
    python bench/allreduce.py --netns 1gbit --n 2,4 --sizes 16,64
    python bench/allreduce.py --codecs none,int8,topk:0.01 --netns 1gbit --n 2
    python bench/allreduce.py --quick                          # seconds: CI smoke run
    python bench/allreduce.py --tls --n 2 --sizes 64 --no-gloo # each run also over mutual TLS

Per size and codec, every rep is: a tiny allreduce as a barrier, then one timed allreduce
on every peer; a rep's time is the slowest peer's; we print the median over ``--reps``
after one warm-up. algbw = fp32 bytes / time (for a codec: the fp32 bytes it averaged, its
"effective" bandwidth), busbw = algbw * 2(N-1)/N. ``--tls`` runs each p2ptrain case twice
in turn, plain and over mutual TLS (certificates from ``tls-init`` in a scratch folder, the
same secret inside): what encryption costs. With ``--netns RATE`` the peers run in
network namespaces whose links are capped at RATE (bench/netns.py) and the table adds busbw
as a fraction of the link rate. The last column is p2ptrain's busbw over gloo's fp32 busbw.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common  # noqa: E402

MARK = "P2PT_RESULT "
PORT = 29600


# ------------------------------------------------------------------ worker (one per peer)
async def _worker(a) -> None:
    import numpy as np
    import torch

    from p2ptrain.collective.group import Group
    from p2ptrain.net.transport import install_uvloop  # noqa: F401  (policy chosen before run)

    torch.set_num_threads(1)
    addrs = a.addrs.split(",")
    rows = []
    tracer = None
    if a.trace:  # (perf_counter is the machine's monotonic clock: the ranks' traces line up)
        from p2ptrain.trace import Tracer
        tracer = Tracer(f"{a.trace}-rank{a.rank}.json", process=f"rank {a.rank}")
    tls = {}
    if a.tls_dir:
        host = os.path.join(a.tls_dir, f"rank{a.rank}")
        tls = {"tls_cert": os.path.join(host, f"rank{a.rank}.pem"), "tls_key": os.path.join(host, f"rank{a.rank}.key"),
               "tls_ca": os.path.join(host, "ca.pem")}
    async with Group(listen=addrs[a.rank], peers=addrs, connect_timeout=60, timeout=300,
                     secret="bench", **tls, **({} if a.chunk_kib is None else {"chunk_bytes": a.chunk_kib * 1024}),
                     **({} if tracer is None else {"trace": tracer}),
                     codec_threads=None if a.threads is None else int(a.threads)) as g:
        barrier = torch.zeros(1)
        for codec in a.codecs.split(","):
            for mib in [float(s) for s in a.sizes.split(",")]:
                n = int(mib * (1 << 20)) // 4
                rng = np.random.default_rng(a.rank)
                base = torch.from_numpy(rng.standard_normal(n, dtype=np.float32))
                x = base.clone()
                times, cpus, kernel = [], [], []
                for rep in range(a.reps + 1):
                    x.copy_(base)
                    await g.allreduce(barrier)
                    t0, c0, k0 = time.perf_counter(), time.process_time(), os.times().system
                    await g.allreduce(x, compression=codec)
                    if rep:
                        times.append(time.perf_counter() - t0)
                        cpus.append(time.process_time() - c0)
                        kernel.append(os.times().system - k0)  # (clock ticks: 10 ms; medians of sums)
                stats = g.last_stats
                rows.append({"codec": codec, "size_bytes": n * 4, "times": times, "cpus": cpus, "kernel": kernel,
                             "wire_bytes": stats.wire_bytes, "raw_bytes": stats.raw_bytes,
                             "checksum": float(x[:: max(1, n // 4096)].double().sum())})
    if tracer is not None:
        tracer.write()
    print(MARK + json.dumps(rows), flush=True)


def _run_worker(a) -> None:
    if a.uvloop:
        from p2ptrain.net.transport import install_uvloop
        install_uvloop()
    asyncio.run(_worker(a))


# ------------------------------------------------------------------ launcher
def _collect(outputs: list[str], n: int, link_bps: float | None) -> list[dict]:
    per_rank = []
    for out in outputs:
        line = next((l for l in out.splitlines() if l.startswith(MARK)), None)
        if line is None:
            raise RuntimeError("a p2ptrain worker printed no result:\n" + out[-2000:])
        per_rank.append(json.loads(line[len(MARK):]))
    rows = []
    for i, first in enumerate(per_rank[0]):
        slowest = [max(r[i]["times"][k] for r in per_rank) for k in range(len(first["times"]))]
        t = _common.median(slowest)
        algbw = first["size_bytes"] / t
        checks = {r[i]["checksum"] for r in per_rank}
        cpus = [r[i].get("cpus") for r in per_rank]  # (absent from an older worker)
        cpu = _common.median([sum(c[k] for c in cpus) / n for k in range(len(cpus[0]))]) if all(cpus) else None
        kernel = [r[i].get("kernel") for r in per_rank]  # (absent from an older worker)
        kernel = _common.median([sum(c[k] for c in kernel) / n for k in range(len(kernel[0]))]) if all(kernel) else None
        rows.append({"impl": "p2ptrain", "codec": first["codec"], "n": n, "size_bytes": first["size_bytes"],
                     "median_s": t, "algbw_Bps": algbw, "busbw_Bps": _common.busbw(algbw, n),
                     "ratio": first["raw_bytes"] / max(1, first["wire_bytes"]) if first["wire_bytes"] else None,
                     "identical": len(checks) == 1, "link_bps": link_bps, "rep_times_s": slowest,
                     "cpu_per_peer_s": cpu, "kernel_per_peer_s": kernel})
    return rows


def run_p2ptrain(n: int, sizes: list[float], reps: int, codecs: list[str], lan=None, uvloop=True,
                 timeout: float = 900, chunk_kib: int | None = None, threads: int | None = None,
                 tree: str | None = None, trace_dir: str | None = None, tls_dir: str | None = None) -> list[dict]:
    """Launch n worker processes (locally, or one per host of ``lan``) and gather their rows.

    ``tls_dir``: a ``tls-init`` folder with hosts rank0, rank1, ...: the links use mutual TLS.

    ``tree``: import p2ptrain from that source tree instead of this one (a baseline).
    ``trace_dir``: each worker writes its Chrome trace there (a later run of the same N overwrites)."""
    if lan is not None:
        addrs = [f"{h.addr}:{PORT}" for h in lan.hosts[:n]]
    else:
        base = _common.free_port()
        addrs = [f"127.0.0.1:{base + i}" for i in range(n)]
    cmd = [sys.executable, __file__, "--worker", "--addrs", ",".join(addrs), "--sizes",
           ",".join(str(s) for s in sizes), "--reps", str(reps), "--codecs", ",".join(codecs),
           ] + ([] if chunk_kib is None else ["--chunk-kib", str(chunk_kib)]) + (
               [] if threads is None else ["--threads", str(threads)])
    if not uvloop:
        cmd.append("--no-uvloop")
    if tls_dir is not None:
        cmd += ["--tls-dir", tls_dir]
    if trace_dir is not None:
        os.makedirs(trace_dir, exist_ok=True)
        cmd += ["--trace", os.path.join(trace_dir, f"n{n}" + ("" if threads is None else f"-t{threads}")
                                        + ("" if tree is None else "-baseline"))]
    env = dict(os.environ, PYTHONPATH=str(Path(tree or Path(__file__).resolve().parents[1]).resolve()),
               OMP_NUM_THREADS="1")
    procs = []
    try:
        for r in range(n):
            argv = cmd + ["--rank", str(r)]
            if lan is not None:
                procs.append(lan.popen(r, argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
            else:
                procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        outputs = [p.communicate(timeout=timeout)[0] for p in procs]
        for p, out in zip(procs, outputs):
            if p.returncode != 0:
                raise RuntimeError(f"p2ptrain worker failed (exit {p.returncode}):\n{out[-3000:]}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    link = None
    if lan is not None:
        import netns
        caps = [netns.parse_rate(h.rate) for h in lan.hosts[:n] if h.rate is not None]
        link = min(caps) if caps else None
    rows = _collect(outputs, n, link)
    if threads is not None:
        for r in rows:
            r["impl"], r["threads"] = f"p2ptrain t{threads}", threads
    if tree is not None:
        for r in rows:
            r["impl"] += " (baseline)"
    if tls_dir is not None:
        for r in rows:
            r["impl"] += " tls"
    return rows


def make_certs(folder: str, n: int) -> str:
    """A CA and certificates for hosts rank0..rank{n-1} in ``folder`` (``tls-init``), for ``--tls``."""
    from p2ptrain.commands import tls_init

    if not os.path.exists(os.path.join(folder, "rank0")):
        tls_init.make(folder, [f"rank{i}" for i in range(n)], 1, tls_init.openssl_command())
    return folder


def _cpu(r: dict) -> str:
    """CPU a peer a call, and the part of it in the kernel (the sockets: a CPU-bound ring's other cost)."""
    if r.get("cpu_per_peer_s") is None:
        return "-"
    k = r.get("kernel_per_peer_s")
    return f"{r['cpu_per_peer_s'] * 1e3:.1f} ms" + (f" (kernel {k * 1e3:.0f})" if k is not None else "")


def _print(rows: list[dict], gloo: dict) -> None:
    head = ["N", "size", "impl", "codec", "median", "cpu / peer (kernel)", "algbw", "busbw", "of link", "wire ratio", "identical",
            "busbw / gloo"]
    out = []
    for r in rows:
        g = gloo.get((r["n"], r["size_bytes"]))
        frac = f"{r['busbw_Bps'] * 8 / r['link_bps']:.3f}" if r.get("link_bps") else "-"
        vs = f"{r['busbw_Bps'] / g['busbw_Bps']:.2f}" if g and r["impl"].startswith("p2ptrain") else "-"
        ratio = f"{r['ratio']:.1f}x" if r.get("ratio") else "-"
        out.append([r["n"], _common.fmt_size(r["size_bytes"]), r["impl"], r.get("codec", "fp32"),
                    f"{r['median_s'] * 1e3:.1f} ms",
                    _cpu(r),
                    _common.fmt_rate(r["algbw_Bps"]),
                    _common.fmt_rate(r["busbw_Bps"]), frac, ratio, r.get("identical", "-"), vs])
    print(_common.table(out, head))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", default="2,4", help="peer counts, comma-separated (default 2,4)")
    p.add_argument("--sizes", default="1,16,64,256", help="MiB, comma-separated (default 1,16,64,256)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--codecs", default="none", help="p2ptrain codecs, comma-separated (default none)")
    p.add_argument("--netns", metavar="RATE", help="run across network namespaces capped at RATE (e.g. 1gbit)")
    p.add_argument("--rates", help="per-host rates for a mixed LAN, e.g. 1gbit,1gbit,100mbit")
    p.add_argument("--no-gloo", action="store_true", help="skip the gloo baseline")
    p.add_argument("--chunk-kib", type=int, default=None, help="p2ptrain's largest chunk in KiB (default: Group's)")
    p.add_argument("--no-uvloop", dest="uvloop", action="store_false")
    p.add_argument("--tls", action="store_true", help="run each p2ptrain case plain and over mutual TLS, in turn")
    p.add_argument("--tls-dir", help=argparse.SUPPRESS)  # (a worker's certificates)
    p.add_argument("--threads", default=None, help="data-path threads per peer, comma-separated to compare "
                   "(default: the machine's rule, p2ptrain.collective.pool)")
    p.add_argument("--baseline-tree", help="also run p2ptrain from this source tree, before this one "
                   "(before/after in the same run)")
    p.add_argument("--rounds", type=int, default=1, help="repeat the p2ptrain runs (baseline and this tree "
                   "interleaved) this many times (default 1)")
    p.add_argument("--quick", action="store_true", help="tiny run for CI: N=2, 1 MiB, 2 reps")
    p.add_argument("--json", help="write all rows to this file")
    p.add_argument("--trace", metavar="DIR", help="each p2ptrain worker writes a Chrome trace of its calls' "
                   "chunks to DIR/n<N>-rank<R>.json: where each step's bytes arrived, per link "
                   "(bench/trace_spans.py --steps DIR/n4-rank*.json)")
    # worker mode
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--addrs", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        _run_worker(a)
        return 0
    _common.finally_on_sigterm()  # (stopped, it still kills its workers)
    if a.quick:
        a.n, a.sizes, a.reps = "2", "1", 2
    ns = [int(x) for x in a.n.split(",")]
    sizes = [float(x) for x in a.sizes.split(",")]
    codecs = a.codecs.split(",")
    threads = [None] if a.threads is None else [int(t) for t in a.threads.split(",")]
    trees = ([a.baseline_tree] if a.baseline_tree else []) + [None]
    rows: list[dict] = []
    gloo_rows: list[dict] = []
    import gloo_allreduce
    import netns
    import tempfile

    scratch = tempfile.TemporaryDirectory(prefix="p2ptrain-bench-tls-")
    tls_dirs = [None] + ([make_certs(scratch.name, max(ns))] if a.tls else [])
    for n in ns:
        rates = a.rates.split(",") if a.rates else ([a.netns] * n if a.netns else None)
        if rates is not None:
            with netns.EmulatedLan(n_hosts=n, rates=rates) as lan:
                for _ in range(a.rounds):
                    for tree in trees:
                        for t in threads:
                            for tls_dir in tls_dirs:
                                rows += run_p2ptrain(n, sizes, a.reps, codecs, lan=lan, uvloop=a.uvloop,
                                                     chunk_kib=a.chunk_kib, threads=t, tree=tree, trace_dir=a.trace,
                                                     tls_dir=tls_dir)
                if not a.no_gloo:
                    gloo_rows += gloo_allreduce.run_gloo(n, sizes, a.reps, lan=lan)
        else:
            for _ in range(a.rounds):
                for tree in trees:
                    for t in threads:
                        for tls_dir in tls_dirs:
                            rows += run_p2ptrain(n, sizes, a.reps, codecs, uvloop=a.uvloop, chunk_kib=a.chunk_kib,
                                                 threads=t, tree=tree, trace_dir=a.trace, tls_dir=tls_dir)
            if not a.no_gloo:
                gloo_rows += gloo_allreduce.run_gloo(n, sizes, a.reps)
    gloo = {(g["n"], g["size_bytes"]): g for g in gloo_rows}
    for g in gloo_rows:
        g.setdefault("impl", "gloo")
    _print(sorted(rows + gloo_rows, key=lambda r: (r["n"], r["size_bytes"], r["impl"] != "gloo", r["codec"]
                                                   if "codec" in r else "")), gloo)
    if a.json:
        Path(a.json).write_text(json.dumps(rows + gloo_rows, indent=1))
    return 0 if all(r["identical"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
