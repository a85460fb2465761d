"""One peer of bench/lan.py: what every machine of the benchmark runs, phase by phase.

Every peer runs the same phases in the same order, meeting the others on the control
channel (bench/_lan_control.py) before and after each; rank 0 gathers the figures and
writes the report. A phase runs a child process on each taking peer and waits for it,
bounded by ``timeout``; the child is killed in ``finally``. A child that fails is recorded
as a failed row (and a non-zero exit at the end), and the benchmark goes on.

Phases:

1. allreduce, p2ptrain: bench/allreduce.py's worker on every peer (its Group, its timing);
   rank 0 joins their outputs with ``allreduce._collect`` (a rep's time is the slowest peer's).
2. allreduce, gloo: bench/gloo_allreduce.py's worker on every peer (fp32, same sizes).
3. training: per run of ``_lan_train.plan`` the first N peers train (``p2ptrain join`` or
   DDP) and the rest wait.

Ports, from each peer's ``--peers`` entry ``host:P``: P the control store (rank 0), P+1 the
allreduce group, P+2 the gloo allreduce rendezvous (rank 0), P+10+i run i's join, P+60+i
run i's DDP rendezvous (rank 0). So a peer uses P..P+99 (at most 50 training runs).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _lan_report
import _lan_train
from _lan_control import Control

from p2ptrain.trainer.cpu_queue import cpu_times

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
MAX_RUNS = 50
FLOOR_LEAD_S = 20.0  # seconds from the floor's meeting to its lone peers' first batch (with 8, one of 4 joins
# on 2 cores started 0.7-1.4 s late; with 20 none did, in `lan.py --local 4 --floor` runs)


class Progress:
    """What rank 0 shows on stderr while it runs: one line per phase, redrawn live on a terminal."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.enabled = total, enabled
        self.tty = enabled and sys.stderr.isatty()
        self.k, self.label, self.t0 = 0, "", time.monotonic()

    def start(self, label: str) -> None:
        self.k, self.label, self.t0 = self.k + 1, label, time.monotonic()
        if self.enabled and not self.tty:
            print(f"[lan {self.k}/{self.total}] {label} ...", file=sys.stderr, flush=True)
        self.tick("")

    def tick(self, status: str) -> None:
        if self.tty:
            line = f"[lan {self.k}/{self.total}] {self.label}  {time.monotonic() - self.t0:5.1f} s  {status}"
            print("\r\033[K" + line[:200], end="", file=sys.stderr, flush=True)

    def done(self, result: str) -> None:
        if self.enabled:
            end = "\r\033[K" if self.tty else ""
            print(f"{end}[lan {self.k}/{self.total}] {self.label}: {result} "
                  f"({time.monotonic() - self.t0:.1f} s)", file=sys.stderr, flush=True)


def child_env(threads: int, host: str) -> dict:
    """Every process of a run, p2ptrain's and DDP's alike: the heap ``join`` gives itself
    (``p2ptrain.commands.heap``; ``GLIBC_TUNABLES=`` in the environment keeps glibc's own)."""
    from p2ptrain.commands.heap import with_kept_heap

    env = with_kept_heap(dict(os.environ, PYTHONUNBUFFERED="1"))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    if "GLOO_SOCKET_IFNAME" not in env:
        ifname = _ifname_of(host)
        if ifname:
            env["GLOO_SOCKET_IFNAME"] = ifname  # else gloo may pick 127.0.0.1 and hang
    return env


def _ifname_of(host: str) -> str | None:
    from p2ptrain.net.interfaces import list_interfaces

    try:
        addr = socket.gethostbyname(host)
    except OSError:
        return None
    return next((i.name for i in list_interfaces() if i.address == addr), None)


def run_child(cmd: list[str], env: dict, log: Path, timeout: float, tick=None,
              progress: Path | None = None, stall: float = 0.0, cpu: dict | None = None) -> tuple[int, str]:
    """Run cmd to completion; exit code and output tail. Killed (in ``finally`` at the latest)
    after ``timeout`` s, or when the file ``progress`` has not grown for ``stall`` s (once it exists).
    ``cpu``: filled with the child's last ``cpu_times`` seen (``cpu_s``, ``queued_s``)."""
    with open(log, "w", encoding="utf-8") as out:
        p = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
    try:
        deadline = time.monotonic() + timeout
        size, grew = -1, time.monotonic()
        while p.poll() is None:
            now = time.monotonic()
            times = cpu_times(p.pid) if cpu is not None else None
            if times:
                cpu["cpu_s"], cpu["queued_s"] = times
            if progress is not None and stall and progress.exists():
                if progress.stat().st_size != size:
                    size, grew = progress.stat().st_size, now
                elif now - grew > stall:
                    p.kill()
                    p.wait()
                    return 125, f"stalled: no round for {stall:g} s (--stall): " + _tail(log)
            if now > deadline:
                p.kill()
                p.wait()
                return 124, f"timed out after {timeout:g} s: " + _tail(log)
            if tick:
                tick()
            time.sleep(0.2)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    return p.returncode, _tail(log)


def _error(rc: int, out: str) -> str:
    """One peer's failure, for the report: the exit code, how it ended, the end of its log."""
    return f"exit {rc}: " + (out if len(out) <= 900 else f"{out[:200]} [...] {out[-600:]}")


def _tail(log: Path, n: int = 1500) -> str:
    text = log.read_text(encoding="utf-8", errors="replace") if log.exists() else ""
    return text[-n:].strip()


class Peer:
    """The benchmark on this machine. ``a`` is lan.py's parsed options; ``peers`` the entries, ``rank`` ours."""

    def __init__(self, a, peers: list[str], rank: int):
        self.a, self.peers, self.rank, self.world = a, peers, rank, len(peers)
        self.hosts = [p.rsplit(":", 1)[0] for p in peers]
        self.ports = [int(p.rsplit(":", 1)[1]) for p in peers]
        self.env = child_env(a.threads, self.hosts[rank])
        self.tmp = Path(tempfile.mkdtemp(prefix=f"p2pt-lan-{rank}-"))
        self.notes: list[str] = []

    def run(self) -> int:
        a = self.a
        ctl = Control(self.hosts[0], self.ports[0], self.rank, self.world, timeout=a.timeout + 120)
        try:
            return self._phases(ctl)
        finally:
            try:
                ctl.close()
            finally:
                if not (a.keep or a.trace):
                    shutil.rmtree(self.tmp, ignore_errors=True)

    def _phases(self, ctl: Control) -> int:
        a = self.a
        mine = _lan_train.join_flags() if a.train else set()
        seen = ctl.exchange("hello", {"flags": sorted(mine), "host": socket.gethostname(),
                                      "nonce": os.urandom(4).hex(), "cores": sorted(os.sched_getaffinity(0))})
        self.nonce = seen[0]["nonce"]  # rank 0's: a cluster name no earlier run can answer to
        self.flags = flags = set(seen[0]["flags"])  # every peer plans the same runs
        if any(set(s["flags"]) != flags for s in seen):
            self.notes.append("the peers' joins take different flags: run the same p2ptrain everywhere")
        if a.pin_cores:
            self.notes.append("CPU cores (--pin-cores): " + ", ".join(
                f"peer {r} on core {','.join(map(str, s['cores']))}" for r, s in enumerate(seen)))
        runs, skipped = _lan_train.plan(self.world, a.scaling, a.train_codecs, a.staleness, flags,
                                        gloo=a.gloo, predict=a.weight_prediction, overlap=a.overlap,
                                        sync_every=a.sync_every or [],
                                        local_staleness=a.local_staleness, floor=a.floor) if a.train else ([], [])
        self.notes += skipped
        if a.step_delay and a.train and "--step-delay" not in flags:
            self.notes.append("--step-delay not applied: this join has no --step-delay (heterogeneity not measured)")
            a.step_delay = 0.0
        if len(runs) > MAX_RUNS:
            raise SystemExit(f"lan: {len(runs)} training runs, at most {MAX_RUNS}: give fewer codecs, "
                             "staleness values or --scaling")
        do_allreduce = a.allreduce and self.world >= 2
        self.progress = Progress(len(runs) + (1 + a.gloo) * do_allreduce, enabled=self.rank == 0)
        # Every peer takes part in every phase; only rank 0 makes the report.
        report = _lan_report.Report(a, self.world, self.notes) if self.rank == 0 else None
        if do_allreduce:
            gathered = self._allreduce_p2p(ctl)
            if report:
                report.allreduce_p2p(gathered)
            if a.gloo:
                gathered = self._allreduce_gloo(ctl)
                if report:
                    report.allreduce_gloo(gathered)
        for run in runs:
            gathered = self._train(ctl, run)
            if report:
                report.train(run, gathered)
        ctl.exchange("end")
        return report.finish() if report else 0

    # -- allreduce

    def _allreduce_p2p(self, ctl: Control) -> list[dict]:
        a = self.a
        self._start(ctl, "allreduce-p2p", f"allreduce p2ptrain {','.join(a.codecs)}, N={self.world}")
        addrs = ",".join(f"{h}:{p + 1}" for h, p in zip(self.hosts, self.ports))
        cmd = [sys.executable, str(BENCH / "allreduce.py"), "--worker", "--rank", str(self.rank),
               "--addrs", addrs, "--sizes", ",".join(map(str, a.sizes)), "--reps", str(a.reps),
               "--codecs", ",".join(a.codecs), "--chunk-kib", str(a.chunk_kib)]
        rc, out = run_child(cmd, self.env, self.tmp / "allreduce.log", a.timeout, self._ticker())
        import allreduce

        line = next((x for x in out.splitlines() if x.startswith(allreduce.MARK)), None)
        mine = {"ok": rc == 0 and line is not None, "output": line if rc == 0 else None,
                "error": None if rc == 0 else _error(rc, out)}
        return self._finish(ctl, "allreduce-p2p", mine)

    def _allreduce_gloo(self, ctl: Control) -> list[dict]:
        a = self.a
        self._start(ctl, "allreduce-gloo", f"allreduce gloo fp32, N={self.world}")
        cmd = [sys.executable, str(BENCH / "gloo_allreduce.py"), "--_worker", "--rank", str(self.rank),
               "--world", str(self.world), "--master", self.hosts[0], "--port", str(self.ports[0] + 2),
               "--sizes", ",".join(map(str, a.sizes)), "--reps", str(a.reps), "--warmup", "1",
               "--timeout", str(a.timeout)]
        rc, out = run_child(cmd, self.env, self.tmp / "gloo.log", a.timeout, self._ticker())
        import gloo_allreduce

        line = next((x for x in out.splitlines() if x.startswith(gloo_allreduce.RESULT_MARK)), None)
        mine = {"ok": rc == 0, "output": line, "error": None if rc == 0 else _error(rc, out)}
        return self._finish(ctl, "allreduce-gloo", mine)

    # -- training

    def _train(self, ctl: Control, run: _lan_train.Run) -> list[dict]:
        a = self.a
        name = f"train-{run.index}"
        self._start(ctl, name, run.label)
        # A floor's lone peers wait for no one: they take their first batch together, when the
        # slowest has surely started (else the first up would train alone for a while).
        start_at = max(x["t"] for x in ctl.exchange(f"{name}/clock", {"t": time.time()})) + FLOOR_LEAD_S \
            if run.floor else None
        if self.rank >= run.n:
            return self._finish(ctl, name, {"ok": True, "idle": True})
        metrics = self.tmp / f"{name}.jsonl"
        delay = a.step_delay if self.rank in a.slow_ranks else 0.0
        if run.impl == "p2ptrain":
            peers = [f"{h}:{p + 10 + run.index}" for h, p in zip(self.hosts[:run.n], self.ports)]
            cmd = _lan_train.join_command(run, peers=peers, own=peers[self.rank], metrics=metrics,
                                          model_size=a.model_size, batch_size=a.batch_size,
                                          rounds=a.rounds, secret=a.secret, flags=self.flags,
                                          cluster=f"lanbench-{self.nonce}-{run.index}" + (f"-{self.rank}" if run.floor else ""),
                                          step_delay=delay, step_busy=a.slow_busy, log_level=a.log_level,
                                          outer_lr=a.outer_lr,
                                          outer_momentum=a.outer_momentum, device=a.device, start_at=start_at,
                                          trace=self.tmp / f"{name}.trace.json" if a.trace else None)
        else:
            cmd = _lan_train.ddp_command(run, rank=self.rank, master=self.hosts[0],
                                         port=self.ports[0] + 60 + run.index, metrics=metrics,
                                         model_size=a.model_size, batch_size=a.batch_size,
                                         rounds=a.rounds, step_delay=delay, step_busy=a.slow_busy,
                                         threads=a.threads, device=a.device,
                                         timeout=a.timeout)

        def status() -> str:
            records, _ = _lan_train.read_metrics(metrics)
            return f"round {len(records)}/{a.rounds}" + (f"  loss {records[-1]['loss']:.3f}" if records else "")

        cpu: dict = {}
        rc, out = run_child(cmd, self.env, self.tmp / f"{name}.log", a.timeout, self._ticker(status),
                            progress=metrics, stall=a.stall, cpu=cpu)
        mine = {"ok": rc == 0, "error": None if rc == 0 else _error(rc, out),
                "summary": {**_lan_train.summarize(*_lan_train.read_metrics(metrics), a.target_loss,
                                                   step_samples=a.batch_size * run.n), **cpu}}
        if self.rank:
            mine["summary"].pop("curve", None)  # rank 0's curve is the one plotted
            if not run.floor:  # (a floor's time is its peers' together: every peer's progress counts)
                mine["summary"].pop("progress", None)
        return self._finish(ctl, name, mine)

    # -- the meeting before and after each phase

    def _start(self, ctl: Control, name: str, label: str) -> None:
        ctl.exchange(f"{name}/start")
        self.progress.start(label)

    def _finish(self, ctl: Control, name: str, mine: dict) -> list[dict]:
        everyone = ctl.exchange(f"{name}/done", mine)
        bad = [f"peer {r}: {x['error']}" for r, x in enumerate(everyone) if not x["ok"]]
        self.progress.done("FAILED " + bad[0].splitlines()[0][:200] if bad else "ok")
        return everyone

    def _ticker(self, status=None):
        if self.rank != 0:
            return None
        last = [0.0]

        def tick() -> None:
            now = time.monotonic()
            if now - last[0] >= 0.5:
                last[0] = now
                self.progress.tick(status() if status else "")
        return tick
