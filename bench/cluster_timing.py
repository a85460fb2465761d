"""The cluster's timing figures on an emulated LAN: discovery, failure recovery, state download.

    python bench/cluster_timing.py                                  # all three parts, a few minutes (root, ip, tc)
    python bench/cluster_timing.py --parts snapshot --json timing.json
    python bench/cluster_timing.py --parts failure --failures member,cable
    python bench/cluster_timing.py --parts discovery --hosts 3 --reps 5

Parts (every host is a network namespace on one bridge, its link capped both ways at ``--rate``):

- **discovery**: ``--hosts`` real ``python -m p2ptrain join`` processes, no ``--peers`` (beacons
  only), ``--min-peers`` all of them. From launch to each process's "listening on port" log line
  (process up: Python, torch, the task) and to the first round applied with every host a member.
- **failure**: a ring of 4 ``join`` processes (``--min-peers 2``), then one fault: SIGKILL of a
  member, SIGKILL of the coordinator (its log says "coordinating from epoch"), a cable pulled
  (``EmulatedLan.set_link``), a graceful leave (SIGTERM). From the fault to the first round the
  survivors apply with one member less (per-round ``time`` in their ``--metrics`` files).
- **snapshot**: a ``Cluster`` with a fake trainer whose state is ``--snapshot-mb`` MB of float32,
  and joiners (fresh processes, another starting checksum) that must download it. From asking to
  the state decoded, checked and restored; and the wire rate from the first to the last part
  frame, beside raw TCP on the same link.

Every figure is wall-clock time on one machine whose cores all hosts share: on 2 cores, 4 peers
and whatever else runs make the CPU-bound steps (process start, packing, checksums) slower and
noisier than on real machines. Figures go to stdout as one Markdown table, to ``--json`` in full.
Exit 1 if a measurement failed (its row says so), 2 if namespaces cannot be built.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import logging
import os
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import netns
from _common import finally_on_sigterm, table

PORT = 7000
SECRET = "bench"
SETTLE_S = 8.0  # a fault comes this long after the ring of 4 formed
FAILURES = ("member", "coordinator", "cable", "leave")
FAILURE_NAMES = {"member": "SIGKILL of a member", "coordinator": "SIGKILL of the coordinator",
                 "cable": "cable pulled (a member)", "leave": "graceful leave (SIGTERM, a member)"}
NOTE = (f"one machine, {os.cpu_count()} cores shared by every host and by whatever else runs: "
        "CPU-bound steps are slower and noisier than on real machines")


class Failed(RuntimeError):
    """A measurement that did not complete: its figure is reported as missing, with this reason."""


# What ends one measurement (a process that died or hung, a tc or ip command that failed), not the run.
MEASUREMENT_ERRORS = (RuntimeError, subprocess.SubprocessError, OSError, ValueError)


# ------------------------------------------------------------------- join processes

def log_time(line: str) -> float:
    """Epoch seconds of a log line (p2ptrain's format starts with asctime, local time)."""
    return datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()


class JoinRun:
    """``join`` processes on LAN hosts, each with a metrics file and a log under ``work``
    (named by ``tag``, which must be new: metrics files are appended to)."""

    def __init__(self, lan: netns.EmulatedLan, work: Path, tag: str):
        self.lan, self.work, self.tag = lan, work, tag
        self.procs: dict[str, subprocess.Popen] = {}
        self.launched: dict[str, float] = {}

    def path(self, name: str, ext: str) -> Path:
        return self.work / f"{self.tag}-{name}.{ext}"

    def start(self, name: str, host: int, min_peers: int) -> None:
        cmd = [sys.executable, "-m", "p2ptrain", "join", "--task", "synthetic", "--model-size", "100k",
               "--batch-size", "16", "--port", str(PORT), "--secret", SECRET, "--min-peers", str(min_peers),
               "--eval-every", "0", "--duration", "300", "--metrics", str(self.path(name, "jsonl"))]
        env = self.lan.env(host)
        env["OMP_NUM_THREADS"] = "1"  # one torch thread per emulated host: they share the cores
        with open(self.path(name, "log"), "w") as err:
            self.launched[name] = time.time()
            self.procs[name] = self.lan.popen(host, cmd, env=env, stdout=subprocess.DEVNULL, stderr=err)

    def rounds(self, name: str) -> list[dict]:
        out = []
        path = self.path(name, "jsonl")
        if path.exists():
            for line in path.read_text().splitlines():
                try:
                    r = json.loads(line)
                except json.JSONDecodeError:  # a line being written
                    break
                if "round" in r and "event" not in r:
                    out.append(r)
        return out

    def log_lines(self, name: str, text: str) -> list[float]:
        """Times of the log lines of ``name`` that contain ``text``."""
        path = self.path(name, "log")
        lines = path.read_text(errors="replace").splitlines() if path.exists() else []
        return [log_time(x) for x in lines if text in x and x[:4].isdigit()]

    def coordinator(self) -> str:
        """The live process that coordinates now: it said "coordinating from epoch" and has not
        said "no longer coordinating" since (every peer coordinates itself until it meets others)."""
        leads = {}
        for n, p in self.procs.items():
            took = max(self.log_lines(n, "coordinating from epoch"), default=None)
            if p.poll() is None and took is not None and took >= max(self.log_lines(n, "no longer coordinating"),
                                                                      default=0.0):
                leads[n] = took
        if len(leads) != 1:
            raise Failed(f"expected one coordinator, the logs name {sorted(leads) or 'none'}")
        return next(iter(leads))

    def wait(self, what: str, predicate, timeout: float, expect_dead=()) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            dead = [n for n, p in self.procs.items() if p.poll() is not None and n not in expect_dead]
            if dead:
                raise Failed(f"{', '.join(dead)} exited while waiting for {what}: {self.tail(dead[0])}")
            if time.monotonic() > deadline:
                raise Failed(f"no {what} within {timeout:g} s: {self.tail(next(iter(self.procs)))}")
            time.sleep(0.1)

    def tail(self, name: str) -> str:
        path = self.path(name, "log")
        return " | ".join(path.read_text(errors="replace").splitlines()[-3:]) if path.exists() else "no log"

    def stop_all(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
        for p in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=30)


def first_round(run: JoinRun, name: str, members: int, after: float = 0.0) -> float | None:
    times = [r["time"] for r in run.rounds(name) if r["members"] == members and r["time"] > after]
    return min(times) if times else None


# ------------------------------------------------------------------- part 1: discovery

def measure_discovery(lan: netns.EmulatedLan, work: Path, n: int, rep: int) -> dict:
    """n processes, beacons only: launch -> process up -> first round with all n members."""
    run = JoinRun(lan, work, f"discovery{rep}")
    names = [chr(ord("a") + i) for i in range(n)]
    try:
        for i, name in enumerate(names):
            run.start(name, i, min_peers=n)
        t0 = min(run.launched.values())
        run.wait(f"a round of {n}", lambda: all(first_round(run, x, n) for x in names), timeout=120)
        listening = {x: run.log_lines(x, "listening on port") for x in names}
        if not all(listening.values()):
            raise Failed(f"no 'listening on port' line in the logs of {[x for x in names if not listening[x]]}")
        up = [min(listening[x]) - run.launched[x] for x in names]
        ring = [first_round(run, x, n) - t0 for x in names]
        return {"n": n, "up_s": max(up), "up_each_s": up, "ring_s": min(ring), "ring_all_s": max(ring),
                "after_up_s": min(ring) - max(u + run.launched[x] - t0 for u, x in zip(up, names))}
    finally:
        run.stop_all()


# ------------------------------------------------------------------- part 2: failure

def measure_failure(lan: netns.EmulatedLan, work: Path, kind: str, index: int = 0) -> dict:
    """A ring of 4; one fault; how long until the survivors apply rounds of 3."""
    run = JoinRun(lan, work, f"failure{index}-{kind}")
    names, target = ["a", "b", "c", "d"], None
    try:
        for i, name in enumerate(names):
            run.start(name, i, min_peers=2)
        run.wait("10 rounds of 4", lambda: all(sum(r["members"] == 4 for r in run.rounds(x)) >= 10 for x in names),
                 timeout=120)
        # Steady state: the ring's forming leaves backoffs of up to query_timeout (5 s) behind it.
        time.sleep(max(0.0, first_round(run, names[0], 4) + SETTLE_S - time.time()))
        boss = run.coordinator()
        target = boss if kind == "coordinator" else next(x for x in names if x != boss)
        survivors = [x for x in names if x != target]
        fault = time.time()
        if kind == "cable":
            lan.set_link(names.index(target), False)
        else:
            run.procs[target].send_signal(signal.SIGTERM if kind == "leave" else signal.SIGKILL)
        run.wait("3 rounds of 3 on every survivor", lambda: all(
            sum(r["members"] == 3 and r["time"] > fault for r in run.rounds(x)) >= 3 for x in survivors),
            timeout=90, expect_dead=[target])
        firsts = [first_round(run, x, 3, after=fault) - fault for x in survivors]
        last4 = max((r["time"] for x in survivors for r in run.rounds(x) if r["members"] == 4), default=fault)
        out = {"case": kind, "target": target, "coordinator": boss, "first_s": min(firsts), "all_s": max(firsts),
               "last_round_of_4_s": last4 - fault}
        if kind == "coordinator":  # when a survivor took the lead
            took = [t for x in survivors for t in run.log_lines(x, "coordinating from epoch") if t > fault]
            out["takeover_s"] = min(took) - fault if took else None
        if kind == "leave":
            out["exit_code"] = run.procs[target].wait(timeout=30)
        return out
    finally:
        run.stop_all()
        if kind == "cable" and target is not None:
            lan.set_link(names.index(target), True)


# ------------------------------------------------------------------- part 3: snapshot

GRAD = 1024  # the fake trainer's gradient: small, so rounds cost nothing beside the big state
ROUND_GAP = 0.05  # seconds between its contributions: a lone member must not spin a core


class BigStateTrainer:
    """The trainer a ``Cluster`` asks for (``Contributions``), with a big state and a tiny
    gradient: the snapshot is ``params`` float32 values, each round carries GRAD of them."""

    def __init__(self, params: int, start: float):
        import numpy as np
        import torch

        self.np, self.w, self.version, self.restored_at = np, torch.full((params,), start), 0, None
        self.cluster = None  # set before the cluster starts
        self._next, self._wake_pending = 0.0, False

    def take(self, members=1, alone=False):
        now = time.monotonic()
        if now < self._next:
            if not self._wake_pending:
                self._wake_pending = True
                asyncio.get_running_loop().call_later(self._next - now, self._wake)
            return None
        self._next = now + ROUND_GAP
        return self.np.ones(GRAD, self.np.float32), 1

    def _wake(self) -> None:
        self._wake_pending = False
        self.cluster.contribution_available()

    def used(self, contribution):  # every parameter had a gradient
        return None

    def apply(self, summed, total, used=None, spread=None):  # the big state stays as it is: only its version moves
        self.version += 1

    def put_back(self, contribution, samples):  # a constant gradient: nothing to keep
        pass

    def snapshot(self):
        return {"model": {"w": self.w}, "optimizer": {}, "version": self.version}

    def restore(self, state):
        self.w, self.version, self.restored_at = state["model"]["w"], state["version"], time.time()


def _worker(argv: list[str]) -> int:
    """One side of the snapshot part, inside a namespace. ``member``: trains alone, serves its
    state, prints READY, runs until SIGTERM. ``joiner``: loads the member's state, prints its
    timings as one JSON line, leaves."""
    ap = argparse.ArgumentParser(prog="cluster_timing.py _worker")
    ap.add_argument("role", choices=["member", "joiner"])
    ap.add_argument("--id", required=True)
    ap.add_argument("--port", type=int, default=PORT)
    ap.add_argument("--params", type=int, required=True)
    ap.add_argument("--member", default="", help="host:port of the member (joiner)")
    ap.add_argument("--limit", type=float, default=300.0, help="seconds before giving up")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return asyncio.run(_member(a) if a.role == "member" else _joiner(a))


def _cluster(a, trainer):
    from p2ptrain.cluster.cluster import Cluster

    c = Cluster(peer_id=a.id, trainer=trainer, checksum=f"start-{a.id}".encode(), secret=SECRET.encode(),
                host="0.0.0.0", port=a.port, fingerprint=[("w", (a.params,), "float32")])
    trainer.cluster = c
    return c


async def _until(predicate, cluster, limit: float, what: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit
    while not predicate():
        cluster.check()
        if loop.time() > deadline:
            raise SystemExit(f"no {what} within {limit:g} s")
        await asyncio.sleep(0.01)


async def _member(a) -> int:
    trainer = BigStateTrainer(a.params, 1.0)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    async with _cluster(a, trainer) as c:
        await _until(lambda: trainer.version >= 3, c, 60, "rounds")
        print("READY", flush=True)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), a.limit)
    return 0


async def _joiner(a) -> int:
    trainer = BigStateTrainer(a.params, 0.0)
    c = _cluster(a, trainer)
    times: dict = {"asks": 0}
    fetch, on_frame = c.transfer.fetch, c.transfer.on_frame

    # Instrumentation only: note when the ask leaves and when part frames arrive, then go on.
    async def timed_fetch(peer):
        times.setdefault("ask", time.time())
        times["asks"] += 1
        return await fetch(peer)

    def timed_frame(peer, frame):
        h = frame.header
        if h.get("k") == "part":
            now = time.time()
            if h.get("i") == 0:
                times.update(first_part=now, first_bytes=frame.payload.nbytes, size=h.get("size"))
            times["last_part"] = now
        on_frame(peer, frame)

    c.transfer.fetch, c.transfer.on_frame = timed_fetch, timed_frame
    host, _, port = a.member.rpartition(":")
    async with c:
        c.propose(host, int(port))
        await _until(lambda: trainer.restored_at is not None, c, a.limit, "state loaded")
    times.update(restored=trainer.restored_at, version=trainer.version)
    print(json.dumps(times), flush=True)
    return 0


def _worker_cmd(*args) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), "_worker", *map(str, args)]


def wait_ready(p: subprocess.Popen, timeout: float) -> None:
    ready, _, _ = select.select([p.stdout], [], [], timeout)
    line = p.stdout.readline() if ready else ""
    if not line.startswith("READY"):
        raise Failed(f"the snapshot member did not start within {timeout:g} s")


def measure_snapshot(lan: netns.EmulatedLan, work: Path, mb: float, reps: int, rate_bps: int) -> dict:
    """A member on host 0 holds ``mb`` MB of state; ``reps`` joiners on host 1 download it in turn."""
    params = int(mb * 1e6 / 4)
    env = {**lan.env(0), "OMP_NUM_THREADS": "1"}
    with open(work / "snapshot-member.log", "w") as err:
        member = lan.popen(0, _worker_cmd("member", "--id", "a", "--params", params), env=env,
                           stdout=subprocess.PIPE, stderr=err, text=True)
    out: dict = {"mb_nominal": mb, "runs": []}
    try:
        wait_ready(member, 90)
        out["raw_tcp_Bps"] = lan.measure_tcp(0, 1, seconds=2.0) / 8
        for rep in range(reps):
            launched = time.time()
            with open(work / f"snapshot-joiner{rep}.log", "w") as err:
                j = lan.popen(1, _worker_cmd("joiner", "--id", f"j{rep}", "--port", PORT + 1 + rep, "--params",
                                             params, "--member", f"{lan.hosts[0].addr}:{PORT}"),
                              env={**lan.env(1), "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE, stderr=err,
                              text=True)
            try:
                text, _ = j.communicate(timeout=180)
            except subprocess.TimeoutExpired:
                raise Failed(f"joiner {rep} loaded no state within 180 s") from None
            finally:
                if j.poll() is None:
                    j.kill()
                    j.wait()
            if j.returncode != 0 or not text.strip():
                tail = (work / f"snapshot-joiner{rep}.log").read_text(errors="replace").splitlines()[-3:]
                raise Failed(f"joiner {rep} exited with {j.returncode}: {' | '.join(tail)}")
            t = json.loads(text.strip().splitlines()[-1])
            size = t["size"]
            wire_s = t["last_part"] - t["first_part"]
            out["runs"].append({
                "bytes": size, "asks": t["asks"], "launch_to_loaded_s": t["restored"] - launched,
                "ask_to_loaded_s": t["restored"] - t["ask"], "ask_to_first_part_s": t["first_part"] - t["ask"],
                "wire_s": wire_s, "last_part_to_loaded_s": t["restored"] - t["last_part"],
                "overall_Bps": size / (t["restored"] - t["ask"]),
                # Can read above the link: parts that queued in the socket buffer while the
                # first was handled are read at once. overall_Bps cannot.
                "wire_Bps": (size - t["first_bytes"]) / wire_s if wire_s > 0 else None})
            progress(f"snapshot {rep + 1}/{reps}: {size / 1e6:.0f} MB in {t['restored'] - t['ask']:.2f} s")
    finally:
        if member.poll() is None:
            member.send_signal(signal.SIGTERM)
            try:
                member.wait(timeout=15)
            except subprocess.TimeoutExpired:
                member.kill()
                member.wait()
    out["rate_bps"] = rate_bps
    return out


# ------------------------------------------------------------------- report

def progress(text: str) -> None:
    print(f"[timing] {text}", file=sys.stderr, flush=True)


def _s(x) -> str:
    return "-" if x is None else f"{x:.2f} s"


def _fig(values: list, fmt=_s) -> tuple[str, str]:
    """(median, each run) as table cells."""
    vals = [v for v in values if v is not None]
    med = fmt(statistics.median(vals)) if vals else "-"
    return med, ", ".join(fmt(v) for v in values)


def report_rows(results: dict) -> list[list[str]]:
    rows = []
    runs = results.get("discovery")
    if runs:
        n = runs[0]["n"]
        rows.append([f"discovery, N={n}", "launch -> every process up (slowest)", *_fig([r["up_s"] for r in runs])])
        rows.append([f"discovery, N={n}", f"launch -> first round of {n}", *_fig([r["ring_s"] for r in runs])])
        rows.append([f"discovery, N={n}", f"slowest up -> first round of {n}",
                     *_fig([r["after_up_s"] for r in runs])])
    for r in results.get("failure", []):
        where = f"failure: {FAILURE_NAMES[r['case']]}"
        if "error" in r:
            rows.append([where, "FAILED: " + r["error"][:150], "-", "-"])
            continue
        rows.append([where, "fault -> first round of 3 (first / every survivor)", _s(r["first_s"]),
                     f"{_s(r['first_s'])} / {_s(r['all_s'])}"])
        rows.append([where, "last round of 4, from the fault", _s(r["last_round_of_4_s"]), ""])
        if "takeover_s" in r:
            rows.append([where, "fault -> a survivor coordinates", _s(r["takeover_s"]), ""])
    snap = results.get("snapshot")
    if snap and snap.get("runs"):
        runs, gbit = snap["runs"], snap["rate_bps"] / 1e9
        where = f"snapshot, {runs[0]['bytes'] / 1e6:.0f} MB at {gbit:g} Gbit/s"

        def mbps(v):
            return "-" if v is None else f"{v / 1e6:.1f} MB/s = {v * 8 / snap['rate_bps']:.2f} of link"

        rows.append([where, "joiner launch -> state loaded", *_fig([r["launch_to_loaded_s"] for r in runs])])
        rows.append([where, "ask -> state loaded", *_fig([r["ask_to_loaded_s"] for r in runs])])
        rows.append([where, "ask -> first part (member packs)", *_fig([r["ask_to_first_part_s"] for r in runs])])
        rows.append([where, "first -> last part (wire)", *_fig([r["wire_s"] for r in runs])])
        rows.append([where, "last part -> loaded (decode, check)", *_fig([r["last_part_to_loaded_s"] for r in runs])])
        rows.append([where, "rate, ask -> loaded", *_fig([r["overall_Bps"] for r in runs], mbps)])
        rows.append([where, "rate on the wire", *_fig([r["wire_Bps"] for r in runs], mbps)])
        rows.append([where, "raw TCP, same link (baseline)", mbps(snap["raw_tcp_Bps"]), ""])
    for part, why in results.get("errors", {}).items():
        rows.append([part, "FAILED: " + why[:150], "-", "-"])
    return rows


# ------------------------------------------------------------------- main

def run_parts(args, work: Path) -> dict:
    parts = set(args.parts.split(","))
    need = max(args.hosts if "discovery" in parts else 0, 4 if "failure" in parts else 0,
               2 if "snapshot" in parts else 0)
    results: dict = {"rate": args.rate, "note": NOTE, "errors": {}}
    with netns.EmulatedLan(need, rate=args.rate) as lan:
        if "discovery" in parts:
            runs = results.setdefault("discovery", [])
            for rep in range(args.reps):
                try:
                    runs.append(measure_discovery(lan, work, args.hosts, rep))
                    progress(f"discovery {rep + 1}/{args.reps}: up {runs[-1]['up_s']:.2f} s, "
                             f"round of {args.hosts} {runs[-1]['ring_s']:.2f} s")
                except MEASUREMENT_ERRORS as exc:
                    results["errors"][f"discovery run {rep + 1}"] = str(exc)
        if "failure" in parts:
            for i, kind in enumerate(args.failures.split(",")):
                try:
                    results.setdefault("failure", []).append(measure_failure(lan, work, kind, i))
                    progress(f"failure {kind}: rounds of 3 after {results['failure'][-1]['first_s']:.2f} s")
                except MEASUREMENT_ERRORS as exc:
                    results.setdefault("failure", []).append({"case": kind, "error": str(exc)})
        if "snapshot" in parts:
            try:
                results["snapshot"] = measure_snapshot(lan, work, args.snapshot_mb, args.reps,
                                                       netns.parse_rate(args.rate))
            except MEASUREMENT_ERRORS as exc:
                results["errors"]["snapshot"] = str(exc)
    return results


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_worker"]:
        return _worker(argv[1:])
    finally_on_sigterm()  # (stopped, it still kills its workers)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="discovery,failure,snapshot", help="any of discovery,failure,snapshot")
    ap.add_argument("--failures", default=",".join(FAILURES), help=f"any of {','.join(FAILURES)}")
    ap.add_argument("--hosts", type=int, default=4, help="processes in the discovery part (default 4)")
    ap.add_argument("--reps", type=int, default=3, help="repetitions of discovery and of the download (default 3)")
    ap.add_argument("--snapshot-mb", type=float, default=100.0, help="state size in MB (default 100)")
    ap.add_argument("--rate", default="1gbit", help="every host's link, both ways (default 1gbit)")
    ap.add_argument("--json", help="write every figure here")
    ap.add_argument("--workdir", help="keep the logs and metrics files here (default: a temporary folder)")
    args = ap.parse_args(argv)
    for given, allowed, flag in ((args.parts, ("discovery", "failure", "snapshot"), "--parts"),
                                 (args.failures, FAILURES, "--failures")):
        unknown = set(given.split(",")) - set(allowed)
        if unknown:
            ap.error(f"{flag}: unknown {', '.join(sorted(unknown))}; use any of {','.join(allowed)}")
    if not 2 <= args.hosts <= 16 or args.reps < 1 or args.snapshot_mb <= 0:
        ap.error("--hosts takes 2..16, --reps at least 1, --snapshot-mb a positive size")
    try:
        netns.parse_rate(args.rate)
    except ValueError as exc:
        ap.error(f"--rate: {exc}")
    try:
        with contextlib.ExitStack() as stack:
            work = Path(args.workdir) if args.workdir else Path(stack.enter_context(tempfile.TemporaryDirectory()))
            work.mkdir(parents=True, exist_ok=True)
            results = run_parts(args, work)
    except netns.NetnsUnavailable as exc:
        print(f"cluster_timing: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    print(f"\nCluster timing on an emulated LAN ({args.rate} links, namespaces on one bridge)\n")
    print(table(report_rows(results), ["part", "figure", "median", "each run"]))
    print(f"\n{NOTE}.")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    failed = results["errors"] or any("error" in r for r in results.get("failure", []))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
