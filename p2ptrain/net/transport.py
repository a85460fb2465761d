"""TCP links that carry frames: the thin asyncio layer around ``wire`` and ``auth``.

- Receiving: an ``asyncio.BufferedProtocol`` whose ``get_buffer`` is the decoder's, so the kernel
  writes payloads straight into the buffer the link's ``allocate`` hook gives out (a ring segment,
  a pooled buffer), on the stock loop and uvloop alike; or, with ``P2PTRAIN_IO_THREADS=1``, a
  thread of the link reads into the same decoder (``reader.ThreadReader``). Frames queue on the
  link (bounded: reading pauses at the high-water mark).
- Sending: payloads go out from the caller's memory (``sender.DirectSender``: ``sendmsg`` on a
  duplicate of the socket, on the loop or a thread of the link); where the loop has no
  ``add_writer`` (Windows' proactor), through the transport, each piece once its buffer is empty.
  ``send`` returns once nothing of the frame is left in user space. A peer that stops reading
  makes us hold one frame at most beside the kernel's (none with ``sendmsg``), ``timeout`` long.
  A loopback link's send buffer is ``LOOPBACK_SNDBUF`` (the receiver copies data still in cache);
  ``queued_bytes``: what the kernel holds unacknowledged, how far the link is behind us.
- Admission: ``open_link`` and ``serve`` run ``tls.upgrade`` (with TLS) and the ``auth.Handshake``
  under a deadline each; a peer that fails is logged in one line (one per source address a minute:
  ``admission``), sent a fixed reason, and closed. Until admitted its frames carry no payload
  (``wire.PENDING_MAX_PAYLOAD_BYTES``), it is read on the loop, and a listener holds at most
  ``admission.MAX_PENDING_PER_SOURCE`` such links per address, ``admission.MAX_PENDING`` in all.

Failures: ``LinkError`` (closed, reset, timed out), ``RemoteProtocolError`` (bad frame, refused
handshake). Every wait has a timeout.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import socket
from typing import Awaitable, Callable

from p2ptrain.net import admission, auth, tls as tls_, wire
from p2ptrain.net.sockopts import (LOOPBACK_SNDBUF, WHOLE_PAYLOAD_BYTES, _is_loopback,  # noqa: F401 (tests')
                                   _reads_whole_payloads, _same_host, _tune_socket)
from p2ptrain.net.listener import Listener, listen
from p2ptrain.net.reader import ThreadReader
from p2ptrain.net.sender import DirectSender, direct_sender, queued_reader
from p2ptrain.errors import ClosedError, FrameError, HandshakeError, LinkError, P2PTrainError
from p2ptrain.taskset import TaskSet
from p2ptrain.waiting import wait_set

log = logging.getLogger("p2ptrain.net.transport")

MAX_QUEUED_FRAMES = 64  # received frames waiting for their consumer before reading pauses
HANDSHAKE_TIMEOUT = 5.0  # seconds a connection may take to pass the handshake


def hostport(host: str, port: int) -> str:
    """``host:port`` as a user would type it back: ``[::1]:7000`` for an IPv6 address."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def install_uvloop() -> bool:
    """Use uvloop's event loop policy when it is installed (never on Windows). True if used."""
    try:
        import uvloop
    except ImportError:
        return False
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    return True


class _FrameProtocol(asyncio.BufferedProtocol):
    """Feeds received bytes to a FrameDecoder; owned by exactly one Link."""

    def __init__(self, link: "Link", on_connected: Callable[[], None] | None = None):
        self.link = link
        self.on_connected = on_connected

    def connection_made(self, transport):
        _tune_socket(transport)
        transport.set_write_buffer_limits(high=0)  # (pause as soon as anything is buffered, resume once empty)
        self.link._attach(transport)
        if self.on_connected is not None:
            self.on_connected()

    def get_buffer(self, sizehint):
        return self.link._discard if self.link._discarding else self.link._decoder.get_buffer()

    def buffer_updated(self, nbytes):
        self.link._on_bytes(nbytes)

    def eof_received(self):
        self.link._on_lost(None)
        return False

    def connection_lost(self, exc):
        self.link._on_lost(exc)

    def pause_writing(self):
        self.link._can_write.clear()

    def resume_writing(self):
        self.link._can_write.set()


class Link:
    """One framed TCP connection to one peer. Created by ``open_link`` or ``serve``.

    ``send`` and ``recv`` may run concurrently (one sender task and one receiver task).
    After ``close()`` or a failure, both raise: ``LinkError`` or the protocol error that
    ended the link.
    """

    def __init__(self, name: str = "?", max_payload: int = wire.DEFAULT_MAX_PAYLOAD_BYTES):
        self.name = name
        self.peer: auth.PeerHello | None = None
        self._decoder = wire.FrameDecoder(max_payload=max_payload, admitted=False)
        self._transport: asyncio.Transport | None = None
        self._frames: collections.deque[wire.Frame] = collections.deque()
        self._frame_ready = asyncio.Event()
        self._can_write = asyncio.Event()
        self._can_write.set()
        self._reading_paused = False
        self._error: BaseException | None = None
        self._direct: DirectSender | None = None
        self._reader: ThreadReader | None = None  # (P2PTRAIN_IO_THREADS=1: reading off the loop)
        self._discarding = False  # after a protocol error: swallow input until we close
        self._discard = memoryview(bytearray(1 << 16))
        self._send_lock = asyncio.Lock()
        self._queued: Callable[[], int | None] = lambda: None
        self._lowat_sock: socket.socket | None = None  # (a LAN link's: ``WHOLE_PAYLOAD_BYTES``)
        self._lowat = 1
        self._held = False  # reading paused: a frame announced a payload before admission
        self._reader_sock: socket.socket | None = None  # (P2PTRAIN_IO_THREADS=1: read there once admitted)

    # -- configuration --------------------------------------------------------------------
    def set_allocator(self, allocate: wire.Allocator) -> None:
        """Where payloads of the following frames are received (see ``wire.Allocator``)."""
        self._decoder.allocate = allocate

    @property
    def remote(self) -> str:
        addr = self._transport.get_extra_info("peername") if self._transport else None
        return f"{addr[0]}:{addr[1]}" if addr else self.name

    @property
    def same_host(self) -> bool:
        """Whether the peer runs on this machine (a loopback address, or ours at both ends):
        then the "wire" is the kernel copying between two processes on the same cores."""
        sock = self._transport.get_extra_info("socket") if self._transport else None
        return sock is not None and _same_host(sock)

    @property
    def closed(self) -> bool:
        return self._error is not None

    @property
    def bytes_received(self) -> int:
        """Bytes read off the connection so far (a frame still coming counts: the link is not idle)."""
        return self._decoder.received

    def queued_bytes(self) -> int | None:
        """Bytes sent into the kernel that the peer has not acknowledged yet: how far the link
        is behind us (None where the OS cannot tell, before the link is up, once closed)."""
        return None if self.closed else self._queued()

    # -- sending --------------------------------------------------------------------------
    async def send(self, header: dict, payload=(), timeout: float | None = None) -> None:
        """Send one frame; ``payload`` is an iterable of buffers, sent without copies where the
        kernel takes them at once. Returns when nothing of it is left in user space.

        Frames never break on the stream: one that began goes out whole even if its sender is
        cancelled (the next frame waits for it), and one that cannot (the peer read nothing for
        ``timeout`` seconds, the socket failed) closes the link: the peer would read the next
        frame's bytes as the rest of this one and hear nothing after."""
        async with self._send_lock:
            self._raise_if_failed()
            try:
                if self._direct is not None:
                    await self._direct.send(wire.encode_frame(header, payload), timeout, self.name)
                    return
                await self._writable(timeout)  # (a cancelled send's frame first: one frame held at most)
                for buf in wire.encode_frame(header, payload):  # (the transport copies what waits)
                    self._transport.write(buf)
                await self._writable(timeout)
            except P2PTrainError as exc:
                self._cut(exc)
                raise

    def _cut(self, exc: BaseException) -> None:
        """A frame could not go out whole: close at once (what the transport holds is dropped),
        as the stream cannot go on."""
        if self._error is None:
            self._fail(exc)
            self._close_io()
            if self._transport is not None:
                self._transport.abort()

    async def _writable(self, timeout: float | None) -> None:
        self._raise_if_failed()
        if not self._can_write.is_set():
            try:
                await asyncio.wait_for(self._can_write.wait(), timeout)
            except asyncio.TimeoutError:
                raise LinkError(f"{self.name}: peer stopped reading for {timeout:.0f} s") from None
            self._raise_if_failed()

    # -- receiving ------------------------------------------------------------------------
    async def recv(self, timeout: float | None = None) -> wire.Frame:
        """The next frame. Raises LinkError on timeout or loss, or the error that ended the link."""
        while not self._frames:
            self._raise_if_failed()
            self._frame_ready.clear()
            if not await wait_set(self._frame_ready, timeout):  # (cancelled: the frame stays queued)
                raise LinkError(f"{self.name}: nothing received for {timeout:.0f} s")
        frame = self._frames.popleft()
        if self._reader is not None and len(self._frames) <= MAX_QUEUED_FRAMES // 2:
            self._reader.room.set()
        if (self._reading_paused and len(self._frames) <= MAX_QUEUED_FRAMES // 2 and not self.closed
                and not self._held):
            self._reading_paused = False
            self._transport.resume_reading()
        return frame

    def put_back(self, frame: wire.Frame) -> None:
        """Leave ``frame`` first in line again (a ring received it ahead of its call)."""
        self._frames.appendleft(frame)
        self._frame_ready.set()

    # -- life cycle -----------------------------------------------------------------------
    def close(self, reason: str | None = None) -> None:
        """Close. With ``reason`` (one of auth's fixed strings), tell the peer first, and
        linger a moment so that the reason arrives (an abrupt close would reset it away)."""
        self._fail(ClosedError(f"{self.name}: link closed"))
        if reason is not None:
            self._refuse(reason)
            return
        self._close_io()
        if self._transport is not None and not self._transport.is_closing():
            self._transport.close()

    def _refuse(self, reason: str, linger: float = 1.0) -> None:
        """Send REJECT, half-close, discard input, close for good after ``linger`` seconds."""
        reading_thread = self._reader is not None
        self._close_io()
        transport = self._transport
        if transport is None or transport.is_closing() or self._discarding:
            return
        self._discarding = True
        transport.write(wire.frame_bytes({"t": wire.REJECT, "reason": reason}))
        if transport.can_write_eof():
            try:
                transport.write_eof()
            except OSError:  # (reset by the peer meanwhile: ENOTCONN; raised, it left the socket open)
                return transport.close()
        if self._reading_paused or reading_thread:  # (the transport discards what comes now)
            transport.resume_reading()
        asyncio.get_running_loop().call_later(linger, transport.close)

    # -- protocol callbacks ---------------------------------------------------------------
    def _attach(self, transport: asyncio.Transport) -> None:
        self._transport = transport
        self._direct = direct_sender(transport)
        if self._direct is not None:
            self._direct.broken = self._cut
        sock = transport.get_extra_info("socket")
        if sock is not None:
            self._queued = queued_reader(sock)
            if _reads_whole_payloads(sock):
                self._lowat_sock = sock
        if self._direct is not None and self._direct.threaded:  # (P2PTRAIN_IO_THREADS=1)
            self._reader_sock = sock  # (the handshake is read on the loop: ``_admitted``)

    def _admitted(self) -> None:
        """The handshake passed (called at once, before anything more is read): payloads up to
        the link's limit from now on, and the frame held back for one goes on."""
        self._decoder.admit()
        if self._held:
            self._held = False
            if not self._reading_paused and not self.closed:
                self._transport.resume_reading()
        if self._reader_sock is not None:
            # Soon, not now: uvloop starts reading an accepted connection after connection_made,
            # whatever it paused (two readers of one stream garbled frames).
            asyncio.get_running_loop().call_soon(self._start_reader, self._reader_sock)
            self._reader_sock = None

    def _start_reader(self, sock: socket.socket) -> None:
        transport = self._transport
        if self._error is not None or transport is None or transport.is_closing():
            return
        transport.pause_reading()  # for good: the thread reads
        if transport.is_reading():  # (a loop that cannot stop reading: keep it)
            return
        self._reader = ThreadReader(sock, self._decoder, asyncio.get_running_loop(), deliver=self._deliver,
                                    lost=self._on_lost, bad=self._on_bad_frame, backlog=self._frames.__len__,
                                    limit=MAX_QUEUED_FRAMES, name=self.name)

    def _close_io(self) -> None:
        """Our duplicates of the socket (the sender's, the reading thread's) closed or closing."""
        if self._direct is not None:
            self._direct.close()
            self._direct = None
        if self._reader is not None:
            self._reader.close()
            self._reader = None

    def _on_bytes(self, nbytes: int) -> None:
        if self._discarding:
            return
        try:
            self._decoder.buffer_updated(nbytes)
        except FrameError as exc:
            self._on_bad_frame(exc)
            return
        frames = self._decoder.pop_frames()
        if frames:
            self._deliver(frames)
        if self._decoder.held and not self._held:  # (no room to read into until admitted)
            self._held = True
            self._transport.pause_reading()
        if self._lowat_sock is not None:
            self._wake_for_whole_payloads()

    def _wake_for_whole_payloads(self) -> None:
        """The socket's low-water mark: what a large payload still lacks, else 1 (``WHOLE_PAYLOAD_BYTES``)."""
        left = self._decoder.payload_left
        want = left if left >= WHOLE_PAYLOAD_BYTES else 1
        if want != self._lowat:
            try:
                self._lowat_sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, want)
                self._lowat = want
            except OSError:  # (refused here: read as before)
                self._lowat_sock = None

    def _deliver(self, frames: list[wire.Frame]) -> None:
        """Whole frames for ``recv`` (from the protocol, or from the reading thread)."""
        self._frames.extend(frames)
        self._frame_ready.set()
        if len(self._frames) >= MAX_QUEUED_FRAMES and not self._reading_paused and self._reader is None:
            self._reading_paused = True
            self._transport.pause_reading()

    def _on_bad_frame(self, exc: FrameError) -> None:
        log.debug("%s: closing connection: %s", self.remote, exc)  # the link's owner reports it
        self._fail(exc)
        self._refuse(auth.REASON_MALFORMED if exc.peer_version is None else auth.REASON_VERSION)

    def _on_lost(self, exc: BaseException | None) -> None:
        self._close_io()
        refusal = next((f for f in self._frames if f.type == wire.REJECT), None)
        if self._error is None and refusal is not None:  # (so a peer that only sends here hears why too)
            self._fail(LinkError(f"{self.name} closed the link: {auth.refusal_reason(refusal.header)}"))
        elif self._error is None:
            where = "" if self._decoder.idle else " in the middle of a frame"
            why = f": {exc}" if exc else ""
            lost = LinkError(f"{self.name}: connection closed by peer{where}{why}")
            lost.__cause__ = exc  # (a TLS alert: ``tls.failure`` reads it)
            self._fail(lost)

    def _fail(self, exc: BaseException) -> None:
        if self._error is None:
            self._error = exc
        self._frame_ready.set()
        self._can_write.set()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error


async def _admit(link: Link, hs: auth.Handshake, timeout: float,
                 expect: Callable[[auth.PeerHello], bool] | None, *, dialer: bool) -> None:
    """Run the handshake on a fresh link. Raises HandshakeError / LinkError / FrameError."""
    try:
        for h in hs.start(dialer=dialer):
            await link.send(h, timeout=timeout)
        async def steps():
            while not hs.done:
                frame = await link.recv()
                out = hs.receive(frame.header)
                if expect is not None and frame.type == wire.HELLO:
                    hs.check_expected(expect(hs.peer))
                if hs.done:  # (before the last send: the peer's first frame may follow ours at once)
                    link._admitted()
                for h in out:
                    await link.send(h, timeout=timeout)
        await asyncio.wait_for(steps(), timeout)
    except asyncio.TimeoutError:
        link.close(auth.REASON_TIMEOUT)
        raise LinkError(f"{link.remote}: handshake not completed within {timeout:.0f} s") from None
    except HandshakeError as exc:
        link.close(None if exc.by_peer else exc.reason)  # (a refusal is not answered with one)
        raise
    except BaseException:
        link.close()
        raise
    link.peer = hs.peer
    link.name = hs.peer.peer_id


async def open_link(host: str, port: int, hs: auth.Handshake, *, timeout: float = HANDSHAKE_TIMEOUT,
                    expect: Callable[[auth.PeerHello], bool] | None = None,
                    max_payload: int = wire.DEFAULT_MAX_PAYLOAD_BYTES, tls: tls_.TLS | None = None) -> Link:
    """Connect to ``host:port``, go TLS with ``tls`` (``tls.upgrade``), and pass the handshake.
    Raises LinkError or HandshakeError."""
    loop = asyncio.get_running_loop()
    link = Link(hostport(host, port), max_payload)
    try:
        await asyncio.wait_for(loop.create_connection(lambda: _FrameProtocol(link), host, port), timeout)
    except (OSError, asyncio.TimeoutError) as exc:
        errno = getattr(exc, "errno", None)  # (asyncio's own words name the address again: the errno's)
        why = os.strerror(errno) if errno and errno > 0 else getattr(exc, "strerror", None) or str(exc) or "timed out"
        raise LinkError(f"cannot connect to {hostport(host, port)}: {why}") from None
    try:
        if tls is not None:
            await tls_.upgrade(link, tls, dialer=True, timeout=timeout)
        await _admit(link, hs, timeout, expect, dialer=True)
    except FrameError as exc:
        if exc.peer_version is None:
            raise
        raise HandshakeError(auth.REASON_VERSION) from None  # (it speaks another version: a setting)
    return link


async def serve(host: str, port: int, make_handshake: Callable[[], auth.Handshake],
                on_link: Callable[[Link], Awaitable[None] | None], *,
                timeout: float = HANDSHAKE_TIMEOUT,
                expect: Callable[[auth.PeerHello], bool] | None = None,
                max_payload: int = wire.DEFAULT_MAX_PAYLOAD_BYTES,
                pending: admission.PendingHandshakes | None = None, tls: tls_.TLS | None = None) -> Listener:
    """Listen on ``host:port``; every connection that passes TLS (with ``tls``) and the handshake goes to ``on_link``.

    Failures never stop the listener; each is logged one line, at most one per source address
    a minute (a peer with a wrong secret dials again every few seconds; a flood of connections
    is one line), and at debug otherwise. A connection beyond ``pending``'s limits
    (``admission.PendingHandshakes()`` unless given) is closed on accept, unanswered.
    The caller owns the returned ``Listener`` and closes it.
    """
    loop = asyncio.get_running_loop()
    admissions = TaskSet()  # the handshakes in progress
    pending = admission.PendingHandshakes() if pending is None else pending
    said = admission.SaidPerSource()

    def refused(remote: str, exc: P2PTrainError) -> None:
        if isinstance(exc, HandshakeError) and exc.reason == auth.REASON_SELF:
            log.debug("refused connection from %s: %s", remote, exc)  # (our own --peers entry: no fault)
            return
        quiet = said.say(admission.source_of(remote), loop.time())
        if quiet is None:
            log.debug("refused connection from %s: %s", remote, exc)
            return
        fix = auth.advice(exc.reason) if isinstance(exc, HandshakeError) else None
        more = f" ({quiet} more from that address since the last such line)" if quiet else ""
        log.warning("refused connection from %s: %s%s%s", remote, exc, f"; {fix}" if fix else "", more)

    def factory():
        link = Link("incoming", max_payload)

        async def admit(source: str):
            try:
                try:
                    if tls is not None:  # (each of the two steps within ``timeout``)
                        await tls_.upgrade(link, tls, dialer=False, timeout=timeout)
                    await _admit(link, make_handshake(), timeout, expect, dialer=False)
                finally:
                    pending.end(source)
            except P2PTrainError as exc:
                refused(link.remote, exc)
                return
            result = on_link(link)
            if asyncio.iscoroutine(result):
                await result

        def connected():
            source = admission.source_of(link.remote)
            if pending.begin(source):
                admissions.spawn(admit(source))
                return
            link.close()
            refused(link.remote, LinkError(
                f"{len(pending)} handshakes in progress, at most {pending.per_source} from one address and "
                f"{pending.total} in all: closed unanswered"))

        return _FrameProtocol(link, connected)

    return await listen(factory, host, port, admissions)
