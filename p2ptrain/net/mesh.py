"""``Mesh``: one authenticated link to every peer of the cluster, and the routing of its frames.

Discovery (beacons, ``--peers``) only proposes addresses; the mesh dials them, and the
handshake tells who is really there. Each link has one reader task, owned by the mesh,
which routes what arrives:

- ring chunks (``wire.CHUNK``) to that peer's ``ChunkChannel``, which the collective reads
  like a link (``recv``/``send``/``set_allocator``), so a ring runs over mesh links unchanged;
- state transfer (``wire.STATE``: snapshots, model fingerprints) to ``on_state(peer_id, frame)``;
- the link's own farewell (``wire.BYE``, sent by ``close``) ends the link;
- keepalives (``wire.PING``, every KEEPALIVE seconds on every link, and once on a new link)
  refresh ``heard_at`` and carry where our other linked peers listen (``at``): a peer given
  one address (``--peers``, DDP's habit of one master address) dials the rest;
- everything else (round messages, the round machine's GOODBYE too) to ``on_message(peer_id, header)``.

Every task the mesh runs (dials, readers, keepalives) is in one ``TaskSet``, which ``close``
cancels and awaits.

Two peers that dial each other at once end up with two links; both keep the one dialed by
the smaller peer id and close the other, so they agree without talking. A peer's
``ChunkChannel`` outlives such a swap (it moves to the kept link, and the losing link's chunks
still come to it), so a ring that took the channel before the swap goes on. A link that fails
or closes is dropped and reported once through ``on_lost(peer_id, reason)``.

Call order: ``await mesh.start()``; ``mesh.propose(host, port)`` as addresses come in;
``mesh.post(peer_id, header)`` (round messages: never waits) or ``await mesh.send(peer_id,
header, payload)``; ``await mesh.close()`` (sends what was posted, then says goodbye).
"""

from __future__ import annotations

import asyncio
import collections
import ipaddress
import logging
from typing import Awaitable, Callable

from p2ptrain.net import auth, transport, wire
from p2ptrain.net.wire import KEEPALIVE  # (any frame in refreshes ``heard_at``: liveness for the round machine)
from p2ptrain.net.tls import TLS
from p2ptrain.errors import ConfigError, LinkError, P2PTrainError
from p2ptrain.taskset import TaskSet
from p2ptrain.waiting import wait_set

log = logging.getLogger("p2ptrain.net.mesh")

RETRY_AFTER = 2.0  # seconds before an address that failed is dialed again
POST_TIMEOUT = 10.0  # seconds a posted message may wait for its link to take it (``post``)
PING_TIMEOUT = 10.0  # a ping waits this long for a peer that stopped reading before its link closes
DUPLICATE_GRACE = 2.0  # a losing duplicate link is still read this long (the other end may not know yet)
MAX_SHARED = 64  # addresses a keepalive carries at most (``at``)
# A link that brings not one byte this long closes: honest peers ping, a silent member is dropped
# at its peer timeout, so this catches admitted links nothing else watches (one that never joins,
# a hostile one holding a connection open). ``Cluster`` gives at least three peer timeouts.
IDLE_TIMEOUT = 60.0
# Messages posted to one peer that may wait for it (one in flight, the rest queued): one that
# stopped reading (SIGSTOP, hostile) closes its link before we hold more (small dicts: a few MB).
MAX_POSTED = 4096


class ChunkChannel:
    """A peer's ring chunks, read like a ``transport.Link`` by ``collective.RingAllreduce``."""

    def __init__(self, link: transport.Link):
        self._link = link
        self._allocate: wire.Allocator = wire.default_allocate
        self._frames: collections.deque[wire.Frame] = collections.deque()
        self._ready = asyncio.Event()
        self._error: BaseException | None = None

    @property
    def name(self) -> str:
        return self._link.name

    def queued_bytes(self) -> int | None:
        return self._link.queued_bytes()

    @property
    def same_host(self) -> bool:
        return self._link.same_host

    @property
    def closed(self) -> bool:
        """The link failed or closed: what ``recv`` raises now is that, not a quiet wait."""
        return self._error is not None

    def set_allocator(self, allocate: wire.Allocator) -> None:
        self._allocate = allocate
        self._link.set_allocator(allocate)

    def _move_to(self, link: transport.Link) -> None:
        """Send on ``link`` from now on (it replaced a duplicate): the ring's allocator goes with
        it; what still comes on the old link is received into fresh buffers (and copied)."""
        self._link.set_allocator(wire.default_allocate)
        self._link = link
        link.set_allocator(self._allocate)

    async def send(self, header: dict, payload=(), timeout: float | None = None) -> None:
        await self._link.send(header, payload, timeout)

    async def recv(self, timeout: float | None = None) -> wire.Frame:
        while not self._frames:
            if self._error is not None:
                raise self._error
            self._ready.clear()
            if not await wait_set(self._ready, timeout):  # (cancelled: the frame stays for the next ring)
                raise LinkError(f"{self.name}: no ring chunk for {timeout:.0f} s")
        return self._frames.popleft()

    def put_back(self, frame: wire.Frame) -> None:
        """Leave ``frame`` first in line again (a ring received it ahead of its call)."""
        self._frames.appendleft(frame)
        self._ready.set()

    def _put(self, frame: wire.Frame) -> None:
        self._frames.append(frame)
        self._ready.set()

    def _fail(self, exc: BaseException) -> None:
        self._error = exc
        self._ready.set()


class Mesh:
    """Links to every peer proposed and admitted. See the module docstring."""

    def __init__(self, *, cluster: str, peer_id: str, secret: bytes | None, host: str = "0.0.0.0",
                 port: int = 0, info: dict | None = None,
                 on_message: Callable[[str, dict], Awaitable[None] | None] = lambda p, h: None,
                 on_lost: Callable[[str, str], None] = lambda p, why: None,
                 on_admitted: Callable[[str, dict], None] = lambda p, info: None,
                 on_state: Callable[[str, wire.Frame], None] = lambda p, frame: None,
                 own_hosts: frozenset[str] = frozenset({"127.0.0.1", "localhost", "0.0.0.0"}),
                 handshake_timeout: float = transport.HANDSHAKE_TIMEOUT, idle_timeout: float | None = None,
                 tls: TLS | None = None):
        self.cluster, self.peer_id, self._secret, self._tls = cluster, peer_id, secret, tls  # (``net.tls``)
        self.host, self.port = host, port
        self.info = dict(info or {})
        self._on_message, self._on_lost, self._on_admitted = on_message, on_lost, on_admitted
        self._on_state = on_state
        self.handshake_timeout = handshake_timeout  # (each way: a connection that takes longer is closed)
        self.idle_timeout = IDLE_TIMEOUT if idle_timeout is None else idle_timeout  # (``_next_frame``)
        self._own_hosts = own_hosts | {host}
        self._links: dict[str, transport.Link] = {}
        self._dialer: dict[str, str] = {}  # peer id -> which end opened our link to it
        self._addr: dict[str, tuple[str, int]] = {}  # peer id -> where it listens
        self._channels: dict[str, ChunkChannel] = {}
        self._tasks = TaskSet()  # owns every task below, readers of losing duplicates and pings too
        self._readers: dict[str, asyncio.Task] = {}
        self._lingering: set[transport.Link] = set()  # losing duplicates, closed at their grace or ours
        self._dialing: dict[tuple[str, int], asyncio.Task] = {}
        self._failed_at: dict[tuple[str, int], float] = {}
        self._unreached: dict[tuple[str, int], str] = {}  # address -> why its last dial failed
        self._proposed: set[tuple[str, int]] = set()  # every address proposed (not our own)
        self._answered_by_us: set[tuple[str, int]] = set()  # dialed, and this peer answered (REASON_SELF)
        # Addresses whose peer refuses our handshake for a setting (``auth.advice``): why, since when (said once).
        self.refused: dict[tuple[str, int], tuple[str, float]] = {}
        self._said: set[tuple[tuple[str, int], str]] = set()
        self._listener: transport.Listener | None = None
        self._closed = False
        self.heard_at: dict[str, float] = {}  # peer id -> loop time of the last frame from it (``heard``)
        self._bytes_seen: dict[transport.Link, int] = {}  # (``heard``: a link's bytes at the last call)
        self._outbox: dict[str, collections.deque] = {}  # peer id -> messages posted, not yet sent
        self._posting: set[asyncio.Task] = set()  # the tasks sending them

    # -- life cycle -----------------------------------------------------------------------
    async def start(self) -> None:
        """Listen. A port taken or an address not of this machine is a ``ConfigError``."""
        try:
            self._listener = await transport.serve(self.host, self.port, self._handshake, self._admit_incoming,
                                                   timeout=self.handshake_timeout, tls=self._tls)
        except OSError as exc:  # (EADDRINUSE, EADDRNOTAVAIL, a name that does not resolve)
            why = exc.strerror or str(exc)
            raise ConfigError(f"cannot listen on {self.host}:{self.port}: {why}; pick another port (--port, "
                              "listen=; 0: any free one) or an address of this machine (--host)") from None
        self.port = self._listener.port
        self.info["port"] = self.port
        if self._tls is not None:
            log.info("mutual TLS on every link; this peer's certificate: %r", self._tls.name)
        self._tasks.spawn(self._ping())

    async def close(self) -> None:
        """Say goodbye to every peer, then close links, dialers and the listener."""
        self._closed = True
        if self._posting:  # (a round machine's GOODBYE among them)
            await asyncio.wait(set(self._posting), timeout=1.0)
        for link in list(self._links.values()):
            try:
                await link.send({"t": wire.BYE}, timeout=1.0)
            except P2PTrainError:
                pass
        await self._tasks.close()
        for link in [*self._links.values(), *self._lingering]:
            link.close()
        self._links.clear()
        self._lingering.clear()
        if self._listener is not None:
            await self._listener.close()

    # -- who is there ---------------------------------------------------------------------
    @property
    def peers(self) -> list[str]:
        return sorted(self._links)

    @property
    def addresses(self) -> set[tuple[str, int]]:
        """Where the linked peers listen (as dialed, or as their handshake said)."""
        return set(self._addr.values())

    def channel(self, peer_id: str) -> ChunkChannel:
        """The ring-chunk channel to ``peer_id`` (KeyError if not linked)."""
        return self._channels[peer_id]

    def propose(self, host: str, port: int, now: float | None = None) -> None:
        """An address heard of (beacon, --peers): dial it unless linked, dialing, or it failed
        less than RETRY_AFTER seconds ago. Returns at once; the dial runs in the background."""
        key = (host, port)
        loop = asyncio.get_running_loop()
        now = loop.time() if now is None else now
        if self.is_own(host, port):
            return
        self._proposed.add(key)
        if (self._closed or key in self._dialing or key in self._addr.values()
                or now - self._failed_at.get(key, -1e9) < RETRY_AFTER):
            return
        task = self._tasks.spawn(self._dial(host, port))
        self._dialing[key] = task
        task.add_done_callback(lambda t, k=key: self._dialing.pop(k, None))

    def is_own(self, host: str, port: int) -> bool:
        """Whether ``host:port`` is this peer's own listening address (``--peers`` may list it:
        the same list on every machine)."""
        return (port == self.port and host in self._own_hosts) or (host, port) in self._answered_by_us

    async def send(self, peer_id: str, header: dict, payload=(), timeout: float | None = 10.0) -> None:
        link = self._links.get(peer_id)
        if link is None:
            raise LinkError(f"no link to peer {peer_id}")
        await link.send(header, payload, timeout)

    def post(self, peer_id: str, header: dict) -> None:
        """Send a message without waiting for it: in order, by a task of that peer's, so that a
        peer that stopped reading (its cable pulled, behind a ring chunk) never holds up the
        caller, the round machine's one actor, which must go on hearing the others and noticing
        that peer's silence. One the link does not take within POST_TIMEOUT of its turn closes
        the link (reported through ``on_lost`` as any loss), and so does a message that finds
        MAX_POSTED waiting; none is sent once the link is gone."""
        if peer_id not in self._links:
            log.debug("not sent to %s (no link): %s", peer_id, header.get("t"))
            return
        waiting = self._outbox.get(peer_id)
        if waiting is not None and len(waiting) >= MAX_POSTED:
            log.warning("closing the link to %s: it stopped reading (%d messages wait for it)", peer_id, len(waiting))
            self._drop(peer_id, f"stopped reading ({len(waiting)} messages waiting)")
            return
        if waiting is None:
            waiting = self._outbox[peer_id] = collections.deque()
            task = self._tasks.spawn(self._send_posted(peer_id, waiting))
            self._posting.add(task)
            task.add_done_callback(self._posting.discard)
        waiting.append(header)

    async def _send_posted(self, peer_id: str, waiting: collections.deque) -> None:
        try:
            while waiting and (link := self._links.get(peer_id)) is not None:
                await link.send(waiting[0], timeout=POST_TIMEOUT)
                waiting.popleft()
        except P2PTrainError as exc:  # (the link is closed: its reader reports the loss)
            log.debug("send to %s failed: %s", peer_id, exc)
        finally:
            if self._outbox.get(peer_id) is waiting:
                del self._outbox[peer_id]

    def disconnect(self, peer_id: str, why: str) -> None:
        """Close our link to a peer found dead (silent), so that a later dial can reach it again:
        a pulled cable leaves TCP links open, silent, for many minutes."""
        if peer_id in self._links:
            log.info("closing the link to %s: %s", peer_id, why)
            self._drop(peer_id, why)

    def reach_hint(self) -> str:
        """What to check while too few peers are linked to train: the addresses proposed that
        no dial reached (and why), or, with none proposed, that no peer was found."""
        linked = self.addresses
        unreached = [why for key, why in sorted(self._unreached.items())
                     if key in self._proposed and key not in linked and key not in self.refused]
        if unreached:
            return (f"{'; '.join(unreached)}: check the address, that the peer runs, and that its port is "
                    "open to this machine")
        if not self._links and not self._proposed:
            return ("no other peer found: start them; where they run, discovery is blocked: give their "
                    "addresses (--peers, peers=)")
        return "a peer that is loading the cluster's state counts once it has loaded"

    # -- admission ------------------------------------------------------------------------
    def _handshake(self) -> auth.Handshake:
        return auth.Handshake(cluster=self.cluster, peer_id=self.peer_id, secret=self._secret, info=self.info)

    async def _dial(self, host: str, port: int) -> None:
        try:
            link = await transport.open_link(host, port, self._handshake(), timeout=self.handshake_timeout,
                                             tls=self._tls)
        except auth.HandshakeError as exc:
            self._refused_by((host, port), exc)
            return
        except P2PTrainError as exc:
            log.debug("dial %s:%d failed: %s", host, port, exc)
            self._failed_at[(host, port)] = asyncio.get_running_loop().time()
            self._unreached[(host, port)] = str(exc)
            self.refused.pop((host, port), None)  # (unreachable now, not refusing)
            return
        self._adopt(link, dialed_by=self.peer_id, addr=(host, port))

    def _refused_by(self, key: tuple[str, int], exc: auth.HandshakeError) -> None:
        now = asyncio.get_running_loop().time()
        self._failed_at[key] = now
        reason = exc.reason  # (the same whichever end refused: said once)
        if reason == auth.REASON_SELF:
            self._answered_by_us.add(key)
            return
        fix = auth.advice(reason)
        if (key, reason) in self._said:
            log.debug("peer at %s refused this peer again: %s", transport.hostport(*key), exc)
        else:
            self._said.add((key, reason))
            log.warning("peer at %s refused this peer: %s%s", transport.hostport(*key), exc, f"; {fix}" if fix else "")
        if fix is not None:
            before = self.refused.get(key)
            self.refused[key] = (reason, before[1] if before and before[0] == reason else now)
        else:
            self.refused.pop(key, None)

    def refusing(self) -> tuple[float, list[str]] | None:
        """(since when, the reasons: ``auth``'s fixed strings, sorted) every address proposed to
        this mesh has refused our handshake for a setting (a wrong secret, another cluster),
        while no peer is linked: nobody we know will take us. None otherwise."""
        known = self._proposed
        if self._links or not known or any(key not in self.refused for key in known):
            return None
        reasons = sorted({self.refused[key][0] for key in known})
        return max(self.refused[key][1] for key in known), reasons

    def _admit_incoming(self, link: transport.Link) -> None:
        port = link.peer.info.get("port")
        host = link.remote.rpartition(":")[0]
        self._adopt(link, dialed_by=link.peer.peer_id, addr=(host, port) if isinstance(port, int) else None)

    def _adopt(self, link: transport.Link, dialed_by: str, addr: tuple[str, int] | None) -> None:
        pid = link.peer.peer_id
        if self._closed:
            link.close()
            return
        if pid in self._links:
            keeper = min(self.peer_id, pid)  # both ends agree: keep the link the smaller id dialed
            if self._dialer[pid] == keeper or dialed_by != keeper:
                self._linger(pid, link)
                return
            self._linger(pid, self._links[pid])
            self._readers.pop(pid).cancel()
            self._channels[pid]._move_to(link)
        self._links[pid] = link
        self._dialer[pid] = dialed_by
        if addr is not None:
            self._addr[pid] = addr
            self.refused.pop(addr, None)
            self._unreached.pop(addr, None)
            self._said = {said for said in self._said if said[0] != addr}  # (a later refusal is news)
        if pid not in self._channels:
            self._channels[pid] = ChunkChannel(link)
        self._readers[pid] = self._tasks.spawn(self._read(pid, link))
        self._tasks.spawn(self._ping_one(link, self._shared_with(pid)))  # (a newcomer dials the rest now)
        self._on_admitted(pid, link.peer.info)

    def _linger(self, pid: str, link: transport.Link) -> None:
        """Stop sending on a losing duplicate but read it a while: the other end may still
        send on it until it sees the link we keep."""
        self._tasks.spawn(self._read(pid, link))
        self._lingering.add(link)
        asyncio.get_running_loop().call_later(DUPLICATE_GRACE, self._end_linger, link)

    def _end_linger(self, link: transport.Link) -> None:
        self._lingering.discard(link)
        link.close()

    async def _ping(self) -> None:
        while True:
            await asyncio.sleep(KEEPALIVE)
            for pid, link in list(self._links.items()):
                if not link.closed:
                    self._tasks.spawn(self._ping_one(link, self._shared_with(pid)))

    @staticmethod
    async def _ping_one(link: transport.Link, addresses: list) -> None:
        try:
            await link.send({"t": wire.PING, "at": addresses}, timeout=PING_TIMEOUT)
        except P2PTrainError:
            pass  # the reader reports the loss

    def _shared_with(self, pid: str) -> list[list]:
        """Where our other linked peers listen, for ``pid`` to dial; a loopback address only to a
        peer itself on loopback (elsewhere it names that machine, not ours)."""
        theirs = self._addr.get(pid)
        local = theirs is not None and _is_loopback(theirs[0])
        return [[host, port] for q, (host, port) in sorted(self._addr.items())
                if q != pid and (local or not _is_loopback(host))][:MAX_SHARED]

    def _heard_of(self, addresses) -> None:
        """A linked peer's keepalive named where its peers listen: dial those we lack. (From an
        authenticated peer; anything malformed in it is passed over.)"""
        if not isinstance(addresses, list):
            return
        for entry in addresses[:MAX_SHARED]:
            if (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], str) and 0 < len(entry[0]) <= 255
                    and type(entry[1]) is int and 0 < entry[1] < 65536):
                self.propose(entry[0], entry[1])

    def heard(self, now: float) -> dict[str, float]:
        """``heard_at``, a frame still coming counted as heard ``now`` (a snapshot's part on a slow
        link holds the keepalives behind it): stopped or unplugged, a peer sends no byte at all."""
        seen, self._bytes_seen = self._bytes_seen, {link: link.bytes_received for link in self._links.values()}
        for pid, link in self._links.items():
            if seen.get(link) != self._bytes_seen[link] and pid in self.heard_at:
                self.heard_at[pid] = max(self.heard_at[pid], now)
        return self.heard_at

    # -- routing --------------------------------------------------------------------------
    async def _read(self, pid: str, link: transport.Link) -> None:
        why = "link closed"
        try:
            while True:
                frame = await self._next_frame(pid, link)
                if self._links.get(pid) is link:
                    self.heard_at[pid] = asyncio.get_running_loop().time()
                if frame.type == wire.PING:
                    self._heard_of(frame.header.get("at"))
                    continue
                if frame.type == wire.CHUNK:
                    if pid in self._channels:
                        self._channels[pid]._put(frame)
                    continue
                if frame.type == wire.STATE:
                    self._on_state(pid, frame)
                    continue
                if frame.type == wire.BYE:  # the link's own farewell (round GOODBYEs pass on)
                    why = "said goodbye"
                    if pid in self._links and self._links[pid] is not link:
                        # (sent on the link it kept while we kept a duplicate: it leaves all the same,
                        # and our link to it would only report a closed connection, a crash's words)
                        self._drop(pid, why)
                    return
                if frame.type == wire.REJECT:  # it closes the link: a frame of ours broke its decoder
                    why = f"closed by the peer: {auth.refusal_reason(frame.header, 100)}"
                    return
                result = self._on_message(pid, frame.header)
                if asyncio.iscoroutine(result):
                    await result
        except P2PTrainError as exc:
            why = str(exc)
        finally:
            if self._links.get(pid) is link:
                self._drop(pid, why)

    async def _next_frame(self, pid: str, link: transport.Link) -> wire.Frame:
        """The link's next frame. One that brought not a byte (a frame still coming counts) for
        ``idle_timeout`` seconds raises ``LinkError``, said in one line naming the peer."""
        while True:
            seen = link.bytes_received
            try:
                return await link.recv(timeout=self.idle_timeout)
            except LinkError:
                if link.closed:
                    raise
                if link.bytes_received == seen:
                    log.warning("closing the link to %s at %s: it sent nothing for %.0f s (peers ping every "
                                "%g s)", pid, link.remote, self.idle_timeout, KEEPALIVE)
                    raise LinkError(f"{pid}: sent nothing for {self.idle_timeout:.0f} s") from None

    def _drop(self, pid: str, why: str, report: bool = True) -> None:
        link = self._links.pop(pid, None)
        self.heard_at.pop(pid, None)
        self._outbox.pop(pid, collections.deque()).clear()  # (its task ends: nothing more for that link)
        self._dialer.pop(pid, None)
        self._addr.pop(pid, None)
        channel = self._channels.pop(pid, None)
        reader = self._readers.pop(pid, None)
        if channel is not None:
            channel._fail(LinkError(f"peer {pid}: {why}"))
        if reader is not None and reader is not asyncio.current_task():
            reader.cancel()
        if link is not None:
            link.close()
        if report and not self._closed:
            self._on_lost(pid, why)


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        return host == "localhost"
