"""Finding peers on the LAN: the thin asyncio layer that sends and hears beacons.
What a beacon says and which ones to believe is ``p2ptrain.net.beacon`` (pure); which
interfaces to use is ``p2ptrain.net.interfaces``.

A peer sends its beacon about once a second (±10 % jitter, so peers started together do
not stay in lockstep) to the multicast group on the chosen interface (TTL 1, loop on, so
peers on one host hear each other) and to the broadcast address of every usable interface
(some Wi-Fi drops multicast; a host without a multicast route still broadcasts), and once
more, early, when it hears a new peer, so that a newcomer hears everyone within a round
trip. It listens on 0.0.0.0:udp_port with SO_REUSEADDR/SO_REUSEPORT, joined to the group on
every usable interface, so several peers on one host all hear every beacon.

Discovery only proposes addresses (``addresses()``); a peer becomes a member after the
TCP handshake. Usage::

    async with Discovery("lab", peer_id, port=7000, secret=secret) as disc:
        heard = await disc.wait_for(lambda heard: len(heard) >= 2, timeout=10)

Logging: a send failure once per destination; dropped beacons at most one line per 30 s
(``BeaconFilter.take_log_lines``); one warning if nobody is heard within 5 s.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import random
import re
import socket
from typing import Callable, Iterable

from p2ptrain.net.beacon import HEARD_TTL, Beacon, BeaconFilter, HeardPeer, HeardPeers, encode_beacon
from p2ptrain.errors import ConfigError
from p2ptrain.taskset import TaskSet
from p2ptrain.net.interfaces import Interface, list_interfaces, pick_address, usable_interfaces

log = logging.getLogger(__name__)

# 239.255/16 is the IPv4 local scope (RFC 2365): routers never forward it off the site.
DEFAULT_GROUP = "239.255.77.77"
# Below every OS's ephemeral range (Linux 32768-60999, macOS/Windows 49152-65535), so no
# outgoing socket can happen to hold it.
DEFAULT_UDP_PORT = 29477
BEACON_INTERVAL = 1.0
JITTER = 0.1  # ± fraction of the interval
EARLY_BEACON_GAP = 0.25  # answers to newcomers: at most 4 extra beacons a second
SILENCE_WARNING_AFTER = 5.0
HOUSEKEEPING_EVERY = 0.5  # expiry and log flushing when no beacon is due
REFRESH_INTERFACES_EVERY = 15.0  # Wi-Fi reconnects, DHCP renewals, docker starting
RESOLVE_TIMEOUT = 10.0
CLOSE_TIMEOUT = 2.0

StateFn = Callable[[], "tuple[int, str]"]


def likely_causes(udp_port: int) -> str:
    """The usual reasons nobody is heard, for a warning or the peers command."""
    return (f"likely causes: a firewall blocking UDP port {udp_port} (on macOS, answer Allow to the "
            "firewall prompt for Python), Wi-Fi that drops multicast or isolates clients, a VPN, "
            "or peers with another --cluster or --secret; where discovery cannot work, give "
            "addresses with --peers host:port")


def parse_host_port(entry: str) -> tuple[str, int]:
    """``'host:7000'``, ``'10.0.0.2:7000'`` or ``'[::1]:7000'`` → (host, port). Pure."""
    text = entry.strip()
    m = re.fullmatch(r"\[([0-9A-Za-z:.%_-]+)\]:(\d{1,5})", text) or re.fullmatch(r"([^:\[\]\s]+):(\d{1,5})", text)
    if not m:
        raise ConfigError(f"peer address {entry!r} is not host:port (write IPv6 as [addr]:port)")
    port = int(m.group(2))
    if not 0 < port < 65536:
        raise ConfigError(f"peer address {entry!r}: port must be 1..65535")
    return m.group(1), port


def peer_list(peers: str | Iterable[str]) -> list[str]:
    """``peers=`` as given: a list of ``host:port``, or one string of them comma-separated (as
    ``--peers``; a plain string was read a character at a time). Each entry checked."""
    entries = peers.split(",") if isinstance(peers, str) else list(peers)
    for entry in entries:
        if not isinstance(entry, str):
            raise ConfigError(f"peers holds {entry!r}, a {type(entry).__name__}: give 'host:port' strings")
    out = [entry.strip() for entry in entries if entry.strip()]
    for entry in out:
        parse_host_port(entry)
    return out


async def resolve_static_peers(entries: str | Iterable[str]) -> list[tuple[str, int]]:
    """Every address of every ``host:port`` (a comma-separated string or a list), DNS names
    resolved to all their records, in order, without duplicates. ConfigError names a bad entry."""
    if isinstance(entries, str):
        entries = entries.split(",")
    loop = asyncio.get_running_loop()
    out: list[tuple[str, int]] = []
    for entry in entries:
        if not entry.strip():
            continue
        host, port = parse_host_port(entry)
        try:
            infos = await asyncio.wait_for(loop.getaddrinfo(host, port, type=socket.SOCK_STREAM), RESOLVE_TIMEOUT)
        except (OSError, asyncio.TimeoutError) as exc:
            why = getattr(exc, "strerror", None) or "timed out"
            raise ConfigError(f"--peers entry {entry!r}: cannot resolve {host!r} ({why}): check the name") from None
        out += [(info[4][0], port) for info in infos]
    return list(dict.fromkeys(out))


def _set_small_opt(sock: socket.socket, level: int, opt: int, value: int) -> None:
    """Multicast TTL/loop: an int on Linux and Windows, a byte on some BSDs."""
    try:
        sock.setsockopt(level, opt, value)
    except OSError:
        sock.setsockopt(level, opt, bytes([value]))


class _Receiver(asyncio.DatagramProtocol):
    def __init__(self, on_datagram: Callable[[bytes, str], None]):
        self._on_datagram = on_datagram

    def datagram_received(self, data: bytes, addr: tuple) -> None:
        self._on_datagram(data, addr[0])

    def error_received(self, exc: Exception) -> None:
        log.debug("discovery socket error: %s", exc)


class Discovery:
    """Beacons out, beacons in, for as long as the ``async with`` block runs.

    ``heard()`` lists the peers heard in the last ``ttl`` seconds; ``addresses()`` adds
    the static ``--peers``; ``wait_for(predicate, timeout)`` waits for the heard list to
    satisfy a predicate. ``enabled=False`` (``--no-discovery``) opens no socket at all.
    ``send_beacons=False`` only listens (the peers command). ``targets`` are extra unicast
    (ipv4, udp_port) destinations for networks that pass unicast UDP only, and for tests.
    ``state_fn()`` returns (round, state) for each beacon."""

    def __init__(self, cluster: str | None, peer_id: str, port: int, secret: bytes | None = None, *,
                 group: str = DEFAULT_GROUP, udp_port: int = DEFAULT_UDP_PORT, interface: str | None = None,
                 device: str = "cpu", static_peers: str | Iterable[str] = (), beacon_interval: float = BEACON_INTERVAL,
                 enabled: bool = True, state_fn: StateFn | None = None, send_beacons: bool = True,
                 targets: Iterable[tuple[str, int]] = (), silence_warning_after: float | None = SILENCE_WARNING_AFTER,
                 ttl: float = HEARD_TTL):
        try:
            if not ipaddress.IPv4Address(group).is_multicast:
                raise ValueError
        except ValueError:
            raise ConfigError(f"--group {group!r} is not an IPv4 multicast address (224.0.0.0/4)") from None
        if not 0 < udp_port < 65536:
            raise ConfigError(f"--discovery-port must be 1..65535, got {udp_port}")
        if not beacon_interval > 0:
            raise ConfigError(f"beacon interval must be positive, got {beacon_interval}")
        self.targets = [(str(ipaddress.IPv4Address(ip)), int(p)) for ip, p in targets]
        self.cluster, self.peer_id, self.port, self.device = cluster, peer_id, port, device
        self.secret = secret
        self.group, self.udp_port, self.beacon_interval, self.ttl = group, udp_port, beacon_interval, ttl
        self.enabled, self.send_beacons = enabled, send_beacons
        self.silence_warning_after = silence_warning_after
        self._override = interface
        self._static_entries = static_peers
        self._state_fn: StateFn = state_fn or (lambda: (0, "syncing"))
        if send_beacons:
            if cluster is None:
                raise ConfigError("a peer that sends beacons needs a cluster name")
            encode_beacon(self._beacon(), secret)  # bad names fail here, not in the send loop

        self.filter = BeaconFilter(cluster=cluster, peer_id=peer_id, secret=secret)
        self.heard_peers = HeardPeers()
        self.static_addresses: list[tuple[str, int]] = []
        self.interface: Interface | None = None  # multicast goes out here
        self.interfaces: list[Interface] = []  # joined and broadcast on
        self.sent = 0
        self.send_errors: dict[str, int] = {}  # destination -> failed sends
        self._destinations: list[tuple[tuple[str, int], str]] = []
        self._joined: set[str] = set()
        self._rsock: socket.socket | None = None
        self._ssock: socket.socket | None = None
        self._transport: asyncio.DatagramTransport | None = None
        self._tasks = TaskSet()  # the beacon loop (_run)
        self._failure: BaseException | None = None
        self._changed = asyncio.Event()
        self._wake = asyncio.Event()
        self._early_pending = False
        self._announce_now = False
        self._last_sent = float("-inf")
        self._started_at = 0.0
        self._warned = False
        self._refresh_failed = False
        self._rng = random.Random()
        self._closed = False

    # -- lifecycle ------------------------------------------------------------------------
    async def __aenter__(self) -> "Discovery":
        self._loop = asyncio.get_running_loop()
        self.static_addresses = await resolve_static_peers(self._static_entries)
        if not self.enabled:
            return self
        self._open()
        try:
            self._transport, _ = await self._loop.create_datagram_endpoint(
                lambda: _Receiver(self._on_datagram), sock=self._rsock)
        except BaseException:
            self._close_sockets()
            raise
        self._started_at = self._loop.time()
        self._tasks.spawn(self._run()).add_done_callback(self._task_done)
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()

    async def close(self) -> None:
        """Stop sending and listening; announce ``leaving`` once. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            await self._tasks.close(timeout=CLOSE_TIMEOUT)  # (our own cancellation still propagates)
        finally:
            if self.send_beacons and self._ssock is not None:
                self._send_beacon(state="leaving")  # others forget us now, not after their ttl
            self._close_sockets()

    def _close_sockets(self) -> None:
        if self._transport is not None:
            self._transport.close()
        elif self._rsock is not None:
            self._rsock.close()
        if self._ssock is not None:
            self._ssock.close()
        self._transport = self._rsock = self._ssock = None

    def _open(self) -> None:
        rsock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            rsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if hasattr(socket, "SO_REUSEPORT"):  # Linux and BSD: several listeners on one port
                try:
                    rsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
                except OSError:
                    pass
            rsock.bind(("", self.udp_port))
        except OSError as exc:
            rsock.close()
            raise ConfigError(f"cannot listen on UDP port {self.udp_port} for discovery ({exc.strerror}): pick "
                              "another --discovery-port on every peer, or use --no-discovery with --peers") from None
        rsock.setblocking(False)
        self._rsock = rsock
        if self.send_beacons:
            ssock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            ssock.setsockopt(socket.SOL_SOCKET, socket.SO_BROADCAST, 1)
            _set_small_opt(ssock, socket.IPPROTO_IP, socket.IP_MULTICAST_TTL, 1)  # never off the LAN
            _set_small_opt(ssock, socket.IPPROTO_IP, socket.IP_MULTICAST_LOOP, 1)  # peers on this host
            ssock.setblocking(False)
            self._ssock = ssock
        try:
            self._apply_interfaces(list_interfaces())
        except BaseException:
            self._close_sockets()
            raise

    def _apply_interfaces(self, ifaces: list[Interface]) -> None:
        """Join the group on new interfaces, point multicast at the best one, and list the
        destinations of each beacon. Raises ConfigError when the override names nothing."""
        usable = usable_interfaces(ifaces, self._override)
        chosen = pick_address(ifaces, self._override)
        for iface in usable:
            if iface.address in self._joined:
                continue
            try:
                mreq = socket.inet_aton(self.group) + socket.inet_aton(iface.address)
                self._rsock.setsockopt(socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP, mreq)
            except OSError as exc:  # EADDRINUSE: a second address of a joined interface
                log.debug("cannot join %s on %s: %s", self.group, iface.label, exc)
            self._joined.add(iface.address)
        if self._ssock is not None and (self.interface is None or chosen.address != self.interface.address):
            try:
                self._ssock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_IF, socket.inet_aton(chosen.address))
            except OSError as exc:
                log.debug("cannot send multicast via %s: %s", chosen.label, exc)
        if [i.address for i in usable] != [i.address for i in self.interfaces]:
            log.info("discovery on %s (UDP %s:%d)", ", ".join(i.label for i in usable), self.group, self.udp_port)
        self.interface, self.interfaces = chosen, usable
        dest = [((self.group, self.udp_port), f"to {self.group} via {chosen.name}")]
        for i in usable:
            if i.can_broadcast and i.broadcast:
                dest.append(((i.broadcast, self.udp_port), f"to broadcast {i.broadcast} on {i.name}"))
        dest += [((ip, p), f"to {ip}:{p}") for ip, p in self.targets]
        self._destinations = list(dict((d, label) for d, label in dest).items())

    # -- what callers use -----------------------------------------------------------------
    def heard(self) -> list[HeardPeer]:
        """Peers of our cluster heard in the last ``ttl`` seconds, by peer id."""
        return self.heard_peers.peers()

    def addresses(self) -> list[tuple[str, int]]:
        """TCP addresses to try: every peer heard, then the static ``--peers``."""
        heard = [(p.ip, p.beacon.port) for p in self.heard()]
        return list(dict.fromkeys(heard + self.static_addresses))

    async def wait_for(self, predicate: Callable[[list[HeardPeer]], bool], timeout: float) -> list[HeardPeer]:
        """Wait until ``predicate(heard())`` is true; return that list. Raises
        asyncio.TimeoutError after ``timeout`` s, or the error that stopped discovery."""
        async def until() -> list[HeardPeer]:
            while True:
                if self._failure is not None:
                    raise self._failure
                heard = self.heard()
                if predicate(heard):
                    return heard
                await self._changed.wait()
        return await asyncio.wait_for(until(), timeout)

    def announce(self) -> None:
        """Send a beacon now (e.g. after a state change) instead of at the next tick."""
        self._announce_now = True
        self._wake.set()

    # -- internals ------------------------------------------------------------------------
    def _notify(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def _task_done(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            self._failure = task.exception()
            log.error("discovery stopped: %s", self._failure, exc_info=self._failure)
            self._notify()

    def _beacon(self, state: str | None = None) -> Beacon:
        rnd, st = self._state_fn()
        return Beacon(cluster=self.cluster, peer_id=self.peer_id, port=self.port, device=self.device,
                      round=rnd, state=state or st)

    def _on_datagram(self, data: bytes, ip: str) -> None:
        now = self._loop.time()
        beacon = self.filter.accept(data, ip, now)
        if beacon is None:
            for line in self.filter.take_log_lines(now):
                log.warning("%s", line)
            return
        is_new = beacon.peer_id not in self.heard_peers
        if self.heard_peers.update(beacon, ip, now):
            if is_new and beacon.peer_id in self.heard_peers:
                log.debug("heard peer %s at %s:%d (%s)", beacon.peer_id, ip, beacon.port, beacon.device)
                self._early_pending = True  # tell the newcomer about us now, not in a second
                self._wake.set()
            self._notify()

    def _send_beacon(self, state: str | None = None) -> None:
        data = encode_beacon(self._beacon(state), self.secret)
        for dest, label in self._destinations:
            try:
                self._ssock.sendto(data, dest)
                self.sent += 1
            except OSError as exc:  # ENETUNREACH, EHOSTUNREACH, EPERM (firewall), ENOBUFS ...
                failures = self.send_errors.get(label, 0)
                self.send_errors[label] = failures + 1
                if failures == 0:
                    log.warning("cannot send beacons %s: %s (counted, not logged again)",
                                label, exc.strerror or exc)
        self._last_sent = self._loop.time()

    async def _run(self) -> None:
        loop = self._loop
        next_beacon = loop.time() if self.send_beacons else float("inf")
        next_refresh = loop.time() + REFRESH_INTERFACES_EVERY
        while True:
            now = loop.time()
            early_due = self._early_pending and now - self._last_sent >= EARLY_BEACON_GAP
            if now >= next_beacon or (self.send_beacons and (early_due or self._announce_now)):
                self._send_beacon()
                self._early_pending = self._announce_now = False
                if now >= next_beacon:
                    next_beacon = now + self.beacon_interval * self._rng.uniform(1 - JITTER, 1 + JITTER)
            self._housekeeping(now)
            if now >= next_refresh:
                self._refresh()
                next_refresh = now + REFRESH_INTERFACES_EVERY
            wake_at = min(next_beacon, now + HOUSEKEEPING_EVERY)
            if self._early_pending and self.send_beacons:
                wake_at = min(wake_at, self._last_sent + EARLY_BEACON_GAP)
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), max(0.0, wake_at - loop.time()))
            except asyncio.TimeoutError:
                pass

    def _housekeeping(self, now: float) -> None:
        if self.heard_peers.expire(now, self.ttl):
            self._notify()
        for line in self.filter.take_log_lines(now):
            log.warning("%s", line)
        if (not self._warned and self.silence_warning_after is not None and not self.static_addresses
                and self.filter.counts["accepted"] == 0 and now - self._started_at >= self.silence_warning_after):
            self._warned = True
            drops = self.filter.describe_drops()
            own = ""
            if self.send_beacons and self.sent and self.filter.counts["own"] == 0:
                own = "not even this peer's own beacons came back (a firewall on this machine?); "
            log.warning("no peer of cluster %r heard in %.0f s on %s%s; %s%s", self.cluster,
                        now - self._started_at, ", ".join(i.label for i in self.interfaces),
                        f" ({drops})" if drops else "", own, likely_causes(self.udp_port))

    def _refresh(self) -> None:
        try:
            self._apply_interfaces(list_interfaces())
            self._refresh_failed = False
        except ConfigError as exc:  # the interface went away: keep the last good setup
            if not self._refresh_failed:
                log.warning("discovery keeps its interfaces: %s", exc)
            self._refresh_failed = True
