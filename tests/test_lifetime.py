"""``Lifetime`` alone, over a stub peer: what runs on which thread, in which order, and that the
loop thread is stopped however opening or closing ends (no cluster, no sockets)."""

from __future__ import annotations

import asyncio
import contextlib
import threading

import pytest

from p2ptrain.errors import ClosedError, GroupError
from p2ptrain.trainer.lifetime import Lifetime, Work


class StubPeer:
    """What ``Lifetime`` calls on its peer, recording the calls and the thread each ran on."""

    peer_id = "0123456789abcdef"
    step_timeout = 1.0

    def __init__(self, fail_open: BaseException | None = None, fail_flush: BaseException | None = None,
                 must_wait: bool = False):
        self.lifetime = Lifetime(self.peer_id[:8], Work(
            prepare=self._prepare, open=self._open, leave=self._leave, begin_step=self._begin_step,
            wait_step=lambda: self.wait(self._must_wait, self.step_timeout), end_step=self._end_step,
            flush=self.flush))
        self.calls: list[tuple[str, bool]] = []  # (what, on the loop thread)
        self.fail_open, self.fail_flush, self.must_wait = fail_open, fail_flush, must_wait

    def _note(self, what: str) -> None:
        thread = self.lifetime.thread
        self.calls.append((what, thread is not None and threading.current_thread() is thread.thread))

    def _prepare(self) -> None:
        self._note("prepare")

    async def _open(self) -> None:
        self._note("open")
        if self.fail_open is not None:
            raise self.fail_open

    async def flush(self) -> None:
        self._note("flush")
        if self.fail_flush is not None:
            raise self.fail_flush

    async def _leave(self) -> None:
        self._note(f"leave closed={self.lifetime.closed}")

    def _begin_step(self, batch_size: int, scaled=None) -> bool:
        self._note(f"begin {batch_size}")
        return self.must_wait

    def _must_wait(self) -> bool:
        return False

    async def wait(self, blocked, timeout: float) -> None:
        self._note(f"wait {blocked()} {timeout}")

    def _end_step(self) -> int:
        self._note("end")
        return 7


def stopped(lifetime: Lifetime) -> bool:
    return not lifetime.thread.thread.is_alive() and lifetime.loop.is_closed()


@pytest.mark.parametrize("must_wait", [False, True])
def test_blocking_lifetime_runs_each_part_on_its_thread_in_order(must_wait):
    peer = StubPeer(must_wait=must_wait)
    life = peer.lifetime
    with life.opening() as opened:
        life.wait(opened)
    waiting = life.begin_step(32)
    assert (waiting is not None) == must_wait
    if waiting is not None:
        life.wait(waiting)
    assert life.end_step() == 7
    with life.closing(flush=True) as left:
        life.wait(left)
    waited = [("wait False 1.0", True)] if must_wait else []
    assert peer.calls == [("prepare", False), ("open", True), ("begin 32", False), *waited, ("end", False),
                          ("flush", True), ("leave closed=True", True)]
    assert stopped(life)
    with life.closing(flush=True) as again:  # closed already: nothing to do
        assert again is None
    with pytest.raises(ClosedError, match="entered once already"):
        with life.opening():
            pass


def test_a_failed_opening_stops_the_thread_and_raises_its_own_type():
    peer = StubPeer(fail_open=GroupError("no"))
    with pytest.raises(GroupError, match="no"):
        with peer.lifetime.opening() as opened:
            peer.lifetime.wait(opened)
    assert stopped(peer.lifetime) and peer.lifetime.closed  # (so a close after it has nothing to do)
    with peer.lifetime.closing(flush=True) as left:
        assert left is None
    with pytest.raises(ClosedError, match="entered once already"):
        with peer.lifetime.opening():
            pass


def test_closing_without_flush_and_after_a_failed_flush_still_leaves():
    never = StubPeer()
    with never.lifetime.closing(flush=True) as left:  # never opened: nothing to do
        assert left is None
    assert never.calls == []
    for flush, fail in [(False, None), (True, GroupError("flush failed"))]:
        peer = StubPeer(fail_flush=fail)
        with peer.lifetime.opening() as opened:
            peer.lifetime.wait(opened)
        with pytest.raises(GroupError) if fail else contextlib.nullcontext():
            with peer.lifetime.closing(flush=flush) as left:
                peer.lifetime.wait(left)
        assert peer.calls[-1] == ("leave closed=True", True)
        assert ("flush", True) in peer.calls if flush else ("flush", True) not in peer.calls
        assert stopped(peer.lifetime)


async def test_awaiting_lifetime_runs_the_same_as_blocking():
    peer = StubPeer(must_wait=True)
    life = peer.lifetime
    with life.opening() as opened:
        await asyncio.wrap_future(opened)
    await asyncio.wrap_future(life.begin_step(8))
    assert life.end_step() == 7
    with life.closing(flush=False) as left:
        await asyncio.wrap_future(left)
    assert peer.calls == [("prepare", False), ("open", True), ("begin 8", False), ("wait False 1.0", True),
                          ("end", False), ("leave closed=True", True)]
    assert stopped(life)
