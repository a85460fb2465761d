"""``wait_set``: wait for an ``asyncio.Event`` with a timeout, without ever dropping a cancellation.

Before Python 3.12, ``asyncio.wait_for`` whose awaited result arrives together with the
cancellation returns the result and drops the cancellation (CPython gh-86296). A receiver that
waits for a frame that way, cancelled as the frame comes (its round aborted, and the next
round's first chunk already on the link), goes on, takes that frame and loses it: the next
round's ring then found its chunks out of step and waited out its deadline. Here the
cancellation always wins: the caller takes nothing.
"""

from __future__ import annotations

import asyncio


async def wait_set(event: asyncio.Event, timeout: float | None) -> bool:
    """Wait until ``event`` is set, at most ``timeout`` seconds (None: no limit): whether it is."""
    if event.is_set():
        return True
    waiter = asyncio.ensure_future(event.wait())
    try:
        done, _ = await asyncio.wait({waiter}, timeout=timeout)  # (a cancellation raises here)
    finally:
        waiter.cancel()
    return bool(done)
