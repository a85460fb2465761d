"""``Lifetime``: a peer's loop thread, whether it is open or closed, and the crossings to that
thread that both front ends make (``AsyncPeer`` awaits them, ``sync_peer.Peer`` blocks on them).

Each operation is work on the caller's thread plus a future of the loop thread (a
``concurrent.futures.Future``) for the front end to wait on: ``asyncio.wrap_future`` in
``AsyncPeer``, ``wait`` (blocking) in ``Peer``. Call order, on the caller's thread:

    with lifetime.opening() as future:        # once: ClosedError the second time
        wait for future                       # the cluster joins (the peer's ``_open``)
    ...
    future = lifetime.begin_step(n)           # each step: None when it need not wait
    if future is not None: wait for future
    applied = lifetime.end_step()
    ...
    with lifetime.closing(flush) as future:   # None when not open, or closed already
        if future is not None: wait for future

``opening`` stops the thread if the opening fails (or the caller is interrupted while it
waits: the opening is cancelled there first and undoes what it made, or leaves if it had
opened), ``closing`` stops it whatever happens: that logic lives here only. An exception raised
on the loop thread reaches the waiter with its own type; a waiter that is interrupted cancels
the future (``wait`` here; ``asyncio.wrap_future`` does it for the async front end).

It is a held part of ``AsyncPeer`` (``peer.py``, "Who owns what"): it owns ``thread`` (the
``LoopThread``, set on opening), ``loop`` (its event loop) and ``closed`` (set on the loop
thread as the peer leaves, after the flush); the peer's own work is handed in as ``Work``
(``prepare``, ``open``, ``leave``, ``begin_step``, ``end_step``, and the contributor's
``wait_step`` and ``flush``), so this module knows nothing of the peer.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from p2ptrain.errors import ClosedError
from p2ptrain.trainer.loopthread import LoopThread

ABANDON_TIMEOUT = 10.0  # seconds an interrupted opening gets to undo itself (a cluster's close takes up to ~2)


@dataclass(frozen=True)
class Work:
    """The peer's work at each crossing: ``prepare`` (caller's thread, before the loop thread
    starts), ``open`` and ``leave`` (coroutines on the loop thread), ``begin_step(batch_size,
    scaled)`` (caller's: True when step must wait), ``wait_step()`` (the wait's coroutine, on the
    loop thread), ``end_step()`` (caller's: the updates applied), ``flush()`` (the coroutine a
    normal close waits on first)."""
    prepare: Callable[[], None]
    open: Callable[[], Awaitable[None]]
    leave: Callable[[], Awaitable[None]]
    begin_step: Callable[[int, Any], bool]
    wait_step: Callable[[], Awaitable[None]]
    end_step: Callable[[], int]
    flush: Callable[[], Awaitable[None]]


class Lifetime:
    """A peer's loop thread and open/closed state; the front ends' only way to the loop thread.
    See the module docstring."""

    def __init__(self, name: str, work: Work):
        self.name, self.work = name, work
        self.thread: LoopThread | None = None  # set once, on opening
        self.loop: asyncio.AbstractEventLoop | None = None
        self.closed = False  # set once, on the loop thread, as the peer leaves
        self._opening: asyncio.Task | None = None  # the peer's ``_open`` on the loop thread

    @contextmanager
    def opening(self) -> Iterator[concurrent.futures.Future]:
        """Start the loop thread and the peer's opening there; yields its future. The thread
        is stopped if the block raises (the opening failed, or the waiter was interrupted)."""
        if self.closed or self.thread is not None:
            raise ClosedError("this peer was entered once already: create a new one to join again")
        self.work.prepare()
        thread = self.thread = LoopThread(f"p2ptrain-{self.name}")
        self.loop = thread.loop
        try:
            yield thread.submit(self._open())
        except BaseException:
            self._abandon(thread)
            thread.stop()
            self.closed = True  # (a close after a failed opening has nothing to do)
            raise

    async def _open(self) -> None:
        self._opening = asyncio.current_task()
        await self.work.open()

    def _abandon(self, thread: LoopThread) -> None:
        """An opening whose waiter was interrupted (Ctrl-C, a timeout, a cancelled task) still
        ran there: cancel it and wait, a bounded while, for it to close what it opened (the
        listening socket, discovery's), or leave if it had opened already; the thread's stop
        would otherwise leave them open, their tasks pending."""
        async def abandon() -> None:
            task = self._opening
            if task is None:
                return
            if not task.done():
                # The waiter's cancel reaches the task through its future first: a second one would
                # cut short its closing of what it opened (3.10 cannot tell, and cancels again).
                if not getattr(task, "cancelling", lambda: 0)():
                    task.cancel()
                await asyncio.wait([task], timeout=ABANDON_TIMEOUT)
            if task.done() and not task.cancelled() and task.exception() is None:  # (it opened after all)
                await asyncio.wait_for(self._close(flush=False), ABANDON_TIMEOUT)

        try:
            thread.call(abandon())
        except BaseException:  # (a second interrupt: stop at once)
            pass

    @contextmanager
    def closing(self, flush: bool) -> Iterator[concurrent.futures.Future | None]:
        """Leave: yields the future of the peer's leaving on the loop thread (None if it was
        never opened or is closed already: nothing to do), and stops the thread after the
        block, however it ends. ``flush``: first wait (bounded) for this peer's last samples."""
        thread = self.thread
        if thread is None or self.closed:
            yield None
            return
        try:
            yield thread.submit(self._close(flush))
        finally:
            thread.stop()

    async def _close(self, flush: bool) -> None:
        try:
            if flush:
                await self.work.flush()
        finally:
            self.closed = True
            await self.work.leave()

    def begin_step(self, batch_size: int, scaled=None) -> concurrent.futures.Future | None:
        """The step's work on the caller's thread (``Work.begin_step``; ``scaled``: its
        ``overlap.ScaledStep``); the future of its wait on the loop thread if it must wait (until
        the staleness bound lets it go), else None. Then wait for it, then ``end_step``."""
        if self.work.begin_step(batch_size, scaled):
            return self.thread.submit(self.work.wait_step())
        return None

    def end_step(self) -> int:
        """After the wait, if any: apply what was committed; returns the updates applied."""
        return self.work.end_step()

    def on_loop(self) -> bool:
        """Whether this runs on the loop thread."""
        return self.thread is not None and threading.current_thread() is self.thread.thread

    def call_soon(self, fn: Callable[[], Any]) -> None:
        """Call ``fn`` on the loop thread: now if this is it, else soon (nothing once it is closed)."""
        if self.on_loop():
            fn()
        elif not self.loop.is_closed():
            self.loop.call_soon_threadsafe(fn)

    def wait(self, future: concurrent.futures.Future):
        """Block on a future of the loop thread (the sync front end)."""
        return self.thread.wait(future)
