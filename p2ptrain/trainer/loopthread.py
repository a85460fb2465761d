"""``LoopThread``: an asyncio event loop (uvloop when installed) on a daemon thread, where a
peer's cluster runs, so that a forward or backward holding the caller's thread never stalls a ring."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading


WARM_BLOCK = 8 << 20  # bytes per block the warm-up touches (a thread's malloc arena takes none over 64 MB)


class LoopThread:
    """An event loop (uvloop when installed) on a daemon thread: where the cluster runs.

    ``warm_bytes`` (``join`` sets it): heap memory the thread touches and frees before its loop
    starts. A round's buffers (the ring's sums, the residual, the codec's scratch) are made on this
    thread, in its own malloc arena, during the first rounds; where the heap keeps what is freed
    (``commands.heap``, join's), they then reuse these pages instead of faulting fresh ones in.
    Measured on this project's 2-core VMs, where touching a page the first time cost ~40 us (the
    host backs it then): a 1 M-parameter int8 peer faulted 6,500 pages on this thread in its
    first two rounds, 0.26 s of a 1 s run; warmed at start, its first round took 16-20 ms. Off by
    default: a program with malloc's default settings would hand the pages back at once."""

    warm_bytes = 0

    def __init__(self, name: str):
        try:
            import uvloop
            self.loop = uvloop.new_event_loop()
        except ImportError:
            self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._run, args=(self.warm_bytes,), name=name, daemon=True)
        self.thread.start()

    def _run(self, warm_bytes: int) -> None:
        if warm_bytes > 0:
            touch_heap(warm_bytes)
        self.loop.run_forever()

    def submit(self, coro) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, coro):
        """Run ``coro`` there and wait; its exception is raised here, with its own type."""
        return self.wait(self.submit(coro))

    def wait(self, future: concurrent.futures.Future):
        """Wait for a future of this loop (``submit``); its exception is raised here, with its own type."""
        try:
            return future.result()
        except BaseException:  # (Ctrl-C here: stop it there too)
            future.cancel()
            raise

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10.0)
        if not self.thread.is_alive():
            self.loop.close()


def touch_heap(nbytes: int) -> None:
    """Allocate ``nbytes`` on this thread's heap in blocks, write every page, and free them."""
    import numpy as np

    blocks = [np.ones(min(WARM_BLOCK, nbytes - at) // 4, np.float32) for at in range(0, nbytes, WARM_BLOCK)]
    del blocks
