"""The network guard every test runs under (tests/netguard.py): loopback passes, the machine's own
network is refused with one line, and a thread inside an emulated LAN may send on that LAN."""

import ctypes
import os
import socket
import threading

import pytest

import netguard
from netns_util import make_lan, requires_netns  # noqa: F401  (make_lan is a fixture)

pytestmark = pytest.mark.timeout(60)


def guarded(call, log):
    """Run ``call`` with the guard's records going to ``log``; the refusal line, or None."""
    before = log.stat().st_size if log.exists() else 0
    try:
        call()
    except netguard.ForbiddenDestination as exc:
        lines = log.read_text()[before:].splitlines()
        assert lines and lines[0].startswith(str(exc)), lines
        return str(exc)
    return None


@pytest.fixture
def log(tmp_path, monkeypatch):
    assert netguard._INSTALLED, "the guard is not installed: the sends below would leave this machine"
    path = tmp_path / "refused.log"
    monkeypatch.setenv(netguard.LOG_ENV, str(path))
    return path


def test_loopback_passes_and_the_lan_is_refused_with_one_line(log):
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp6 = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
    try:
        udp.setsockopt(socket.SOL_SOCKET, socket.SO_BROADCAST, 1)
        for dest in ("127.0.0.1", "127.255.255.255", "localhost", "0.0.0.0"):
            assert guarded(lambda: udp.sendto(b"x", (dest, 9)), log) is None, dest
        assert guarded(lambda: udp6.sendto(b"x", ("::1", 9)), log) is None
        for dest in ("239.255.77.77", "192.168.1.255", "255.255.255.255", "<broadcast>", "10.77.0.11"):
            refused = guarded(lambda: udp.sendto(b"x", (dest, 9)), log)
            assert refused == (f"network guard: sendto to {dest}:9 refused: tests send only to loopback "
                               "(127.0.0.0/8, ::1) or from inside a network namespace they built "
                               "(tests/netns_util.py make_lan, bench/netns.py)"), dest
        tcp = socket.socket()
        try:
            assert "connect to 192.0.2.1:7000 refused" in guarded(lambda: tcp.connect_ex(("192.0.2.1", 7000)), log)
        finally:
            tcp.close()
        # a multicast group through lo stays here (discovery's loopback tests); by the routing table it does not
        assert "239.255.77.77" in guarded(lambda: udp.sendto(b"x", ("239.255.77.77", 9)), log)
        udp.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_IF, socket.inet_aton("127.0.0.1"))
        assert guarded(lambda: udp.sendto(b"x", ("239.255.77.77", 9)), log) is None
    finally:
        udp.close()
        udp6.close()
    log.unlink()  # (the refusals above were meant: this test is not failed for them)


def _in_namespace(ns: str, call):
    """``call()`` in a thread that entered namespace ``ns`` (setns moves only the calling thread)."""
    libc = ctypes.CDLL(None, use_errno=True)
    result = {}

    def body():
        fd = os.open(f"/run/netns/{ns}", os.O_RDONLY)
        try:
            if libc.setns(fd, 0x40000000) != 0:  # CLONE_NEWNET
                raise OSError(ctypes.get_errno(), "setns")
            result["value"] = call()
        except BaseException as exc:  # noqa: BLE001 - handed to the test's thread
            result["error"] = exc
        finally:
            os.close(fd)

    t = threading.Thread(target=body)  # (the thread ends, its namespace with it: the test's is untouched)
    t.start()
    t.join(timeout=20)
    if "error" in result:
        raise result["error"]
    return result.get("value")


@requires_netns
def test_a_thread_inside_a_lan_sends_on_that_lan_only(make_lan, log):  # noqa: F811  (the fixture)
    lan = make_lan(2, subnet="10.79.3")

    def udp():
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_BROADCAST, 1)
        return s

    inside, home = _in_namespace(lan.hosts[0].ns, udp), udp()  # (a socket sends in the namespace it was made in)
    try:
        for dest in ("10.79.3.11", "10.79.3.255", "239.255.77.77"):
            assert guarded(lambda: inside.sendto(b"x", (dest, 9)), log) is None, dest
            assert dest in guarded(lambda: home.sendto(b"x", (dest, 9)), log)
            assert _in_namespace(lan.hosts[0].ns, lambda: guarded(lambda: home.sendto(b"x", (dest, 9)), log))
        assert "10.80.0.1" in guarded(lambda: inside.sendto(b"x", ("10.80.0.1", 9)), log)  # off that LAN's subnet
    finally:
        inside.close()
        home.close()
    log.unlink()
