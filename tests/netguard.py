"""The rule for a test's traffic: loopback, or the inside of a network namespace the tests built.

A test must never send onto the network this machine sits on (beacons to 239.255.77.77, a
broadcast to x.x.x.255, a connection to a LAN address). ``install()`` adds an audit hook
(``sys.addaudithook``) that sees every ``socket.connect``/``connect_ex``, ``sendto`` and
``sendmsg`` with an address, in any thread, asyncio's included, and checks the destination:

- allowed: loopback (127.0.0.0/8, ::1, ::ffff:127.x), the unspecified address (0.0.0.0, ::
  and "", which Linux delivers to this host), ``localhost``, non-IP sockets (Unix, netlink),
  and a multicast group sent to through ``lo`` (the socket's IP_MULTICAST_IF is loopback);
- allowed from inside a namespace the tests built (bench/netns.py): in this process, a
  destination in that LAN's subnet (its broadcast included) or a multicast group, the
  namespaces and subnets read from ``netns.live_subnets()``; in a child process started with
  ``ip netns exec`` (which loads this module through tests/netguard_site/sitecustomize.py),
  anything, since such a namespace's only link is the emulated bridge;
- refused: everything else, hostnames included (Python resolves one before the audit event,
  so a lookup of a name that is not in /etc/hosts has already asked a DNS server).

A refused send raises ``ForbiddenDestination`` (not an OSError, so code that copes with a
network error does not swallow it) and appends a one-line record to the file named by
``$P2PTRAIN_NETGUARD_LOG``, which tests/conftest.py reads after every test to fail it, even
when the exception was caught or happened in a child process.

Not covered: what skips Python's socket methods (uvloop's own connections and datagrams go
through libuv) and programs that are not Python. ``.ci/run`` runs the suite inside
``unshare -n`` with only loopback up, where nothing can reach the real network.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import sys

LOG_ENV = "P2PTRAIN_NETGUARD_LOG"          # the file refusals are recorded in, one line each
HOME_ENV = "P2PTRAIN_NETGUARD_HOME"        # inode of the network namespace pytest started in
NS_PREFIX_ENV = "P2PTRAIN_NETGUARD_NS"     # names of the tests' namespaces start with this
_EVENTS = {"socket.connect": "connect", "socket.sendto": "sendto", "socket.sendmsg": "sendmsg"}
_INET = (socket.AF_INET, socket.AF_INET6)
_MULTICAST = (ipaddress.ip_network("224.0.0.0/4"), ipaddress.ip_network("ff00::/8"))
_LIMITED_BROADCAST = ipaddress.ip_address("255.255.255.255")


class ForbiddenDestination(RuntimeError):
    """A test sent to an address off this machine from this machine's own network."""


def netns_inode(path: str = "/proc/thread-self/ns/net") -> int | None:
    """The calling thread's network namespace (or the namespace file at ``path``), by inode."""
    try:
        return os.stat(path).st_ino
    except OSError:
        return None


_SIOCGSKNS = 0x894C  # Linux >= 4.9: a file descriptor of the namespace a socket was made in


def socket_netns_inode(sock: socket.socket) -> int | None:
    """The network namespace a socket sends in (the one it was made in, whatever thread sends)."""
    try:
        import fcntl

        fd = fcntl.ioctl(sock.fileno(), _SIOCGSKNS)
    except (ImportError, OSError, ValueError):
        return netns_inode()
    try:
        return os.fstat(fd).st_ino
    finally:
        os.close(fd)


def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])  # (fe80::1%eth0: the scope is not the address)
    except ValueError:
        return None
    return ip.ipv4_mapped or ip if ip.version == 6 else ip


def is_local(host: str) -> bool:
    """Whether a datagram or connection to ``host`` stays on this machine."""
    if host in ("", "localhost", "<any>"):
        return True
    ip = _ip(host)
    return ip is not None and (ip.is_loopback or ip.is_unspecified)


def multicast_via_loopback(sock: socket.socket, host: str) -> bool:
    """Whether ``host`` is a multicast group this socket sends to through ``lo`` only (its
    IP_MULTICAST_IF/IPV6_MULTICAST_IF set to loopback), so the datagram stays on this machine."""
    ip = _ip(host)
    if ip is None or not any(ip in net for net in _MULTICAST):
        return False
    try:
        if ip.version == 4:
            chosen = ipaddress.ip_address(sock.getsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_IF, 4))
            return chosen.is_loopback
        return sock.getsockopt(socket.IPPROTO_IPV6, socket.IPV6_MULTICAST_IF) == socket.if_nametoindex("lo")
    except (OSError, ValueError):
        return False


def in_lan(host: str, subnet: str) -> bool:
    """Whether ``host`` is on the emulated LAN ``subnet`` (its broadcast included) or a multicast
    group or the limited broadcast, which from inside the LAN go no further than its bridge."""
    ip = _LIMITED_BROADCAST if host == "<broadcast>" else _ip(host)
    if ip is None:
        return False
    return ip == _LIMITED_BROADCAST or any(ip in net for net in _MULTICAST) or ip in ipaddress.ip_network(subnet)


def _describe(event: str, address: object) -> str:
    where = f"{address[0]}:{address[1]}" if isinstance(address, tuple) and len(address) >= 2 else repr(address)
    return (f"network guard: {_EVENTS[event]} to {where} refused: tests send only to loopback (127.0.0.0/8, ::1) "
            "or from inside a network namespace they built (tests/netns_util.py make_lan, bench/netns.py)")


class Guard:
    """The audit hook's state: where this process started, and how to tell a tests' namespace."""

    def __init__(self, home: int | None, inside_ok) -> None:
        self.home = home                    # pytest's network namespace
        self.inside_ok = inside_ok          # (host, netns inode) -> bool, for a thread outside home

    def check(self, event: str, args: tuple) -> None:
        if event not in _EVENTS:
            return
        sock, address = args[0], args[1]
        if address is None or getattr(sock, "family", None) not in _INET or not isinstance(address, tuple):
            return  # a connected socket's sendmsg, a Unix or netlink socket
        host = address[0]
        if isinstance(host, bytes):
            host = host.decode("ascii", "replace")
        if not isinstance(host, str) or is_local(host) or multicast_via_loopback(sock, host):
            return
        here = socket_netns_inode(sock)
        if here is not None and here != self.home and self.inside_ok(host, here):
            return
        message = _describe(event, address)
        _record(message)
        raise ForbiddenDestination(message)


def _record(message: str) -> None:
    path = os.environ.get(LOG_ENV)
    if not path:
        return
    try:
        with open(path, "a") as f:
            program = " ".join([os.path.basename(sys.argv[0]) if sys.argv else "?", *sys.argv[1:]])
            f.write(f"{message} (pid {os.getpid()}: {program[:120]})\n")
    except OSError:
        pass


def _test_process_inside_ok(host: str, here: int) -> bool:
    """The socket was made in one of bench/netns.py's live namespaces (by a thread that entered it
    with setns): that LAN's subnet."""
    netns = sys.modules.get("netns")
    live = getattr(netns, "live_subnets", None)
    if live is None:
        return False
    return any(netns_inode(f"/run/netns/{ns}") == here and in_lan(host, subnet) for ns, subnet in live().items())


def _child_inside_ok(host: str, here: int) -> bool:
    """A child process inside a namespace named like the tests' (``ip netns exec``): its only
    link is the emulated bridge, so any destination stays on the emulated LAN."""
    prefix = os.environ.get(NS_PREFIX_ENV)
    if not prefix:
        return False
    try:
        names = [n for n in os.listdir("/run/netns") if n.startswith(prefix)]
    except OSError:
        return False
    return any(netns_inode(f"/run/netns/{n}") == here for n in names)


_INSTALLED: list[Guard] = []


def install(*, child: bool = False) -> Guard:
    """Add the audit hook to this process and return its state. ``child``: a subprocess of a
    test, whose home is pytest's namespace, read from the environment. An audit hook cannot be
    removed, so a second call (pytest-xdist's worker, itself a child, then its conftest) changes
    the one hook's rule instead of adding another."""
    if child:
        home = os.environ.get(HOME_ENV)
        home_ino, inside_ok = (int(home) if home and home.isdigit() else None), _child_inside_ok
    else:
        home_ino, inside_ok = netns_inode(), _test_process_inside_ok
    if _INSTALLED:
        _INSTALLED[0].home, _INSTALLED[0].inside_ok = home_ino, inside_ok
        return _INSTALLED[0]
    guard = Guard(home_ino, inside_ok)
    sys.addaudithook(guard.check)
    _INSTALLED.append(guard)
    return guard
