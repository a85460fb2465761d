"""A link's reading thread (``P2PTRAIN_IO_THREADS=1``): the socket's bytes go into the link's
``wire.FrameDecoder`` off the event loop.

On the loop, every received byte is a ``recv`` on the loop's thread, beside every send and every
hand-off from the data pool; with a reading thread (and ``sender``'s sending thread) the loop
only hands frames on. The thread owns the decoder while it runs (the transport's own reading
stays paused), reads a duplicate of the socket with ``recv_into`` straight into the buffer
the decoder asks for (a ring segment, a pooled buffer: the link's ``allocate`` hook, called on
this thread), and posts each batch of whole frames to the loop (``deliver``). It stops, and
tells the loop once, at the end of the stream (``lost``: None), on a socket error (``lost``:
the error) or on a bad frame (``bad``: the ``FrameError``); ``close()`` stops it within
``POLL_SLICE`` and it closes its duplicate then. Flow control: while the link holds
``limit`` frames its consumer has not taken (``backlog``), it waits for ``room``.
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading
from typing import Callable

from p2ptrain.errors import FrameError
from p2ptrain.net import wire
from p2ptrain.net.sender import POLL_SLICE, wait_socket


class ThreadReader:
    """See the module docstring. Callbacks run on ``loop``; ``backlog()`` is read on the thread."""

    def __init__(self, sock: socket.socket, decoder: wire.FrameDecoder, loop: asyncio.AbstractEventLoop, *,
                 deliver: Callable[[list], None], lost: Callable[[BaseException | None], None],
                 bad: Callable[[FrameError], None], backlog: Callable[[], int], limit: int, name: str):
        self._sock = socket.socket(fileno=os.dup(sock.fileno()))
        self._sock.setblocking(False)
        self._decoder, self._loop = decoder, loop
        self._deliver, self._lost, self._bad = deliver, lost, bad
        self._backlog, self._limit = backlog, limit
        self.room = threading.Event()  # set by the consumer once the backlog is down to half
        self._posted = 0  # frames posted to the loop and not yet handed to the link there
        self._count = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"p2ptrain-read {name}", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._closed = True
        self.room.set()

    def _post(self, fn, arg) -> bool:
        try:
            self._loop.call_soon_threadsafe(fn, arg)
            return True
        except RuntimeError:  # (the loop is closed: no one listens)
            return False

    def _run(self) -> None:
        try:
            self._read()
        finally:
            self._sock.close()

    def _queued(self) -> int:
        """Frames the consumer has not taken: the link's, and ours on their way to it."""
        with self._count:
            return self._backlog() + self._posted

    def _hand_over(self, frames: list) -> None:  # (on the loop)
        with self._count:
            self._posted -= len(frames)
        self._deliver(frames)

    def _read(self) -> None:
        while not self._closed:
            if self._queued() >= self._limit:
                self.room.clear()
                if self._queued() >= self._limit:  # (the consumer may have taken some meanwhile)
                    self.room.wait(POLL_SLICE)
                    continue
            buf = self._decoder.get_buffer()
            wait_socket(self._sock, POLL_SLICE, readable=True)
            if self._closed:
                return
            try:
                n = self._sock.recv_into(buf)
            except (BlockingIOError, InterruptedError):
                continue
            except OSError as exc:
                self._post(self._lost, exc)
                return
            if n == 0:
                self._post(self._lost, None)
                return
            try:
                self._decoder.buffer_updated(n)
            except FrameError as exc:
                self._post(self._bad, exc)
                return
            except Exception as exc:  # (an allocator's bug: the loop would drop the connection too)
                self._post(self._lost, exc)
                return
            frames = self._decoder.pop_frames()
            if frames:
                with self._count:
                    self._posted += len(frames)
                if not self._post(self._hand_over, frames):
                    return
