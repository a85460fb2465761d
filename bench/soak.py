"""A churn soak: peers on an emulated LAN, killed, paused, unplugged and joined at random but
seeded moments, checked for lost samples, hangs, diverged parameters and growing memory.

    python bench/soak.py                      # short: 3 peers + 1 joiner, 60 s, 12 faults
    python bench/soak.py --long               # 4 peers + 2 joiners, 900 s, 110 faults
    python bench/soak.py --seconds 120 --faults 30 --seed 7 --rate 1gbit
    python bench/soak.py --long --sync-every auto   # the same in local-steps mode, rounds by time

Every peer is ``python -m p2ptrain join --task synthetic --no-discovery --peers ...`` (int8,
staleness 1, ``--checkpoint-dir``, ``--metrics``; ``--sync-every auto``: local-steps mode by time,
the README's recipe for laptops beside desktops) on its own network namespace (bench/netns.py),
its link capped by tbf both ways at ``--rate``. The run is the cluster's ``--duration``; faults
fall in its middle (from a tenth to ``FAULT_WINDOW`` of it), each at a seeded random time:

- ``kill``: ``kill -9`` of a running peer, started again ``--restart`` s later, resuming from its
  checkpoint directory or (half the time) fresh with an empty one;
- ``stop``: SIGSTOP, SIGCONT ``--stop`` seconds later (a laptop's lid; 5-60 s long, 2-6 s short);
- ``link``: its cable pulled (``ip link set vI down`` on its veth's bridge end), back
  ``--link`` seconds later;
- ``join``: a new peer on a spare host.

A fault needs three healthy peers, so that two stay healthy (a fault with no eligible peer waits
a second, until ``LAST_TRY`` of the run); a peer back from one, or joining, is healthy once its
metrics record a round with others (the table's ``back in a round after``). The same peers run
without faults first (``--no-baseline`` skips it; ``--baseline-seconds`` shortens it): the
throughput kept is the faulty run's committed samples per second over the baseline's, both from
the moment every first peer is a member to the last update. A killed, paused or unplugged peer
computes nothing meanwhile: the capacity present (its peer-seconds over those of the run without
faults) bounds what can be kept, and the throughput kept per capacity is the part the handling of
the faults loses (where peers share too few cores, one paused lends the others its core: that
part then reads high). Where they share cores, more peers also make fewer samples/s (eight on 2
cores about 80 % of five), so a run with joiners cannot keep the first peers' rate: the throughput
kept with the same peers compares with this run's own quiet windows (no event in them or the 10 s
before, every peer started by then) at the count of peers started at each moment
(``_soak_check.same_peers``). Each fault's cost: the longest wait for an update after it, and the stalls
blamed on it (bench/_soak_check.py). A peer under no fault whose metrics
have not grown for ``SILENT`` s while the others' have is stuck (its stacks go to ``stackN.txt``
where ``py-spy`` is installed). Every process is bounded: a peer still running ``--grace`` s after
the run's end is a hang, reported and killed; every process is killed and every namespace removed
in ``finally``. Open fds count one connection per member: compare a peer's start and end with the
cluster's size at each.
The checks and the table's columns: bench/_soak_check.py. Exit 1 on any finding.
"""

from __future__ import annotations

import argparse
import heapq
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common  # noqa: E402
import _soak_check  # noqa: E402
import netns  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
PORT = 7000
FAULT_WINDOW = 0.65      # faults fall before this fraction of the run; recoveries follow
LAST_TRY = 0.75          # a fault with no eligible host is tried again until this fraction
KINDS = ("kill", "stop", "link", "join")
SAMPLE_EVERY = 1.0       # seconds between RSS/fd samples
POLL = 0.1
REJOIN_LIMIT = 60.0      # seconds a peer back from a fault has to be in a round with the others
SILENT = 30.0            # seconds without a record, under no fault, that make a peer stuck (a round
                         # waits for a paused member up to --peer-timeout, 10 s, before it goes on without)


def schedule(rng: random.Random, seconds: float, n_faults: int, joiners: int) -> list[tuple[float, str]]:
    """``n_faults`` (offset from the run's start, kind), sorted: ``joiners`` joins, one each of kill,
    stop and link, the rest of those three at random; each at a uniform time in the fault window."""
    joins = min(joiners, n_faults)
    rest = n_faults - joins
    kinds = ["join"] * joins + list(KINDS[:min(3, rest)]) + [rng.choice(KINDS[:3]) for _ in range(rest - 3)]
    rng.shuffle(kinds)
    times = sorted(rng.uniform(0.1 * seconds, FAULT_WINDOW * seconds) for _ in kinds)
    return list(zip(times, kinds))


class Soak:
    """One run on ``lan``: ``peers`` started at once, hosts after them kept for joiners."""

    def __init__(self, a, lan: netns.EmulatedLan, label: str, faults: bool):
        self.a, self.lan, self.label = a, lan, label
        self.rng = random.Random(f"{a.seed}-{label}")
        self.dir = Path(tempfile.mkdtemp(prefix=f"p2pt-soak-{label}-", dir=a.tmp))
        self.n_hosts = a.peers + (a.joiners if faults else 0)
        self.plan = schedule(self.rng, a.seconds, a.faults, a.joiners) if faults else []
        self.incs: list[_soak_check.Incarnation] = []
        self.live: dict[int, tuple[subprocess.Popen, _soak_check.Incarnation]] = {}
        self.faulted: set[int] = set()             # hosts under a fault, or back from one and not yet in a round
        self.back: dict[int, tuple[float, str]] = {}  # host -> (when it recovered or joined, what) until in a round
        self.rejoin_s: dict[str, list] = {}        # what -> seconds from recovery to its first round with others
        self.once_up_s: dict[str, list] = {}       # restart, join -> of those, from its process's first
        #   metrics record (Python, torch and the task loaded: seconds of a 2-core box's queue) to that round
        self.started: set[int] = set()
        self.injected: list[tuple[float, str]] = []
        self.events: list[tuple[float, str, int]] = []  # the fault log: (time, what, host), recoveries too
        self.log: list[str] = []
        self.skipped: list[str] = []               # faults of the plan no host was eligible for in time
        self.stray: list[str] = []                 # hosts that did not rejoin within REJOIN_LIMIT
        self.silent: list[_soak_check.Incarnation] = []  # live, under no fault, and no record for SILENT s
        self.recoveries: list = []                 # heap of (time, seq, what, host)
        self.seq = 0
        self.ends_at: float | None = None  # when the cluster's --duration ends (once every first peer is in)

    # -- processes
    def start(self, host: int, fresh: bool = False) -> None:
        a, n = self.a, len(self.incs)
        ckpt = self.dir / f"ckpt{host}"
        if fresh:
            shutil.rmtree(ckpt, ignore_errors=True)
        ckpt.mkdir(exist_ok=True)
        addrs = [f"{h.addr}:{PORT}" for h in self.lan.hosts[:self.n_hosts]]
        me = addrs[host]
        # A peer started once the run is under way (a restart, a joiner) is given the time left,
        # as a user restarting a machine of a run with an end would: --duration counts from a
        # peer's own start, and a cluster whose every first peer was restarted with the whole
        # duration runs on that long (the leader's clock: README, --duration).
        seconds = a.seconds if self.ends_at is None else max(5.0, self.ends_at - time.time())
        cmd = [sys.executable, "-m", "p2ptrain", "join", "--task", "synthetic", "--model-size", a.model_size,
               "--batch-size", str(a.batch_size), "--no-discovery", "--host", me.split(":")[0], "--port", str(PORT),
               "--peers", ",".join(x for x in addrs if x != me), "--secret", "soak", "--duration", f"{seconds:.1f}",
               "--compression", "int8", "--staleness", "1", "--metrics", str(self.dir / f"m{n}.jsonl"),
               "--checksum-every", "5", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "50", "--no-save",
               "--eval-every", "0"]
        cmd += ["--sync-every", a.sync_every] if a.sync_every else []
        cmd += ["--step-delay", str(a.step_delay)] if a.step_delay else []
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
                   OMP_NUM_THREADS="1", P2PTRAIN_SECRET="")
        out = open(self.dir / f"out{n}.txt", "w")
        try:
            p = self.lan.popen(host, cmd, env=self.lan.env(host, env), stdout=out, stderr=subprocess.STDOUT,
                               stdin=subprocess.DEVNULL)
        finally:
            out.close()
        inc = _soak_check.Incarnation(host, time.time(), [], None, None)
        self.incs.append(inc)
        self.live[host] = (p, inc)
        self.started.add(host)

    def sample(self) -> None:
        now = time.time()
        for p, inc in self.live.values():
            try:
                status = Path(f"/proc/{p.pid}/status").read_text()
                rss = int(next(x for x in status.splitlines() if x.startswith("VmRSS:")).split()[1]) * 1024
                inc.usage.append((now, rss, len(os.listdir(f"/proc/{p.pid}/fd"))))
            except (OSError, StopIteration, ValueError):
                pass

    def watch(self) -> None:
        """A live peer under no fault whose metrics file has not grown for ``SILENT`` s while the
        cluster goes on is stuck: noted once, with its threads' stacks (py-spy, where installed)."""
        now = time.time()
        for host, (p, inc) in self.live.items():
            path = self.dir / f"m{self.incs.index(inc)}.jsonl"
            if host in self.faulted or inc in self.silent or not path.exists() or now - inc.start < 2 * SILENT:
                continue
            if now - path.stat().st_mtime > SILENT and now - self.newest() < 5.0:
                self.silent.append(inc)
                self.note(f"host {host} silent {SILENT:g} s while the others go on")
                if shutil.which("py-spy"):
                    with open(self.dir / f"stack{self.incs.index(inc)}.txt", "w") as f:
                        subprocess.run(["py-spy", "dump", "--pid", str(p.pid)], stdout=f, stderr=subprocess.STDOUT,
                                       timeout=30)

    def rejoined(self) -> None:
        """Hosts back from a fault (or joined) whose first round with others is recorded are
        healthy again; one not back within ``REJOIN_LIMIT`` s is noted and counted healthy."""
        now = time.time()
        for host, (since, what) in list(self.back.items()):
            live = self.live.get(host)
            path = self.dir / f"m{self.incs.index(live[1])}.jsonl" if live else None
            text = path.read_text() if path and path.exists() else ""
            recs = _soak_check.read_metrics(text)[0]
            first = next((r["time"] for r in recs if r["time"] > since and (r.get("members") or 0) >= 2), None)
            up = _soak_check.process_up(text) if what.startswith(("restart", "join")) else None
            if first is not None or now - since > REJOIN_LIMIT:
                del self.back[host]
                self.faulted.discard(host)
                kind = what.split("-")[0]
                if first is None:
                    self.stray.append(f"host {host}: no round with the others {REJOIN_LIMIT:g} s after {what}")
                    self.note(self.stray[-1])
                else:
                    self.rejoin_s.setdefault(kind, []).append(first - since)
                    if up is not None:
                        self.once_up_s.setdefault(kind, []).append(first - max(up, since))

    def newest(self) -> float:
        """The last time any live peer's metrics file grew."""
        times = [(self.dir / f"m{self.incs.index(inc)}.jsonl") for _, inc in self.live.values()]
        return max((t.stat().st_mtime for t in times if t.exists()), default=0.0)

    def reap(self) -> None:
        for host, (p, inc) in list(self.live.items()):
            if p.poll() is not None:
                inc.exit_code = p.returncode
                del self.live[host]
                if not inc.killed and p.returncode != 0:
                    self.note(f"host {host} exited {p.returncode}")

    def note(self, text: str) -> None:
        self.log.append(f"{time.time() - self.t0:7.1f}s {text}")
        if self.a.verbose:
            print(f"[{self.label}] {self.log[-1]}", file=sys.stderr, flush=True)

    # -- faults
    def later(self, delay: float, what: str, host: int) -> None:
        self.seq += 1
        heapq.heappush(self.recoveries, (time.monotonic() + delay, self.seq, what, host))

    def inject(self, kind: str) -> bool:
        """Inject ``kind`` on a random eligible host; False: none eligible now."""
        a, rng = self.a, self.rng
        if kind == "join":
            spare = [h for h in range(self.n_hosts) if h not in self.started]
            if not spare:
                return False
            host = spare[0]
            self.start(host)
            self.faulted.add(host)
            self.back[host] = (time.time(), "join")
            self.events.append((time.time(), "join", host))
            self.note(f"join: host {host}")
            return True
        healthy = sorted(h for h in self.live if h not in self.faulted)
        if len(healthy) <= 2:
            return False
        host = rng.choice(healthy)
        p, inc = self.live[host]
        self.faulted.add(host)
        self.events.append((time.time(), kind, host))
        if kind == "kill":
            inc.killed = True
            os.kill(p.pid, signal.SIGKILL)
            fresh = rng.random() < 0.5
            self.later(rng.uniform(*a.restart), "restart-fresh" if fresh else "restart", host)
            self.note(f"kill -9: host {host}" + (" (rejoins fresh)" if fresh else " (resumes its checkpoint)"))
        elif kind == "stop":
            os.kill(p.pid, signal.SIGSTOP)
            self.later(rng.uniform(*a.stop), "cont", host)
            self.note(f"SIGSTOP: host {host}")
        else:
            self.lan.set_link(host, False)
            self.later(rng.uniform(*a.link), "up", host)
            self.note(f"link down: host {host}")
        return True

    def recover(self, what: str, host: int) -> None:
        self.back[host] = (time.time(), what)
        self.events.append((time.time(), what, host))
        if what.startswith("restart"):
            self.live.pop(host, None)
            self.start(host, fresh=what == "restart-fresh")
        elif what == "cont":
            p, _ = self.live.get(host, (None, None))
            if p is not None and p.poll() is None:
                os.kill(p.pid, signal.SIGCONT)
        else:
            self.lan.set_link(host, True)
        self.note(f"{what}: host {host}")

    # -- the run
    def run(self) -> _soak_check.Figures:
        a = self.a
        self.t0 = time.time()
        try:
            for h in range(a.peers):
                self.start(h)
            begun = self.wait_members()
            self.ends_at = begun + a.seconds
            # (offsets from the launch, which is before the cluster's --duration began: no fault
            # or recovery comes near its end)
            plan = [(max(begun, self.t0 + t), kind) for t, kind in self.plan]
            end = begun + a.seconds + a.grace
            next_sample = 0.0
            while self.live and time.time() < end:
                now = time.time()
                due = [f for f in plan if f[0] <= now]
                for f in due:  # (in order; one with no eligible host now waits a second)
                    plan.remove(f)
                    if self.inject(f[1]):
                        self.injected.append((now, f[1]))
                    elif now < self.t0 + LAST_TRY * a.seconds:
                        plan.append((now + 1.0, f[1]))
                    else:
                        self.skipped.append(f[1])
                        self.note(f"{f[1]}: no eligible host before the window closed; not injected")
                plan.sort()
                while self.recoveries and self.recoveries[0][0] <= time.monotonic():
                    _, _, what, host = heapq.heappop(self.recoveries)
                    self.recover(what, host)
                if now >= next_sample:
                    self.sample()
                    self.watch()
                    self.rejoined()
                    next_sample = now + SAMPLE_EVERY
                self.reap()
                time.sleep(POLL)
            for host, (p, inc) in list(self.live.items()):  # past the deadline: hangs
                inc.hung = True
                self.note(f"host {host} still running {a.grace:g} s after the run's end: killed")
                _kill(p)
            self.reap()
        finally:
            for p, _ in self.live.values():
                _kill(p)
            while self.recoveries:                        # a link left down is brought back up
                _, _, what, host = heapq.heappop(self.recoveries)
                if what == "up":
                    self.lan.set_link(host, True)
        for n, inc in enumerate(self.incs):
            path = self.dir / f"m{n}.jsonl"
            inc.records, inc.summary = _soak_check.read_metrics(path.read_text() if path.exists() else "")
        for inc in self.silent:
            inc.silent = True
        return _soak_check.check(self.incs, self.injected, begun, a.settle, self.events)

    def wait_members(self) -> float:
        """Until a round record shows every first peer a member (bounded): that time."""
        deadline = time.time() + self.a.start_timeout
        while time.time() < deadline:
            for n in range(len(self.incs)):
                path = self.dir / f"m{n}.jsonl"
                if path.exists():
                    recs, _ = _soak_check.read_metrics(path.read_text())
                    if any((r.get("members") or 0) >= self.a.peers for r in recs):
                        return time.time()
            self.reap()
            if len(self.live) < self.a.peers:
                break
            time.sleep(0.5)
        raise RuntimeError(f"{self.label}: the {self.a.peers} peers did not form a cluster within "
                           f"{self.a.start_timeout:g} s; their output is in {self.dir}")


def _kill(p: subprocess.Popen) -> None:
    if p.poll() is None:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            p.kill()
        p.wait(timeout=10)


def report(a, faulty: _soak_check.Figures, base: _soak_check.Figures | None, soak: Soak) -> str:
    mib = 1 << 20
    rows = [["faults injected", ", ".join(f"{k} {faulty.faults.get(k, 0)}" for k in KINDS)
             + f" ({sum(faulty.faults.values())}; {len(soak.skipped)} found no eligible peer in time)"],
            ["rounds completed", f"{faulty.rounds}" + (f" (fault-free: {base.rounds})" if base else "")],
            ["samples lost", f"{faulty.lost} (reported dropped: {faulty.dropped}; updates not adding up: "
                             f"{faulty.split_rounds})"],
            ["samples applied alone", f"{faulty.alone} (in a peer's own lineage until it reached the others)"],
            ["checksums", f"{faulty.checksum_versions} commits compared, {len(faulty.checksum_disagree)} differ "
                          f"within one; {len(faulty.end_checksums)} at the end; {faulty.split_versions} versions "
                          "committed by two lineages (a split)"],
            ["longest stall", f"{faulty.longest_stall:.1f} s" + (f" (fault-free: {base.longest_stall:.1f} s)" if base
                                                                 else "")],
            ["fewest updates after a fault", f"{faulty.min_rounds_after_fault} in {a.settle:g} s"],
            ["throughput kept", f"{100 * faulty.rate / base.rate:.1f} % ({faulty.rate:.0f} of {base.rate:.0f} "
                                "samples/s, machine shared)" if base and base.rate else f"{faulty.rate:.0f} samples/s"],
            ["capacity present", f"{100 * faulty.capacity:.1f} % of the peer-seconds (killed until back in a round, "
                                 "stopped, unplugged: absent)"],
            ["throughput kept per capacity", f"{100 * faulty.rate / base.rate / faulty.capacity:.1f} % (what the "
                                             "handling of the faults kept)" if base and base.rate and faulty.capacity
             else "-"],
            ["throughput kept, same peers", (f"{100 * faulty.kept_same_peers:.1f} % (against this run's quiet "
             f"{_soak_check.QUIET_S:g} s windows with every peer started: " + ", ".join(
                 f"{n} peers {r:.0f}" for n, r in faulty.quiet_rates.items()) + " samples/s)")
             if faulty.kept_same_peers else "- (no quiet window)"],
            [f"longest wait for an update {a.settle:g} s after (median/max s)", ", ".join(
                f"{k} {statistics.median(v):.1f}/{max(v):.1f}" for k, v in sorted(faulty.waits.items()))],
            [f"stalls (> {_soak_check.STALL_FACTOR:g} usual gaps) by cause", ", ".join(
                f"{k} {n} ({s:.0f} s lost, longest {m:.1f})" for k, (n, s, m) in
                sorted(faulty.stalls.items(), key=lambda x: -x[1][1])) or "none"],
            ["hangs / stuck / failed exits", f"{len(faulty.hangs)} / {len(faulty.stuck)} / {len(faulty.bad_exits)}"],
            ["back in a round after (max s; once its process is up)", ", ".join(
                f"{k} {max(v):.1f}" + (f" ({max(soak.once_up_s[k]):.1f})" if k in soak.once_up_s else "")
                for k, v in sorted(soak.rejoin_s.items()))
             + (f"; {len(soak.stray)} not within {REJOIN_LIMIT:g} s" if soak.stray else "")]]
    for host, r0, r1, f0, f1 in faulty.usage:
        rows.append([f"host {host} RSS, fds start/end", f"{r0 / mib:.0f}/{r1 / mib:.0f} MiB, {f0}/{f1}"])
    return _common.table(rows, ["soak", f"{a.peers} peers + {a.joiners} joining, {a.seconds:g} s, {a.rate}, "
                                        f"seed {a.seed}"])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--long", action="store_true", help="900 s, 110 faults, 2 joiners (the defaults' long run)")
    p.add_argument("--seconds", type=float, help="the run's duration (60; --long 900)")
    p.add_argument("--faults", type=int, help="faults to inject (12; --long 110)")
    p.add_argument("--peers", type=int, help="peers started at once (3; --long 4)")
    p.add_argument("--joiners", type=int, help="peers that join during the run (1; --long 2)")
    p.add_argument("--rate", default="100mbit", help="each host's link, both ways (100mbit)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model-size", default="100k")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--step-delay", type=float, default=0.0, help="each peer sleeps this long a step (a GPU's "
                   "regime: the core free; the CI run, so that its peers leave the tests beside it a core)")
    p.add_argument("--sync-every", help="train in local-steps mode, rounds every H steps or by time (1s, auto); "
                                        "default: gradient rounds")
    p.add_argument("--stop", help="SIGSTOP lasts MIN,MAX seconds (2,6; --long 5,60)")
    p.add_argument("--link", help="a link is down MIN,MAX seconds (1,5; --long 2,20)")
    p.add_argument("--restart", help="a killed peer starts again MIN,MAX seconds later (0.5,2; --long 1,5)")
    p.add_argument("--settle", type=float, default=10.0, help="updates are counted this long after each fault")
    p.add_argument("--grace", type=float, default=45.0, help="seconds past the run's end before a peer is a hang")
    p.add_argument("--start-timeout", type=float, default=90.0)
    p.add_argument("--baseline-seconds", type=float, help="the fault-free run's duration (the faulty one's)")
    p.add_argument("--no-baseline", dest="baseline", action="store_false")
    p.add_argument("--json", help="write the figures here")
    p.add_argument("--keep", action="store_true", help="keep the peers' output and metrics (kept anyway on a finding)")
    p.add_argument("--verbose", "-v", action="store_true", help="each fault as it happens, on stderr")
    a = p.parse_args(argv)
    a.seconds = a.seconds or (900.0 if a.long else 60.0)
    a.faults = a.faults if a.faults is not None else (110 if a.long else 12)
    a.peers = a.peers or (4 if a.long else 3)
    a.joiners = a.joiners if a.joiners is not None else (2 if a.long else 1)
    a.stop = tuple(float(x) for x in (a.stop or ("5,60" if a.long else "2,6")).split(","))
    a.link = tuple(float(x) for x in (a.link or ("2,20" if a.long else "1,5")).split(","))
    a.restart = tuple(float(x) for x in (a.restart or ("1,5" if a.long else "0.5,2")).split(","))
    if a.peers < 3:
        p.error("--peers must be >= 3 (two stay healthy while a third is under a fault)")
    ok, reason = netns.netns_available()
    if not ok:
        print(f"soak: {reason}", file=sys.stderr)
        return 2
    _common.finally_on_sigterm()
    a.tmp = tempfile.mkdtemp(prefix="p2pt-soak-")
    lan = netns.EmulatedLan(a.peers + a.joiners, rate=a.rate)
    found: list[str] = ["unfinished"]
    try:
        lan.start()
        base = None
        if a.baseline:
            seconds, a.seconds = a.seconds, a.baseline_seconds or a.seconds
            base = Soak(a, lan, "baseline", faults=False).run()
            a.seconds = seconds
        soak = Soak(a, lan, "faults", faults=True)
        faulty = soak.run()
        print("\n".join(soak.log))
        print(report(a, faulty, base, soak))
        found = _soak_check.problems(faulty) + soak.stray + [f"fault-free run: {x}" for x in
                                                 (_soak_check.problems(base) if base else [])]
        for line in found:
            print(f"FINDING: {line}")
        if a.json:
            Path(a.json).write_text(json.dumps({"faulty": vars(faulty), "baseline": base and vars(base),
                                                "events": soak.events},
                                               default=lambda o: sorted(o) if isinstance(o, set) else str(o)))
        if found or a.keep:
            print(f"peers' output kept in {soak.dir}")
        return 1 if found else 0
    finally:
        lan.close()
        if not found and not a.keep:
            shutil.rmtree(a.tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
