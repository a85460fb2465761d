"""Small helpers the tests share: waiting for a condition, and running peer processes."""

import asyncio
import subprocess


async def until(cond, timeout=10.0, every=0.02):
    """Poll ``cond()`` until true; fail the test after ``timeout`` seconds."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(every)


def finish(procs: list[subprocess.Popen], timeout: float = 150) -> list[tuple[str, str]]:
    """Wait for every process; kill any still running, whatever happens."""
    try:
        return [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def pending_tasks() -> list:
    """The loop's tasks still pending, the caller's own aside: after ``close()``, what its owner
    left behind (STYLE rule 5: every task is kept, cancelled and awaited by its owner)."""
    me = asyncio.current_task()
    return [t for t in asyncio.all_tasks() if t is not me and not t.done()]
