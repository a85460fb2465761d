"""TaskSet: the tasks of one owner are kept while they run, and cancelled and awaited on close."""

import asyncio

import pytest

from helpers import pending_tasks

from p2ptrain.taskset import TaskSet

pytestmark = pytest.mark.timeout(10)


async def test_close_cancels_and_awaits_every_task_and_keeps_none_that_ended():
    tasks, cleaned = TaskSet(), []

    async def forever(i):
        try:
            await asyncio.sleep(60)
        finally:
            cleaned.append(i)

    async def quick():
        return 1

    for i in range(3):
        tasks.spawn(forever(i))
    done = tasks.spawn(quick())
    await done
    await asyncio.sleep(0)
    assert len(tasks) == 3 and done not in list(tasks)  # a task that ended is let go
    await tasks.close()
    assert sorted(cleaned) == [0, 1, 2] and len(tasks) == 0 and pending_tasks() == []


async def test_a_task_spawned_after_close_never_runs():
    tasks, ran = TaskSet(), []
    await tasks.close()

    async def work():
        ran.append(1)

    task = tasks.spawn(work())
    await asyncio.sleep(0.01)
    assert task.cancelled() and ran == []


async def test_a_task_that_failed_does_not_stop_its_siblings_and_close_retrieves_its_error():
    tasks = TaskSet()

    async def fail():
        raise ValueError("a bug")

    failed = tasks.spawn(fail())
    sibling = tasks.spawn(asyncio.sleep(60))
    await asyncio.sleep(0.01)
    assert failed.done() and not sibling.done()
    await tasks.close()
    assert sibling.cancelled()


async def test_close_gives_up_waiting_after_its_timeout():
    tasks = TaskSet()

    async def stubborn():
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            pass  # swallowed once (what no task of ours does: rule 5)
        await asyncio.sleep(60)

    task = tasks.spawn(stubborn())
    await asyncio.sleep(0)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    await tasks.close(timeout=0.1)
    assert 0.1 <= loop.time() - t0 < 1.0 and not task.done()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_cancel_stops_every_task_without_waiting_and_nothing_spawned_after_runs():
    tasks, ran = TaskSet(), []

    async def work():
        ran.append(1)

    running = tasks.spawn(asyncio.sleep(60))
    await asyncio.sleep(0)
    tasks.cancel()  # (synchronous: what a signal handler calls)
    late = tasks.spawn(work())
    await tasks.close()
    assert running.cancelled() and late.cancelled() and ran == [] and pending_tasks() == []


async def test_close_cancels_again_a_task_whose_cancellation_was_swallowed():
    """Before Python 3.12, ``wait_for`` returns a result that arrives with the cancellation and
    drops the cancellation; a task that then waits with no timeout was waited for forever."""
    result = asyncio.get_running_loop().create_future()
    never = asyncio.Event()

    async def ring_sender():
        await asyncio.wait_for(result, 10)
        await never.wait()

    tasks = TaskSet()
    task = tasks.spawn(ring_sender())
    await asyncio.sleep(0.01)
    result.set_result(None)  # (in the same step of the loop as close's cancel)
    await asyncio.wait_for(tasks.close(), 5)
    assert task.done() and len(tasks) == 0


async def test_a_task_that_fails_after_its_owner_stopped_waiting_is_not_reported_unretrieved():
    """An owner cancelled while it closes (a round's ring cancelled twice as the peer leaves)
    stops waiting; a task of its that then fails (a ring's sender whose link closed: before
    Python 3.12 ``wait_for`` may drop the cancellation and raise the link's error) was logged
    at exit as "Task exception was never retrieved", with a traceback, on a clean leave."""
    import gc
    loop = asyncio.get_running_loop()
    reported = []
    loop.set_exception_handler(lambda _loop, context: reported.append(context["message"]))
    gate = asyncio.Event()

    async def stubborn():
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            await gate.wait()
            raise ConnectionError("link closed") from None

    tasks = TaskSet()
    tasks.spawn(stubborn())
    await asyncio.sleep(0)
    closing = asyncio.ensure_future(tasks.close())
    await asyncio.sleep(0)
    closing.cancel()  # the owner itself is cancelled while it waits
    with pytest.raises(asyncio.CancelledError):
        await closing
    gate.set()
    for _ in range(3):
        await asyncio.sleep(0)
    assert len(tasks) == 0
    gc.collect()
    loop.set_exception_handler(None)
    assert reported == []
