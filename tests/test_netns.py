"""The LAN-emulation harness (bench/netns.py) and the gloo baseline (bench/gloo_allreduce.py).

Namespace tests need root, ``ip`` and ``tc``; elsewhere they skip with the reason.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time

import pytest
from netns_util import (REPO, TCP_ECHO, TCP_PROBE, UDP_RECV, UDP_SEND, make_lan, netns,  # noqa: F401
                        py, requires_netns, wait_line)

import gloo_allreduce  # noqa: E402  (bench/ is on sys.path via netns_util)


# ---------------------------------------------------------------- pure parts

def test_parse_rate():
    assert netns.parse_rate("1gbit") == 10**9
    assert netns.parse_rate("100mbit") == 10**8
    assert netns.parse_rate("2.5Mbit") == 2_500_000
    assert netns.parse_rate(1234) == 1234
    for bad in ("1gb", "fast", "0mbit", ""):
        with pytest.raises(ValueError):
            netns.parse_rate(bad)


def test_tbf_burst_is_clamped_to_64k_1m():
    assert netns.tbf_burst(10**9) == 250_000           # about 2 ms of traffic
    assert netns.tbf_burst(10**8) == 64 * 1024          # trap 1: never below 64 KiB
    assert netns.tbf_burst(10**11) == 1024 * 1024


def test_refuses_clearly_without_root(monkeypatch):
    netns.netns_available.cache_clear()
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    try:
        ok, reason = netns.netns_available()
        assert not ok and "root" in reason
        with pytest.raises(netns.NetnsUnavailable, match="root"):
            netns.EmulatedLan(2).start()
    finally:
        netns.netns_available.cache_clear()


# ---------------------------------------------------------------- a 3-host LAN

@pytest.fixture(scope="module")
def lan3():
    ok, reason = netns.netns_available()
    if not ok:
        pytest.skip(reason)
    with netns.EmulatedLan(3, ["1gbit", "1gbit", "100mbit"]) as lan:
        yield lan


def _udp_reaches_all(lan, dest: str, group: str, port: int) -> None:
    token = f"p2pt-{port}-{time.monotonic_ns()}"
    rx = [lan.popen(i, py(UDP_RECV, port, group, token), stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE, text=True) for i in (1, 2)]
    for p in rx:
        wait_line(p, "READY")
    sent = lan.run(0, py(UDP_SEND, dest, port, token, 5), timeout=10)
    assert sent.returncode == 0, sent.stderr
    for i, p in zip((1, 2), rx):
        out, err = p.communicate(timeout=10)
        assert p.returncode == 0, f"host {i}: {err.strip()}"
        assert out.split() == ["GOT", lan.hosts[0].addr]


@requires_netns
def test_udp_broadcast_reaches_every_host(lan3):
    _udp_reaches_all(lan3, lan3.broadcast, "-", 6353)


@requires_netns
def test_udp_multicast_reaches_every_host(lan3):
    _udp_reaches_all(lan3, "239.77.0.1", "239.77.0.1", 6400)


@requires_netns
def test_tcp_connects_across(lan3):
    srv = lan3.popen(2, py(TCP_ECHO, lan3.hosts[2].addr, 7000, 10), stdout=subprocess.PIPE,
                     text=True)
    wait_line(srv, "READY")
    for src in (0, 1):
        r = lan3.run(src, py(TCP_PROBE, lan3.hosts[2].addr, 7000, 2), timeout=10)
        assert r.returncode == 0, r.stderr


@requires_netns
def test_capped_host_stays_under_its_cap(lan3):
    cap = netns.parse_rate("100mbit")
    down = lan3.measure_tcp(0, 2, seconds=0.7, port=7100)   # h2's download cap
    up = lan3.measure_tcp(2, 1, seconds=0.7, port=7101)     # h2's upload cap
    for bps in (down, up):
        assert 0.5 * cap < bps < 1.1 * cap, bps / cap


# ---------------------------------------------------------------- faults and teardown

@requires_netns
def test_link_down_makes_connect_fail_and_up_restores(make_lan):
    lan = make_lan(2, ["1gbit", "1gbit"])
    addr = lan.hosts[1].addr
    srv = lan.popen(1, py(TCP_ECHO, addr, 7200, 20), stdout=subprocess.PIPE, text=True)
    wait_line(srv, "READY")
    assert lan.run(0, py(TCP_PROBE, addr, 7200, 2), timeout=10).returncode == 0
    lan.set_link(1, up=False)
    t0 = time.monotonic()
    down = lan.run(0, py(TCP_PROBE, addr, 7200, 1), timeout=10)
    assert down.returncode != 0 and time.monotonic() - t0 < 5, down.stdout
    lan.set_link(1, up=True)
    for _ in range(10):
        if lan.run(0, py(TCP_PROBE, addr, 7200, 1), timeout=10).returncode == 0:
            break
    else:
        pytest.fail("connect still failing after set_link(up=True)")


def _our_namespaces(prefix: str) -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [ln.split()[0] for ln in out.splitlines() if ln.startswith(prefix + "-")]


@requires_netns
def test_teardown_kills_processes_and_removes_namespaces():
    lan = netns.EmulatedLan(2)
    with lan:
        assert len(_our_namespaces(lan.prefix)) == 3          # bridge + 2 hosts
        p = lan.popen(0, ["sleep", "60"])
    assert p.poll() is not None
    assert _our_namespaces(lan.prefix) == []
    lan.close()                                               # idempotent


@requires_netns
def test_command_runs_once_per_host_with_env():
    code = ("import os, sys; e = os.environ; "
            "print(e['P2PTRAIN_BENCH_RANK'], e['P2PTRAIN_BENCH_WORLD'], "
            "e['P2PTRAIN_BENCH_ADDRS'], e['P2PTRAIN_BENCH_IFNAME'], e['GLOO_SOCKET_IFNAME']); "
            "sys.exit(int(e['P2PTRAIN_BENCH_RANK']))")
    r = subprocess.run([sys.executable, str(REPO / "bench" / "netns.py"), "--hosts", "2",
                        "--rate", "1gbit", "--timeout", "30", "--", sys.executable, "-c", code],
                       capture_output=True, text=True, timeout=60)
    addrs = "10.77.0.10,10.77.0.11"
    assert f"[0] 0 2 {addrs} eth0 eth0" in r.stdout
    assert f"[1] 1 2 {addrs} eth0 eth0" in r.stdout
    assert r.returncode != 0 and "rank 1 exited with 1" in r.stderr


# ---------------------------------------------------------------- gloo baseline

def test_gloo_local_tiny():
    rows = gloo_allreduce.run_gloo(2, [1], reps=2, timeout_s=60)
    assert len(rows) == 1
    r = rows[0]
    assert r["size_bytes"] == 1 << 20 and r["n"] == 2 and r["link_bps"] is None
    for k in ("median_s", "algbw_Bps", "busbw_Bps"):
        assert math.isfinite(r[k]) and r[k] > 0, (k, r[k])
