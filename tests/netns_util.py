"""Helpers for tests that need an emulated LAN (bench/netns.py) — fixtures and probes.

    from netns_util import make_lan, requires_netns, netns

    @requires_netns
    def test_x(make_lan):
        lan = make_lan(3, ["1gbit", "1gbit", "100mbit"])   # torn down after the test

``requires_netns`` marks a test ``netns`` and skips it with netns_available()'s reason.
The probe snippets are stdlib-only programs run with ``python -c`` inside a namespace;
each is bounded in time and datagram count.
"""

from __future__ import annotations

import select
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
if str(REPO / "bench") not in sys.path:
    sys.path.insert(0, str(REPO / "bench"))

import netns  # noqa: E402  (bench/ is a folder of scripts, imported by path)

NETNS_OK, _reason = netns.netns_available()


def requires_netns(f):
    """Mark a test ``netns`` and skip it, with the reason, where namespaces cannot be built."""
    return pytest.mark.netns(pytest.mark.skipif(not NETNS_OK, reason=_reason)(f))


@pytest.fixture
def make_lan():
    """A factory of started ``EmulatedLan``s, all closed when the test ends (pass or fail)."""
    lans: list[netns.EmulatedLan] = []

    def make(n_hosts: int, rates=None, **kwargs) -> netns.EmulatedLan:
        ok, reason = netns.netns_available()
        if not ok:
            pytest.skip(reason)
        lan = netns.EmulatedLan(n_hosts, rates, **kwargs)
        lans.append(lan)
        return lan.start()

    try:
        yield make
    finally:
        for lan in lans:
            lan.close()


def wait_line(p: subprocess.Popen, expect: str, timeout: float = 10.0) -> str:
    """Read p's first stdout line (text mode) within ``timeout``; assert it starts with expect."""
    ready, _, _ = select.select([p.stdout], [], [], timeout)
    assert ready, f"no {expect!r} from {p.args[-4:]} within {timeout} s"
    line = p.stdout.readline()
    assert line.startswith(expect), f"expected {expect!r}, got {line!r}"
    return line


def py(snippet: str, *args: object) -> list[str]:
    return [sys.executable, "-c", snippet, *map(str, args)]


# Receive one datagram carrying TOKEN on PORT (joining GROUP unless "-"); bounded to 5 s.
UDP_RECV = r"""
import socket, sys, time
port, group, token = int(sys.argv[1]), sys.argv[2], sys.argv[3].encode()
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", port))
if group != "-":
    s.setsockopt(socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP,
                 socket.inet_aton(group) + socket.inet_aton("0.0.0.0"))
s.settimeout(0.25)
print("READY", flush=True)
deadline = time.monotonic() + 5
while time.monotonic() < deadline:
    try:
        data, peer = s.recvfrom(2048)
    except socket.timeout:
        continue
    if data == token:
        print("GOT", peer[0], flush=True)
        sys.exit(0)
sys.exit("no datagram within 5 s")
"""

# Send TOKEN to DEST:PORT COUNT times, 50 ms apart (broadcast and multicast allowed).
UDP_SEND = r"""
import socket, sys, time
dest, port, token, count = sys.argv[1], int(sys.argv[2]), sys.argv[3].encode(), int(sys.argv[4])
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.setsockopt(socket.SOL_SOCKET, socket.SO_BROADCAST, 1)
s.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_TTL, 1)
for _ in range(min(count, 50)):
    s.sendto(token, (dest, port))
    time.sleep(0.05)
"""

# Echo one short message per connection on ADDR:PORT; exits after LIMIT seconds.
TCP_ECHO = r"""
import socket, sys, time
addr, port, limit = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
deadline = time.monotonic() + limit
ls = socket.socket(); ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
ls.bind((addr, port)); ls.listen(8); ls.settimeout(0.25)
print("READY", flush=True)
while time.monotonic() < deadline:
    try:
        c, _ = ls.accept()
    except socket.timeout:
        continue
    with c:
        c.settimeout(2)
        try:
            c.sendall(c.recv(64))
        except OSError:
            pass
"""

# Connect to ADDR:PORT within TIMEOUT, send a token, expect it back; exit 0 if it worked.
TCP_PROBE = r"""
import socket, sys
addr, port, timeout = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
try:
    with socket.create_connection((addr, port), timeout=timeout) as s:
        s.sendall(b"p2pt-probe")
        assert s.recv(64) == b"p2pt-probe"
except (OSError, AssertionError) as e:
    sys.exit(f"probe failed: {e!r}")
print("OK", flush=True)
"""
