"""How a link's frames leave: ``sendmsg`` from the caller's own memory, no copies in Python.

``DirectSender`` sends on a duplicate of the connection's non-blocking socket, waiting for
writability with ``loop.add_writer`` (asyncio's own transports copy what the kernel does not
take at once, before Python 3.12), or, for large frames and where asked
(``P2PTRAIN_IO_THREADS=1``), from a thread of the link that blocks in ``poll`` with the GIL
released. ``queued_reader`` tells how much of what was sent the peer has not acknowledged.
``transport.Link`` owns one of each per connection.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import select
import socket
import struct
import sys
import threading
import time
from typing import Callable

from p2ptrain.errors import ClosedError, ConfigError, LinkError
from p2ptrain.switches import env_switch

log = logging.getLogger("p2ptrain.net.transport")


_IOV_MAX = 512


def queued_reader(sock: socket.socket) -> Callable[[], int | None]:
    """A function that tells how many bytes ``sock`` holds that the peer has not acknowledged
    yet (Linux's SIOCOUTQ, a syscall of ~1.5 us), or None where the OS cannot tell."""
    if not sys.platform.startswith("linux"):
        return lambda: None
    import fcntl
    import termios

    def queued() -> int | None:
        try:
            return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0"))[0]
        except (OSError, ValueError):  # (closed: fileno() is -1)
            return None

    return queued


# Frames of at least this many bytes can go out from the link's own sender thread
# (``io_threads_default``): a large chunk's ``sendmsg`` is a copy (on loopback also the
# receiver's share of the stack) of ~0.5 ms per MiB, and on the event loop it holds up every
# receive and every pool hand-off behind it. Seen on an H200 machine (16 cores, 2 peers,
# 10 M values fp32, loopback): the loop thread sent 48 chunks of 840 KB a round at 0.3-0.8 ms
# each, and each reduce waited for the loop, 1.1 ms a chunk where the add takes 0.05 ms; the
# round took 34 ms, DDP's whole step 24 ms. Smaller frames (headers, control) go inline.
THREAD_SEND_BYTES = 256 << 10
IO_THREADS_ENV = "P2PTRAIN_IO_THREADS"
POLL_SLICE = 0.05  # seconds a link's thread waits on its socket before looking at close()


def io_threads_default() -> bool:
    """Whether links send large frames from a thread of their own and read from another
    (``transport``): ``P2PTRAIN_IO_THREADS=1``. Off unless asked: on 2 cores the threads only
    add hand-offs (fp32 allreduce of 36 MiB, N = 2, the sender thread alone: 20-21 -> 24-27
    ms), and where cores are to spare they are not measured yet (``bench/device_check.sh``
    runs both)."""
    return env_switch(IO_THREADS_ENV, default=False)


def _drop_sent(views: list[memoryview], sent: int) -> None:
    """Remove the first ``sent`` bytes from ``views`` (what ``sendmsg`` took)."""
    while sent and views:
        if sent >= views[0].nbytes:
            sent -= views.pop(0).nbytes
        else:
            views[0] = views[0][sent:]
            sent = 0


class DirectSender:
    """Sends buffers with ``sendmsg`` on a dup of a connected non-blocking socket: no copies.

    With ``threaded``, frames of ``THREAD_SEND_BYTES`` or more are sent by a thread of this
    sender (``sendmsg`` and ``poll`` release the GIL), one at a time and in order. Either way a
    frame on its way is finished before the next, even after the task that sent it was
    cancelled, so frames never interleave or break off on the wire. The dup keeps the connection open:
    ``close()`` it before the transport closes (with a frame in flight, the thread closes
    the dup once it stops, within ``POLL_SLICE``)."""

    def __init__(self, sock, threaded: bool = False):
        self._sock = socket.socket(fileno=os.dup(sock.fileno()))
        self._sock.setblocking(False)
        self._loop = asyncio.get_running_loop()
        self._threaded = threaded
        self._jobs: queue.SimpleQueue | None = None  # to the thread, started on first use
        self._in_flight: asyncio.Future | None = None  # the thread's frame, or a cancelled sender's rest
        self._closed = False
        self._waiting: asyncio.Future | None = None  # writability awaited on the loop
        self.broken: Callable[[BaseException], None] | None = None  # a frame cut short that no one awaits

    @property
    def threaded(self) -> bool:
        return self._threaded

    async def send(self, buffers: list, timeout: float | None, name: str) -> None:
        """Send ``buffers`` as one piece of the stream. Cancelled with part of it out, the rest
        still goes (the next ``send`` waits for it); ``broken`` hears of a failure no one awaits."""
        views = [v for v in (memoryview(b).cast("B") for b in buffers) if v.nbytes]
        if self._in_flight is not None and not self._in_flight.done():
            await asyncio.shield(self._in_flight)  # (its sender was cancelled: it is still going)
        if self._threaded and sum(v.nbytes for v in views) >= THREAD_SEND_BYTES:
            self._in_flight = self._loop.create_future()
            self._in_flight.add_done_callback(self._tell_broken)
            if self._jobs is None:
                self._jobs = queue.SimpleQueue()
                threading.Thread(target=self._run, name=f"p2ptrain-send {name}", daemon=True).start()
            self._jobs.put((views, timeout, name, self._in_flight))
            await asyncio.shield(self._in_flight)
            return
        whole = len(views), views[0].nbytes if views else 0
        try:
            await self._send_views(views, timeout, name)
        except asyncio.CancelledError:
            if views and (len(views), views[0].nbytes) != whole:  # begun: the rest must follow
                self._in_flight = asyncio.ensure_future(self._send_views(views, timeout, name))
                self._in_flight.add_done_callback(self._tell_broken)
            raise

    async def _send_views(self, views: list[memoryview], timeout: float | None, name: str) -> None:
        while views:
            self._send_some(views, name)
            if views:
                await self._writable(timeout, name)

    def _tell_broken(self, fut: asyncio.Future) -> None:
        if not fut.cancelled() and fut.exception() is not None and self.broken is not None:
            self.broken(fut.exception())

    def _send_some(self, views: list[memoryview], name: str) -> None:
        """One ``sendmsg``: what the kernel takes at once is removed from ``views``."""
        try:
            sent = self._sock.sendmsg(views[:_IOV_MAX])
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            raise LinkError(f"{name}: send failed: {exc.strerror or exc}") from None
        _drop_sent(views, sent)

    async def _writable(self, timeout: float | None, name: str) -> None:
        if self._closed:
            raise ClosedError(f"{name}: link closed")
        fut = self._waiting = self._loop.create_future()
        fd = self._sock.fileno()
        self._loop.add_writer(fd, lambda: fut.done() or fut.set_result(None))
        try:
            await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            raise LinkError(f"{name}: peer stopped reading for {timeout:.0f} s") from None
        finally:
            self._loop.remove_writer(fd)
            self._waiting = None

    # -- the sender thread ----------------------------------------------------------------
    def _run(self) -> None:
        try:
            while (job := self._jobs.get()) is not None:
                views, timeout, name, done = job
                try:
                    self._send_blocking(views, timeout, name)
                    outcome: BaseException | None = None
                except Exception as exc:  # (any: the awaiting task must not wait forever)
                    outcome = exc
                try:
                    self._loop.call_soon_threadsafe(_settle, done, outcome)
                except RuntimeError:  # (the loop is closed: no one waits)
                    return
        finally:
            self._sock.close()

    def _send_blocking(self, views: list[memoryview], timeout: float | None, name: str) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while views:
            if self._closed:
                raise ClosedError(f"{name}: link closed")
            self._send_some(views, name)
            if views:
                wait = POLL_SLICE if deadline is None else min(POLL_SLICE, deadline - time.monotonic())
                if wait <= 0:
                    raise LinkError(f"{name}: peer stopped reading for {timeout:.0f} s")
                wait_socket(self._sock, wait)

    def close(self) -> None:
        self._closed = True
        if self._waiting is not None and not self._waiting.done():  # (a send waiting on the loop ends now)
            self._waiting.set_exception(ClosedError("link closed"))
        if self._jobs is None:
            self._sock.close()
        else:
            self._jobs.put(None)  # the thread closes the dup once its frame stops


def _settle(fut: asyncio.Future, outcome: BaseException | None) -> None:
    if not fut.done():
        if outcome is None:
            fut.set_result(None)
        else:
            fut.set_exception(outcome)


def wait_socket(sock: socket.socket, seconds: float, *, readable: bool = False) -> None:
    """Block (GIL released) until ``sock`` is writable (or ``readable``) or ``seconds`` pass."""
    if hasattr(select, "poll"):
        poller = select.poll()
        poller.register(sock.fileno(), select.POLLIN if readable else select.POLLOUT)
        poller.poll(max(1, int(seconds * 1000)))
    elif readable:
        select.select([sock], [], [], seconds)
    else:
        select.select([], [sock], [], seconds)


def direct_sender(transport: asyncio.Transport) -> DirectSender | None:
    """A ``DirectSender`` for ``transport``'s socket, or None where the loop cannot wait for
    writability (``add_writer``: not on Windows' proactor) or the OS has no ``sendmsg``."""
    sock = transport.get_extra_info("socket")
    loop = asyncio.get_running_loop()
    if sock is None or not hasattr(socket.socket, "sendmsg"):
        return None
    try:
        threaded = io_threads_default()
    except ConfigError as exc:  # (``join`` refuses it at its start; a library user is told here)
        log.warning("%s; sending from the event loop", exc)
        threaded = False
    try:
        sender = DirectSender(sock, threaded)
        probe = sender._sock.fileno()
        loop.add_writer(probe, lambda: None)  # NotImplementedError on loops without it
        loop.remove_writer(probe)
    except (NotImplementedError, OSError, ValueError):
        if "sender" in locals():
            sender.close()
        return None
    return sender
