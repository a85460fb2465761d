"""Discovery over real UDP sockets.

In the root namespace every test stays on loopback (``interface="lo"``, a private port):
nothing is ever sent to the machine's real network. Tests marked ``netns`` build their own
LAN (a bridge in its own namespace, one namespace per host, 10.78.0.0/24) and run each
peer as a separate process, with no static peers; they need root and ``ip``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from p2ptrain.net import discovery as discovery_mod
from p2ptrain.net import wire
from p2ptrain.net.discovery import Discovery, parse_host_port, peer_list, resolve_static_peers
from p2ptrain.errors import ConfigError

REPO = Path(__file__).resolve().parent.parent
GROUP = "239.255.77.77"


def free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def lo_multicast_works(port: int) -> bool:
    """Whether this kernel loops multicast back on lo (one datagram, to lo only)."""
    r = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        r.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        r.bind(("", port))
        mreq = socket.inet_aton(GROUP) + socket.inet_aton("127.0.0.1")
        r.setsockopt(socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP, mreq)
        r.settimeout(1.0)
        s.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_IF, socket.inet_aton("127.0.0.1"))
        s.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_TTL, 1)
        s.sendto(b"probe", (GROUP, port))
        return r.recvfrom(16)[0] == b"probe"
    except OSError:
        return False
    finally:
        r.close()
        s.close()


@pytest.fixture
def lo_port():
    port = free_udp_port()
    if not lo_multicast_works(port):
        pytest.skip("this kernel does not loop multicast back on lo")
    return port


def on_lo(cluster: str, pid: str, port: int, udp_port: int, **kw) -> Discovery:
    return Discovery(cluster, pid, port, kw.pop("secret", None), interface="lo", udp_port=udp_port, **kw)


def ids(heard) -> set[str]:
    return {p.beacon.peer_id for p in heard}


# -- root namespace, loopback only ------------------------------------------------------------

@pytest.mark.timeout(20)
async def test_two_peers_on_loopback_hear_each_other(lo_port):
    async with on_lo("lab", "peer-a", 7000, lo_port, device="cuda", state_fn=lambda: (5, "training")) as a, \
            on_lo("lab", "peer-b", 7001, lo_port) as b:
        heard_a = await a.wait_for(lambda h: "peer-b" in ids(h), timeout=5)
        heard_b = await b.wait_for(lambda h: "peer-a" in ids(h), timeout=5)
        (pb,), (pa,) = heard_a, heard_b
        assert (pb.ip, pb.beacon.port, pb.beacon.device) == ("127.0.0.1", 7001, "cpu")
        assert (pa.beacon.device, pa.beacon.round, pa.beacon.state) == ("cuda", 5, "training")
        assert a.addresses() == [("127.0.0.1", 7001)]
        assert a.interfaces[0].name == "lo" and a._destinations == [((GROUP, lo_port), f"to {GROUP} via lo")]


@pytest.mark.timeout(20)
async def test_unicast_targets_on_private_ports():
    pa, pb = free_udp_port(), free_udp_port()
    async with on_lo("lab", "peer-a", 7000, pa, targets=[("127.0.0.1", pb)]) as a, \
            on_lo("lab", "peer-b", 7001, pb, targets=[("127.0.0.1", pa)]) as b:
        await a.wait_for(lambda h: ids(h) == {"peer-b"}, timeout=5)
        await b.wait_for(lambda h: ids(h) == {"peer-a"}, timeout=5)


@pytest.mark.timeout(20)
async def test_other_cluster_and_wrong_secret_are_counted_never_heard(lo_port):
    async with on_lo("lab", "peer-a", 7000, lo_port, secret=b"s3cret") as a, \
            on_lo("lab", "peer-b", 7001, lo_port, secret=b"s3cret") as b, \
            on_lo("lab", "peer-bad", 7002, lo_port, secret=b"wrong"), \
            on_lo("other", "peer-o", 7003, lo_port, secret=b"s3cret"):
        await a.wait_for(lambda h: ids(h) == {"peer-b"}, timeout=5)
        for _ in range(50):  # counters change without a change in who is heard: poll them
            if a.filter.counts["bad_tag"] and a.filter.counts["other_cluster"] and a.filter.counts["own"]:
                break
            await asyncio.sleep(0.1)
        assert a.filter.counts["bad_tag"] and a.filter.counts["other_cluster"] and a.filter.counts["own"]
        assert ids(a.heard()) == {"peer-b"} and ids(b.heard()) <= {"peer-a"}


@pytest.mark.timeout(20)
async def test_leaving_peer_disappears_before_its_ttl(lo_port):
    async with on_lo("lab", "peer-a", 7000, lo_port) as a:
        async with on_lo("lab", "peer-b", 7001, lo_port):
            await a.wait_for(lambda h: ids(h) == {"peer-b"}, timeout=5)
        t = time.monotonic()
        await a.wait_for(lambda h: not h, timeout=2)
        assert time.monotonic() - t < 1.0  # the leaving beacon, not the 5 s expiry


@pytest.mark.timeout(20)
async def test_silent_peer_expires_after_ttl(lo_port):
    async with on_lo("lab", "peer-a", 7000, lo_port, ttl=1.0) as a:
        b = on_lo("lab", "peer-b", 7001, lo_port)
        await b.__aenter__()
        await a.wait_for(lambda h: ids(h) == {"peer-b"}, timeout=5)
        await b._tasks.close()  # b's beacon loop stops: b goes silent without saying goodbye
        b._ssock.close()
        b._ssock = None
        await a.wait_for(lambda h: not h, timeout=3)
        await b.close()


@pytest.mark.timeout(20)
async def test_one_warning_when_nobody_is_heard(lo_port, caplog):
    caplog.set_level(logging.WARNING, logger="p2ptrain.net.discovery")
    async with on_lo("lab", "alone", 7000, lo_port, silence_warning_after=0.3):
        await asyncio.sleep(1.5)
    warnings = [r.getMessage() for r in caplog.records if "heard in" in r.getMessage()]
    assert len(warnings) == 1
    (w,) = warnings
    for cause in ("firewall", "macOS", "Wi-Fi", "multicast", "VPN", "--peers host:port"):
        assert cause in w
    assert "not even this peer's own" not in w  # it did hear itself: the port is open


@pytest.mark.timeout(20)
async def test_no_warning_with_static_peers(lo_port, caplog):
    caplog.set_level(logging.WARNING, logger="p2ptrain.net.discovery")
    async with on_lo("lab", "alone", 7000, lo_port, silence_warning_after=0.2, static_peers=["127.0.0.1:7100"]) as d:
        await asyncio.sleep(0.6)
        assert d.addresses() == [("127.0.0.1", 7100)]
    assert not [r for r in caplog.records if "heard in" in r.getMessage()]


@pytest.mark.timeout(10)
async def test_wait_for_times_out():
    async with on_lo("lab", "peer-a", 7000, free_udp_port(), silence_warning_after=None) as a:
        with pytest.raises(asyncio.TimeoutError):
            await a.wait_for(lambda h: len(h) >= 1, timeout=0.3)


@pytest.mark.timeout(10)
async def test_close_leaves_no_beacon_loop_behind():
    async with on_lo("lab", "peer-a", 7000, free_udp_port(), silence_warning_after=None) as a:
        await asyncio.sleep(0.05)
        assert len(a._tasks) == 1
    assert [t for t in asyncio.all_tasks() if t.get_coro().__qualname__ == "Discovery._run"] == []


@pytest.mark.timeout(10)
async def test_disabled_discovery_opens_nothing():
    async with Discovery("lab", "peer-a", 7000, enabled=False, static_peers="127.0.0.1:7001") as d:
        assert d._rsock is None and d._ssock is None and len(d._tasks) == 0
        assert d.heard() == [] and d.addresses() == [("127.0.0.1", 7001)]
        with pytest.raises(asyncio.TimeoutError):
            await d.wait_for(lambda h: bool(h), timeout=0.1)


@pytest.mark.timeout(10)
async def test_port_in_use_by_another_program_is_a_config_error():
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as other:
        other.bind(("", 0))  # no SO_REUSEADDR: nobody can share it
        with pytest.raises(ConfigError, match="discovery-port"):
            async with on_lo("lab", "peer-a", 7000, other.getsockname()[1]):
                pass


@pytest.mark.parametrize("kw,match", [({"group": "10.0.0.1"}, "multicast"), ({"udp_port": 0}, "discovery-port"),
                                      ({"interface": "nope0"}, "nope0"), ({"cluster": "x" * 65}, "cluster")])
async def test_bad_options_are_config_errors(kw, match):
    args = {"cluster": "lab", **kw}
    with pytest.raises(ConfigError, match=match):
        async with Discovery(args.pop("cluster"), "peer-a", 7000, udp_port=args.pop("udp_port", free_udp_port()),
                             **args):
            pass


@pytest.mark.timeout(20)
async def test_announce_sends_a_state_change_at_once(lo_port):
    state = [0, "syncing"]
    async with on_lo("lab", "peer-a", 7000, lo_port, beacon_interval=30, state_fn=lambda: tuple(state)) as a, \
            on_lo("lab", "peer-b", 7001, lo_port, beacon_interval=30) as b:
        await b.wait_for(lambda h: ids(h) == {"peer-a"}, timeout=5)
        state[:] = [7, "training"]
        a.announce()
        (pa,) = await b.wait_for(lambda h: h and h[0].beacon.round == 7, timeout=2)  # not the 30 s tick
        assert pa.beacon.state == "training"


@pytest.mark.timeout(20)
async def test_peers_command_on_loopback(lo_port, tmp_path, capsys):
    from p2ptrain.commands import peers as cmd_peers
    from p2ptrain.commands.cli import build_parser

    (tmp_path / "secret").write_bytes(b"s3cret\n")
    args = build_parser().parse_args(["peers", "--interface", "lo", "--discovery-port", str(lo_port), "--cluster",
                                      "lab", "--seconds", "2", "--secret-file", str(tmp_path / "secret")])
    async with on_lo("lab", "peer-a", 7000, lo_port, secret=b"s3cret", device="mps",
                     state_fn=lambda: (3, "training")), \
            on_lo("lab", "peer-w", 7001, lo_port, secret=b"wrong"):
        assert await cmd_peers._listen(args, cmd_peers.secret_option(args.secret, args.secret_file)) == 0
    out = capsys.readouterr().out
    assert "ID" in out and "peer-w" not in out
    (row,) = [line for line in out.splitlines() if "peer-a" in line]
    assert row.split() == ["peer-a", "127.0.0.1", "7000", "mps", "3", "training", "lab", str(wire.PROTOCOL_VERSION)]
    assert re.search(r"dropped beacons: \d+ with a bad tag \(last from 127.0.0.1\)", out) and "1 peer heard" in out


@pytest.mark.timeout(20)
async def test_peers_command_with_nobody_prints_the_causes(capsys):
    from p2ptrain.commands import peers as cmd_peers
    from p2ptrain.commands.cli import build_parser

    args = build_parser().parse_args(["peers", "--interface", "lo", "--discovery-port", str(free_udp_port()),
                                      "--seconds", "0.3"])
    assert await cmd_peers._listen(args, None) == 0
    out = capsys.readouterr().out
    assert "no peer of cluster 'default' heard" in out and "firewall" in out and "--peers host:port" in out


@pytest.mark.parametrize("argv,match", [(["--secret", "x", "--secret-file", "f"], "not both"),
                                        (["--secret-file", "/nonexistent/secret"], "cannot read")])
def test_peers_command_option_errors(argv, match):
    from p2ptrain.commands.cli import build_parser

    args = build_parser().parse_args(["peers", *argv])
    with pytest.raises(ConfigError, match=match):
        args._run(args)


def test_peers_command_refuses_a_bad_duration_while_parsing(capsys):
    from p2ptrain.commands.cli import build_parser

    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["peers", "--seconds", "0"])
    assert exited.value.code == 2
    assert "--seconds" in capsys.readouterr().err


# -- static peers -----------------------------------------------------------------------------

@pytest.mark.parametrize("entry,expected", [("10.0.0.2:7000", ("10.0.0.2", 7000)), ("gpu-box:7000", ("gpu-box", 7000)),
                                            ("[::1]:7000", ("::1", 7000)), (" host.lan:1 ", ("host.lan", 1))])
def test_parse_host_port(entry, expected):
    assert parse_host_port(entry) == expected


@pytest.mark.parametrize("entry", ["host", "host:", ":7000", "host:0", "host:70000", "::1:7000", "a b:7", "[::1]7000"])
def test_parse_host_port_refuses(entry):
    with pytest.raises(ConfigError) as err:
        parse_host_port(entry)
    assert repr(entry) in str(err.value)


async def test_resolve_static_peers_gives_every_address(monkeypatch):
    loop = asyncio.get_running_loop()

    async def fake_getaddrinfo(host, port, type=0):
        if host == "multi.lan":
            return [(socket.AF_INET, type, 6, "", (ip, port)) for ip in ("10.0.0.5", "10.0.0.6")]
        if host == "missing.lan":
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [(socket.AF_INET, type, 6, "", (host, port))]

    monkeypatch.setattr(loop, "getaddrinfo", fake_getaddrinfo)
    assert await resolve_static_peers("multi.lan:7000,10.0.0.9:7001, 10.0.0.5:7000") == [
        ("10.0.0.5", 7000), ("10.0.0.6", 7000), ("10.0.0.9", 7001)]
    with pytest.raises(ConfigError, match="'missing.lan:7000'"):
        await resolve_static_peers(["10.0.0.9:7001", "missing.lan:7000"])
    with pytest.raises(ConfigError, match="'nocolon'"):
        await resolve_static_peers(["nocolon"])


async def test_resolve_static_peers_for_real_on_loopback():
    assert ("127.0.0.1", 7000) in await resolve_static_peers(["localhost:7000"])
    assert await resolve_static_peers(["[::1]:7000", "127.0.0.1:7001"]) == [("::1", 7000), ("127.0.0.1", 7001)]
    assert await resolve_static_peers([]) == []


# -- network namespaces ---------------------------------------------------------------------------

# A peer process (importing p2ptrain does not import torch: discovery starts fast).
CHILD = r'''
import asyncio, json, logging, sys, time
logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(levelname)s %(message)s")
from p2ptrain.net.discovery import Discovery
cfg = json.loads(sys.argv[1])

def snapshot(d):
    return {p.beacon.peer_id: p.ip for p in d.heard()}

async def main():
    start = time.time()
    secret = cfg["secret"].encode() if cfg.get("secret") else None
    d = Discovery(cfg["cluster"], cfg["id"], cfg.get("port", 7000), secret, udp_port=cfg["udp_port"],
                  targets=[tuple(t) for t in cfg.get("targets", [])], silence_warning_after=None)
    async with d:
        print(json.dumps({"event": "start", "time": start}), flush=True)
        end, seen = start + cfg["seconds"], None
        while time.time() < end:
            if snapshot(d) != seen:
                seen = snapshot(d)
                print(json.dumps({"event": "heard", "time": time.time(), "heard": seen}), flush=True)
            try:
                await d.wait_for(lambda h: snapshot(d) != seen, timeout=max(0.01, end - time.time()))
            except asyncio.TimeoutError:
                pass
        print(json.dumps({"event": "end", "counts": d.filter.counts, "send_errors": d.send_errors,
                          "sent": d.sent, "interfaces": [i.name for i in d.interfaces]}), flush=True)

asyncio.run(main())
'''


def _sh(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(argv, check=check, capture_output=True, text=True, timeout=15)


class Lan:
    """A bridge in its own namespace and ``n`` host namespaces (eth0 = 10.78.0.11, .12, ...)."""

    def __init__(self, n: int):
        prefix = f"p2pd-{os.getpid()}-"
        self.bridge = prefix + "br"
        self.hosts = [f"{prefix}h{i}" for i in range(n)]
        self.addresses = [f"10.78.0.{11 + i}" for i in range(n)]
        self.procs: list[subprocess.Popen] = []

    def up(self) -> None:
        _sh("ip", "netns", "add", self.bridge)
        _sh("ip", "-n", self.bridge, "link", "add", "br0", "type", "bridge")
        _sh("ip", "-n", self.bridge, "link", "set", "br0", "type", "bridge", "mcast_snooping", "0")
        _sh("ip", "-n", self.bridge, "link", "set", "br0", "up")
        for i, (ns, addr) in enumerate(zip(self.hosts, self.addresses)):
            _sh("ip", "netns", "add", ns)
            _sh("ip", "link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", f"v{i}", "netns", self.bridge)
            _sh("ip", "-n", self.bridge, "link", "set", f"v{i}", "master", "br0", "up")
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
            _sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "brd", "+", "dev", "eth0")
            _sh("ip", "-n", ns, "link", "set", "eth0", "up")
            _sh("ip", "-n", ns, "route", "add", "224.0.0.0/4", "dev", "eth0")

    def down(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=5)
        self.procs.clear()
        for ns in [*self.hosts, self.bridge]:
            _sh("ip", "netns", "del", ns, check=False)

    def flood(self, what: str, on: bool) -> None:
        """Let the bridge forward (or drop) multicast or broadcast to every host, like a Wi-Fi AP."""
        for i in range(len(self.hosts)):
            _sh("bridge", "-n", self.bridge, "link", "set", "dev", f"v{i}", what, "on" if on else "off")

    def multicast_route(self, host: int, present: bool) -> None:
        _sh("ip", "-n", self.hosts[host], "route", "add" if present else "del", "224.0.0.0/4", "dev", "eth0",
            check=False)

    def spawn(self, host: int, argv: list[str]) -> subprocess.Popen:
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        p = subprocess.Popen(["ip", "netns", "exec", self.hosts[host], *argv], cwd=REPO, env=env, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.procs.append(p)
        return p

    def peer(self, host: int, **cfg) -> subprocess.Popen:
        return self.spawn(host, [sys.executable, "-c", CHILD, json.dumps(cfg), str(REPO / "p2ptrain")])


def collect(procs: dict[str, subprocess.Popen], timeout: float) -> dict[str, dict]:
    """Wait for every child; its events by name, plus stderr. Kills what overruns."""
    out = {}
    deadline = time.monotonic() + timeout
    for name, p in procs.items():
        try:
            stdout, stderr = p.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            stdout, stderr = p.communicate()
        events = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
        assert p.returncode == 0, f"{name} exited {p.returncode}: {stderr}"
        out[name] = {"events": events, "stderr": stderr,
                     "start": next(e["time"] for e in events if e["event"] == "start"),
                     "end": next(e for e in events if e["event"] == "end")}
    return out


def first_time_heard_all(result: dict, wanted: set[str]) -> float | None:
    for e in result["events"]:
        if e["event"] == "heard" and wanted <= set(e["heard"]):
            return e["time"]
    return None


def _netns_unavailable() -> str | None:
    if not sys.platform.startswith("linux"):
        return "network namespaces are Linux only"
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    if not shutil.which("ip") or not shutil.which("bridge"):
        return "needs iproute2 (ip, bridge)"
    return None


@pytest.fixture(scope="module")
def lan():
    reason = _netns_unavailable()
    if reason:
        pytest.skip(reason)
    lan = Lan(5)
    try:
        try:
            lan.up()
        except subprocess.CalledProcessError as exc:
            pytest.skip(f"cannot build network namespaces here: {exc.stderr.strip()}")
        yield lan
    finally:
        lan.down()


@pytest.mark.netns
@pytest.mark.timeout(30)
def test_three_namespaced_peers_find_each_other(lan):
    port, secret = 30001, "s3cret"
    procs = {f"p{i}": lan.peer(i, cluster="lab", id=f"p{i}", secret=secret, udp_port=port, seconds=2.5)
             for i in range(3)}
    procs["wrong"] = lan.peer(3, cluster="lab", id="wrong", secret="not the secret", udp_port=port, seconds=2.5)
    procs["other"] = lan.peer(4, cluster="other", id="other", secret=secret, udp_port=port, seconds=2.5)
    res = collect(procs, timeout=20)
    members = {"p0", "p1", "p2"}
    for i in range(3):
        r = res[f"p{i}"]
        expected = {f"p{j}": lan.addresses[j] for j in range(3) if j != i}
        assert expected in [e["heard"] for e in r["events"] if e["event"] == "heard"], r["stderr"]
        assert all(e["heard"].keys() <= members for e in r["events"] if e["event"] == "heard")  # never accepted
        counts = r["end"]["counts"]
        assert counts["bad_tag"] >= 1 and counts["other_cluster"] >= 1 and counts["own"] >= 1
        assert r["end"]["interfaces"] == ["eth0"] and not r["end"]["send_errors"]
        assert "bad tag from 10.78.0.14" in r["stderr"]  # logged once, not per beacon
        assert r["stderr"].count("bad tag") == 1
    assert not [e for e in res["wrong"]["events"] if e["event"] == "heard" and e["heard"]]
    assert not [e for e in res["other"]["events"] if e["event"] == "heard" and e["heard"]]
    last_start = max(res[n]["start"] for n in members)
    took = max(first_time_heard_all(res[n], members - {n}) for n in members) - last_start
    print(f"\n3 namespaced peers heard each other {took * 1000:.0f} ms after the last one started")
    assert took < 5.0


@pytest.mark.netns
@pytest.mark.timeout(30)
@pytest.mark.parametrize("dropped", ["mcast_flood", "bcast_flood"])
def test_each_path_alone_is_enough(lan, dropped):
    """A network that drops multicast (Wi-Fi) still gets broadcasts, and the reverse;
    and neither a default route nor a multicast route is needed."""
    port = 30002 if dropped == "mcast_flood" else 30003
    try:
        lan.flood(dropped, False)
        lan.multicast_route(0, False)
        lan.multicast_route(1, False)
        procs = {f"p{i}": lan.peer(i, cluster="lab", id=f"p{i}", udp_port=port, seconds=2.5,
                                   targets=[["10.99.0.1", port]]) for i in range(2)}
        res = collect(procs, timeout=20)
    finally:
        lan.flood(dropped, True)
        lan.multicast_route(0, True)
        lan.multicast_route(1, True)
    for i in range(2):
        r = res[f"p{i}"]
        assert first_time_heard_all(r, {f"p{1 - i}"}) is not None, r["stderr"]
        errors = r["end"]["send_errors"]
        assert list(errors) == [f"to 10.99.0.1:{port}"] and errors[f"to 10.99.0.1:{port}"] >= 2  # no route there
        assert r["stderr"].count("cannot send beacons") == 1


@pytest.mark.netns
@pytest.mark.timeout(30)
def test_peers_on_one_host_and_another_all_hear_each_other(lan):
    port = 30004
    procs = {"a": lan.peer(0, cluster="lab", id="a", port=7000, udp_port=port, seconds=2.5),
             "b": lan.peer(0, cluster="lab", id="b", port=7001, udp_port=port, seconds=2.5),
             "c": lan.peer(1, cluster="lab", id="c", port=7000, udp_port=port, seconds=2.5)}
    res = collect(procs, timeout=20)
    for name in procs:
        assert first_time_heard_all(res[name], set(procs) - {name}) is not None, res[name]["stderr"]
    assert {"a": lan.addresses[0], "b": lan.addresses[0]} in [e["heard"] for e in res["c"]["events"]
                                                              if e["event"] == "heard"]


@pytest.mark.netns
@pytest.mark.timeout(30)
def test_peers_command_lists_a_namespaced_sender(lan):
    port = 30005
    # The senders outlive the command (which imports torch: slow to start), then are killed.
    senders = [lan.peer(0, cluster="demo", id="sender-0", port=7123, udp_port=port, seconds=25),
               lan.peer(2, cluster="elsewhere", id="sender-x", port=7124, udp_port=port, seconds=25)]
    try:
        cmd = lan.spawn(1, [sys.executable, "-m", "p2ptrain", "peers", "--seconds", "2", "--cluster", "demo",
                            "--discovery-port", str(port)])
        out, err = cmd.communicate(timeout=20)
    finally:
        for p in senders:
            p.kill()
            p.wait(timeout=5)
    assert cmd.returncode == 0, err
    (row,) = [line for line in out.splitlines() if "sender-0" in line]
    assert row.split() == ["sender-0", lan.addresses[0], "7123", "cpu", "0", "syncing", "demo",
                           str(wire.PROTOCOL_VERSION)]
    assert "sender-x" not in out and re.search(r"dropped beacons: \d+ of another cluster", out)
    assert "eth0 (10.78.0.12, wired)" in out


def test_default_port_is_outside_ephemeral_ranges():
    assert discovery_mod.DEFAULT_UDP_PORT < 32768


def test_peers_as_one_string_are_comma_separated_not_read_a_character_at_a_time():
    """``Peer(..., peers="10.0.0.2:7000")`` said "peer address '1' is not host:port"."""
    assert peer_list("10.0.0.2:7000") == ["10.0.0.2:7000"]
    assert peer_list("10.0.0.2:7000, [::1]:7001,") == ["10.0.0.2:7000", "[::1]:7001"]
    assert peer_list(["a:1", " b:2 ", ""]) == ["a:1", "b:2"]
    with pytest.raises(ConfigError, match="peers holds 7000, a int: give 'host:port' strings"):
        peer_list(["a:1", 7000])
    with pytest.raises(ConfigError, match="'nonsense' is not host:port"):
        peer_list("a:1,nonsense")

