"""Socket options of a link's TCP connection: its send buffer on loopback, its receive
low-water mark on a LAN, TCP_NODELAY everywhere. Used by ``transport``."""

from __future__ import annotations

import asyncio
import ipaddress
import socket

# The send buffer of a loopback link (the kernel doubles it). On loopback the bandwidth-delay
# product is nil and the two copies (sender into the socket, receiver out of it) are the whole
# cost; an autotuned buffer grows to tcp_wmem's 4 MiB, and data that waits that long has left
# the core's cache before the receiver copies it. Measured on 2 cores (AMD EPYC, 1 MiB of L2),
# fp32 allreduce of 64 MiB: 29-31 -> 19-21 ms (N=2), 98-110 -> 73-83 ms (N=4); at 1.5 MiB it
# falls off again. LAN links keep autotuning: there the buffer must cover the link's BDP.
LOOPBACK_SNDBUF = 384 << 10

# A large payload on a LAN link is read once it has all come (SO_RCVLOWAT, set to what the
# payload still lacks), not in the ~60 KB pieces the kernel hands up as they arrive: at 1 Gbit/s
# a 512 K-value int8 chunk woke its reader about 9 times, now 3 (prefix, header, payload), and a
# 64 MiB int8 call at N = 4 costs a peer 4-6 ms less CPU (5-9 %). Those bytes are on their way
# (the frame has begun), so nothing is read later than it is needed; a link that closes or fails
# wakes its reader anyway. Not on a link to this machine: there data that waits leaves the core's
# cache before it is copied (``LOOPBACK_SNDBUF``). Where the OS lacks the option, as before.
WHOLE_PAYLOAD_BYTES = 64 << 10


def _reads_whole_payloads(sock: socket.socket) -> bool:
    return hasattr(socket, "SO_RCVLOWAT") and not _same_host(sock)


def _is_loopback(sock: socket.socket) -> bool:
    try:
        addr = ipaddress.ip_address(sock.getpeername()[0].split("%")[0])
    except (OSError, ValueError, IndexError):
        return False
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return addr.is_loopback


def _same_host(sock: socket.socket) -> bool:
    """The peer runs on this machine: a loopback address, or ours at both ends."""
    if _is_loopback(sock):
        return True
    try:
        return sock.getpeername()[0] == sock.getsockname()[0]
    except (OSError, IndexError):
        return False


def _tune_socket(transport: asyncio.BaseTransport) -> None:
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if _is_loopback(sock):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, LOOPBACK_SNDBUF)
