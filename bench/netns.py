"""An emulated LAN on one Linux machine: network namespaces on a bridge, rate-capped.

    python bench/netns.py --hosts 3 --rate 1gbit -- python my_worker.py --flag
    python bench/netns.py --hosts 3 --rates 1gbit,1gbit,100mbit -- CMD ...
    python bench/netns.py --selftest --rate 1gbit

Importing: ``bench/`` is a folder of scripts, not a package. A script run as
``python bench/x.py`` already has ``bench/`` on ``sys.path`` and does ``import netns``;
tests and other code do ``sys.path.insert(0, str(REPO / "bench"))`` first.

Topology (nothing is created in the root namespace)::

    ns <prefix>-br:  br0 ── v0, v1, ... (bridge ports; tbf on v<i> caps host i's download)
    ns <prefix>-h<i>: lo, eth0 = 10.77.0.(10+i)/24 (tbf on eth0 caps host i's upload),
                      route 224.0.0.0/4 dev eth0 (multicast needs a route, there is no default)

Traps this avoids (measured, see shared/LAN-EMULATION.md): tbf burst >= 64 KiB (veth hands
tbf 64 KiB offload packets), tbf latency 100 ms (20 ms drops packets under a ring's load),
bridge multicast snooping off (so multicast floods like on a dumb switch), and commands
get ``GLOO_SOCKET_IFNAME=eth0`` (gloo would otherwise pick 127.0.0.1 and hang). TCP tops
out at about 0.956 of a tbf rate, since tbf counts headers.

Lifetime: ``EmulatedLan`` builds everything on ``__enter__``/``start()`` and tears it down
on ``__exit__``/``close()`` (idempotent): it SIGKILLs the process groups it started, then
any process still inside its namespaces, then deletes the namespaces (which deletes the
veth pairs and the bridge). An atexit hook does the same for every live LAN, and SIGTERM
exits through it (``_common.finally_on_sigterm``, if SIGTERM still has its default action,
which also lets a launcher's ``finally`` kill its workers first). Namespaces are
named ``p2pt-<creator pid>-<n>-...``; ``start()`` deletes ones whose creator is dead.

Failure: ``NetnsUnavailable`` (one line: what is missing and what to do) when not root,
when ``ip``/``tc`` are missing, or when namespaces cannot be made; ``netns_available()``
returns ``(ok, reason)`` for tests to skip on.
"""

from __future__ import annotations

import argparse
import atexit
import dataclasses
import functools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from typing import Sequence

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # (_common, when imported from elsewhere)
import _common  # noqa: E402

NS_PREFIX = "p2pt"
IFNAME = "eth0"
MCAST_ROUTE = "224.0.0.0/4"
TBF_LATENCY = "100ms"
_NAME_RE = re.compile(rf"^{NS_PREFIX}-(\d+)-")


class NetnsUnavailable(RuntimeError):
    """This machine (or this user) cannot build network namespaces."""


@dataclasses.dataclass(frozen=True)
class Host:
    name: str                 # "h0", "h1", ...
    ns: str                   # the namespace: `ip netns exec <ns> ...`
    ifname: str               # the host's only interface, "eth0"
    addr: str                 # "10.77.0.10"
    rate: str | None = None   # tbf rate both ways, None = uncapped


# ---------------------------------------------------------------- rates (pure)

_RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}


def parse_rate(rate: str | int | float) -> int:
    """Bits per second of a tc-style rate: ``"1gbit"``, ``"100mbit"``, ``"500kbit"``, or a number."""
    if isinstance(rate, (int, float)):
        bits = int(rate)
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]+)\s*", str(rate))
        if not m or m.group(2).lower() not in _RATE_UNITS:
            raise ValueError(f"bad rate {rate!r}: use e.g. '1gbit', '100mbit', '500kbit'")
        bits = int(float(m.group(1)) * _RATE_UNITS[m.group(2).lower()])
    if bits <= 0:
        raise ValueError(f"bad rate {rate!r}: must be positive")
    return bits


def tbf_burst(rate_bps: int) -> int:
    """tbf burst in bytes: about 2 ms of traffic, clamped to 64 KiB..1 MiB (trap 1)."""
    return max(64 * 1024, min(1024 * 1024, rate_bps // 8 // 500))


# ---------------------------------------------------------------- availability

def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    p = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and p.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed: {p.stderr.strip()}")
    return p


def _tc(ns: str, *args: str) -> None:
    p = subprocess.run(["tc", "-n", ns, *args], capture_output=True, text=True, timeout=30)
    if p.returncode != 0:
        raise RuntimeError(f"`tc -n {ns} {' '.join(args)}` failed: {p.stderr.strip()}")


def _list_netns() -> list[str]:
    out = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


@functools.cache
def netns_available() -> tuple[bool, str]:
    """Whether ``EmulatedLan`` can work here, and if not, a one-line reason for a skip."""
    if sys.platform != "linux":
        return False, "network namespaces need Linux"
    if os.geteuid() != 0:
        return False, "network namespaces need root: run as root (or skip the netns tests)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, f"`{tool}` not found: install iproute2 (apt-get install iproute2)"
    ns = f"{NS_PREFIX}-{os.getpid()}-probe"
    try:
        _ip("netns", "add", ns)
        try:
            _ip("-n", ns, "link", "add", "pb0", "type", "bridge")
            _ip("-n", ns, "link", "add", "pa", "type", "veth", "peer", "name", "pz")
            _tc(ns, "qdisc", "add", "dev", "pa", "root", "tbf", "rate", "1gbit",
                "burst", "65536", "latency", TBF_LATENCY)
        finally:
            _ip("netns", "del", ns, check=False)
    except (RuntimeError, OSError, subprocess.SubprocessError) as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        return False, (f"cannot build network namespaces ({msg}); needs CAP_SYS_ADMIN and "
                       "CAP_NET_ADMIN, e.g. a VM or `docker run --privileged`")
    return True, "ok"


def cleanup_stale() -> list[str]:
    """Delete namespaces named like ours whose creator process is dead; returns their names."""
    removed = []
    for ns in _list_netns():
        m = _NAME_RE.match(ns)
        if not m or _pid_alive(int(m.group(1))):
            continue
        _kill_ns_pids(ns)
        if _ip("netns", "del", ns, check=False).returncode == 0:
            removed.append(ns)
    return removed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _killpg(p: subprocess.Popen) -> None:
    """SIGKILL p's process group, if p is not yet reaped (so its pid is still ours)."""
    if p.poll() is None:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):  # not a group leader after all
            p.kill()


def _kill_ns_pids(ns: str) -> None:
    # Every process inside a namespace we created was started by us (or our children).
    out = _ip("netns", "pids", ns, check=False).stdout
    for tok in out.split():
        if tok.isdigit():
            try:
                os.kill(int(tok), signal.SIGKILL)
            except ProcessLookupError:
                pass


# ---------------------------------------------------------------- the LAN

_LIVE: set["EmulatedLan"] = set()
_LIVE_LOCK = threading.Lock()
_COUNTER = [0]
_HOOKS_INSTALLED = [False]


def _close_all() -> None:
    with _LIVE_LOCK:
        lans = list(_LIVE)
    for lan in lans:
        lan.close()


def live_subnets() -> dict[str, str]:
    """The host namespaces of every live LAN -> its subnet (``"10.77.0.0/24"``): where a process
    inside one of them sends, the only way out is the LAN's bridge. tests/netguard.py consults
    this to let a test that entered one of its namespaces send there, and nowhere else."""
    with _LIVE_LOCK:
        return {h.ns: f"{lan.subnet}.0/24" for lan in _LIVE for h in lan.hosts}


def _install_hooks() -> None:
    if _HOOKS_INSTALLED[0]:
        return
    _HOOKS_INSTALLED[0] = True
    atexit.register(_close_all)
    _common.finally_on_sigterm()  # (SIGTERM then exits through the atexit hook above)


class EmulatedLan:
    """N hosts (namespaces) on one bridge, each link capped by tbf both ways.

    ``rates``: one per host, each a tc rate string ("1gbit") or None for uncapped; or give
    ``rate`` for all. Use as a context manager, or ``start()`` then ``close()``.
    """

    def __init__(self, n_hosts: int, rates: Sequence[str | None] | None = None, *,
                 rate: str | None = None, subnet: str = "10.77.0",
                 tbf_latency: str = TBF_LATENCY):
        if not 1 <= n_hosts <= 240:
            raise ValueError(f"n_hosts must be 1..240, got {n_hosts}")
        if rates is None:
            rates = [rate] * n_hosts
        if len(rates) != n_hosts:
            raise ValueError(f"{len(rates)} rates for {n_hosts} hosts")
        for r in rates:
            if r is not None:
                parse_rate(r)  # fail early on a typo
        _COUNTER[0] += 1
        self.prefix = f"{NS_PREFIX}-{os.getpid()}-{_COUNTER[0]}"
        self.bridge_ns = f"{self.prefix}-br"
        self.subnet = subnet
        self.broadcast = f"{subnet}.255"
        self.tbf_latency = tbf_latency
        self.hosts = [Host(f"h{i}", f"{self.prefix}-h{i}", IFNAME, f"{subnet}.{10 + i}", r)
                      for i, r in enumerate(rates)]
        self._procs: list[subprocess.Popen] = []
        self._made: list[str] = []       # namespaces to delete, in creation order
        self._closed = False

    # -- lifecycle

    def __enter__(self) -> "EmulatedLan":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> "EmulatedLan":
        ok, reason = netns_available()
        if not ok:
            raise NetnsUnavailable(reason)
        if self._made or self._closed:
            raise RuntimeError("EmulatedLan.start() called twice")
        _install_hooks()
        cleanup_stale()
        with _LIVE_LOCK:
            _LIVE.add(self)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def _build(self) -> None:
        br = self.bridge_ns
        self._add_ns(br)
        _ip("-n", br, "link", "add", "br0", "type", "bridge", "mcast_snooping", "0")
        _ip("-n", br, "link", "set", "br0", "up")
        for i, h in enumerate(self.hosts):
            self._add_ns(h.ns)
            _ip("link", "add", IFNAME, "netns", h.ns, "type", "veth",
                "peer", "name", f"v{i}", "netns", br)
            _ip("-n", br, "link", "set", f"v{i}", "master", "br0", "up")
            _ip("-n", h.ns, "link", "set", "lo", "up")
            _ip("-n", h.ns, "addr", "add", f"{h.addr}/24", "brd", "+", "dev", IFNAME)
            _ip("-n", h.ns, "link", "set", IFNAME, "up")
            _ip("-n", h.ns, "route", "add", MCAST_ROUTE, "dev", IFNAME)
            self.set_rate(i, h.rate)

    def _add_ns(self, ns: str) -> None:
        _ip("netns", "add", ns)
        self._made.append(ns)

    def close(self) -> None:
        """Kill what we started, delete our namespaces. Idempotent; never raises."""
        if self._closed:
            return
        self._closed = True
        for p in self._procs:
            _killpg(p)
        for p in self._procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for ns in reversed(self._made):
            try:
                _kill_ns_pids(ns)
                _ip("netns", "del", ns, check=False)
            except Exception:  # noqa: BLE001 - teardown keeps going
                pass
        with _LIVE_LOCK:
            _LIVE.discard(self)

    # -- links

    def set_rate(self, i: int, rate: str | None) -> None:
        """Cap host i's upload (tbf on its eth0) and download (tbf on its bridge port)."""
        h = self.hosts[i]
        for ns, dev in ((h.ns, IFNAME), (self.bridge_ns, f"v{i}")):
            if rate is None:
                subprocess.run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"],
                               capture_output=True, timeout=30)
            else:
                bps = parse_rate(rate)
                _tc(ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{bps}bit",
                    "burst", str(tbf_burst(bps)), "latency", self.tbf_latency)
        self.hosts[i] = dataclasses.replace(h, rate=rate)

    def set_link(self, i: int, up: bool) -> None:
        """Unplug (up=False) or replug host i's cable.

        Done at the switch end (its bridge port), like pulling the cable: host i's eth0
        loses carrier but keeps its address and routes, and sends into the void.
        """
        _ip("-n", self.bridge_ns, "link", "set", f"v{i}", "up" if up else "down")

    # -- processes

    def env(self, i: int, base: dict | None = None) -> dict:
        """``base`` (default os.environ) plus the P2PTRAIN_BENCH_* and GLOO_SOCKET_IFNAME vars."""
        env = dict(os.environ if base is None else base)
        env.update({
            "P2PTRAIN_BENCH_RANK": str(i),
            "P2PTRAIN_BENCH_WORLD": str(len(self.hosts)),
            "P2PTRAIN_BENCH_ADDRS": ",".join(h.addr for h in self.hosts),
            "P2PTRAIN_BENCH_IFNAME": IFNAME,
            "GLOO_SOCKET_IFNAME": IFNAME,
        })
        return env

    def popen(self, i: int, cmd: Sequence[str], **kwargs) -> subprocess.Popen:
        """Start ``cmd`` inside host i's namespace in its own process group.

        The LAN SIGKILLs the group on close() if it still runs. kwargs go to Popen.
        """
        if self._closed or not self._made:
            raise RuntimeError("EmulatedLan is not running")
        kwargs.setdefault("start_new_session", True)
        p = subprocess.Popen(["ip", "netns", "exec", self.hosts[i].ns, *cmd], **kwargs)
        self._procs.append(p)
        return p

    def run(self, i: int, cmd: Sequence[str], timeout: float = 60, **kwargs
            ) -> subprocess.CompletedProcess:
        """Run ``cmd`` in host i's namespace to completion; output captured as text by default.

        Raises subprocess.TimeoutExpired after ``timeout`` seconds (the process is killed).
        """
        kwargs.setdefault("stdout", subprocess.PIPE)
        kwargs.setdefault("stderr", subprocess.PIPE)
        kwargs.setdefault("text", True)
        p = self.popen(i, cmd, **kwargs)
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _killpg(p)
            p.communicate()
            raise
        return subprocess.CompletedProcess(p.args, p.returncode, out, err)

    # -- measurement

    def measure_tcp(self, src: int, dst: int, seconds: float = 2.0, port: int = 5201) -> float:
        """Bits per second of one blocking TCP stream from host src to host dst.

        The receiver times from its first to its last byte. Bounded: the sender stops
        after ``seconds``, everything is killed after ``seconds + 20``.
        """
        addr = self.hosts[dst].addr
        limit = seconds + 20
        sink = self.popen(dst, [sys.executable, "-c", _TCP_SINK, addr, str(port), str(limit)],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        src_p = self.popen(src, [sys.executable, "-c", _TCP_SOURCE, addr, str(port),
                                 str(seconds)],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            _, serr = src_p.communicate(timeout=limit)
            out, err = sink.communicate(timeout=limit)
        finally:
            for p in (sink, src_p):
                _killpg(p)
                p.wait()
        if src_p.returncode != 0 or sink.returncode != 0:
            raise RuntimeError(f"measure_tcp failed: source: {serr.strip()[-300:]!r} "
                               f"sink: {err.strip()[-300:]!r}")
        r = json.loads(out)
        return r["bytes"] * 8 / r["seconds"]


# Stand-alone snippets run with `python -c` inside a namespace (stdlib only).
_TCP_SINK = r"""
import json, socket, sys, time
addr, port, limit = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
deadline = time.monotonic() + limit
ls = socket.socket(); ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
ls.bind((addr, port)); ls.listen(1); ls.settimeout(limit)
c, _ = ls.accept(); c.settimeout(5)
buf = bytearray(4 << 20); n = 0; first = None; t_last = None; n_first = 0
while time.monotonic() < deadline:
    k = c.recv_into(buf)
    if not k:
        break
    t_last = time.perf_counter()
    if first is None:
        first, n_first = t_last, k
    n += k
print(json.dumps({"bytes": n - n_first, "seconds": max(t_last - first, 1e-9)}))
"""

_TCP_SOURCE = r"""
import socket, sys, time
addr, port, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
for _ in range(200):
    try:
        s = socket.create_connection((addr, port), timeout=1); break
    except OSError:
        time.sleep(0.025)
else:
    sys.exit("cannot connect to sink")
s.settimeout(10)
data = memoryview(bytes(1 << 20)); end = time.perf_counter() + seconds
while time.perf_counter() < end:
    s.sendall(data)
s.shutdown(socket.SHUT_WR); s.recv(1); s.close()
"""


# ---------------------------------------------------------------- command line

def _run_everywhere(lan: EmulatedLan, cmd: list[str], timeout: float) -> int:
    """Run cmd once per host, stream output prefixed with the rank, return an exit code."""
    lock = threading.Lock()
    procs = []
    for i in range(len(lan.hosts)):
        env = lan.env(i)
        env["PYTHONUNBUFFERED"] = "1"
        procs.append(lan.popen(i, cmd, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, errors="replace"))

    def pump(rank: int, p: subprocess.Popen) -> None:
        for line in p.stdout:
            with lock:
                print(f"[{rank}] {line}", end="", flush=True)

    pumps = [threading.Thread(target=pump, args=(i, p), daemon=True)
             for i, p in enumerate(procs)]
    for t in pumps:
        t.start()
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in procs):
        if time.monotonic() > deadline:
            print(f"netns: timeout after {timeout:g} s, killing all", file=sys.stderr)
            return 124
        time.sleep(0.05)
    for t in pumps:
        t.join(timeout=5)
    codes = [p.returncode for p in procs]
    for i, c in enumerate(codes):
        if c != 0:
            print(f"netns: rank {i} exited with {c}", file=sys.stderr)
    return next((c if c > 0 else 1 for c in codes if c != 0), 0)


def _selftest(lan: EmulatedLan, seconds: float) -> int:
    caps = [h.rate for h in lan.hosts[:2] if h.rate is not None]
    bps = lan.measure_tcp(0, 1, seconds=seconds)
    line = f"selftest: h0 -> h1 TCP {bps / 1e9:.3f} Gbit/s ({bps / 1e6:.1f} Mbit/s)"
    if caps:
        rate = min(caps, key=parse_rate)  # h0's upload or h1's download, whichever is lower
        line += (f" = {bps / parse_rate(rate):.3f} of the nominal tbf rate {rate}"
                 " (TCP ceiling under tbf is about 0.956)")
    print(line, flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    cmd: list[str] = []
    if "--" in argv:
        k = argv.index("--")
        argv, cmd = argv[:k], argv[k + 1:]
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 usage="%(prog)s [options] -- CMD ARGS... | --selftest")
    ap.add_argument("--hosts", type=int, default=2)
    ap.add_argument("--rate", default=None, help="cap for every host, e.g. 1gbit (default none)")
    ap.add_argument("--rates", default=None, help="per-host caps, e.g. 1gbit,1gbit,100mbit "
                    "('none' = uncapped)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds before killing all")
    ap.add_argument("--selftest", action="store_true",
                    help="measure TCP throughput h0 -> h1 and exit")
    ap.add_argument("--seconds", type=float, default=2.0, help="selftest duration")
    args = ap.parse_args(argv)
    if args.rates:
        rates = [None if r.lower() == "none" else r for r in args.rates.split(",")]
        n = len(rates)
    else:
        n = max(args.hosts, 2) if args.selftest else args.hosts
        rates = [args.rate] * n
    if not args.selftest and not cmd:
        ap.error("give a command after --, or --selftest")
    try:
        with EmulatedLan(n, rates) as lan:
            if args.selftest:
                return _selftest(lan, min(args.seconds, 30.0))
            return _run_everywhere(lan, cmd, args.timeout)
    except NetnsUnavailable as e:
        print(f"netns: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
