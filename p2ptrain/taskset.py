"""``TaskSet``: the tasks one object starts, kept, cancelled and awaited by it (STYLE rule 5).

``asyncio.TaskGroup`` (Python 3.11) is the model; we support 3.10, and our owners hold their
tasks from ``start`` to ``close`` rather than for one ``async with`` block, so this is the part
of it they need: ``spawn`` keeps the task until it ends, ``close`` cancels what still runs and
waits for it. Unlike a TaskGroup, a task that fails does not cancel its siblings: each owner
handles its tasks' errors where they arise (a link reader reports its link lost).

Call order: ``spawn`` any number of times; ``await close()`` once (``cancel()`` before it, where
the caller cannot await). A set that is closed or cancelled runs nothing new: a task spawned
after either is cancelled before its first step.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Iterator

# A task still running this long after ``close`` cancelled it is cancelled again. Before Python
# 3.12, ``asyncio.wait_for`` whose awaited result arrives together with the cancellation returns
# that result and drops the cancellation: the task goes on, and one that then waits with no
# timeout (a ring's sender for a chunk its dead receiver will never deliver) was waited for
# forever (a CI run hung in test_group this way).
RECANCEL_S = 1.0


class TaskSet:
    """The tasks of one owner. See the module docstring."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task] = set()
        self._closed = False

    def spawn(self, coro: Coroutine) -> asyncio.Task:
        """Run ``coro`` as a task this set owns (call on the running loop)."""
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        if self._closed:
            task.cancel()
            task.add_done_callback(_drop_outcome)
        return task

    def __iter__(self) -> Iterator[asyncio.Task]:
        """The tasks still running."""
        return iter(list(self._tasks))

    def __len__(self) -> int:
        return len(self._tasks)

    def cancel(self) -> None:
        """Cancel every task now, without waiting for them: the first half of ``close``, for a
        caller that cannot await (a signal handler). The set runs nothing new from then on;
        ``close`` still waits for the tasks."""
        self._closed = True
        for task in list(self._tasks):
            task.cancel()
            task.add_done_callback(_drop_outcome)  # (whether or not ``close`` is still waiting then)

    async def close(self, timeout: float | None = None) -> None:
        """Cancel every task and wait for them (at most ``timeout`` seconds; None: until they
        end), cancelling again every ``RECANCEL_S`` those that go on. Their exceptions are
        retrieved and dropped: the owner is closing (also those of tasks that end after a
        ``cancel``, or after this call stopped waiting). A cancellation of the caller itself
        still propagates."""
        self.cancel()
        pending = set(self._tasks)
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while pending:
            wait = RECANCEL_S if deadline is None else max(0.0, min(RECANCEL_S, deadline - loop.time()))
            done, pending = await asyncio.wait(pending, timeout=wait)
            if deadline is not None and loop.time() >= deadline:
                return
            for task in pending:
                task.cancel()


def _drop_outcome(task: asyncio.Task) -> None:
    """A cancelled set's task ended: its exception is retrieved (and dropped), so that asyncio
    does not log it as never retrieved once no one waits for it."""
    if not task.cancelled():
        task.exception()
