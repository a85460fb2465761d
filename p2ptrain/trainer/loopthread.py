"""``LoopThread``: an asyncio event loop (uvloop when installed) on a daemon thread, where a
peer's cluster runs, so that a forward or backward holding the caller's thread never stalls a ring."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading


class LoopThread:
    """An event loop (uvloop when installed) on a daemon thread: where the cluster runs."""

    def __init__(self, name: str):
        try:
            import uvloop
            self.loop = uvloop.new_event_loop()
        except ImportError:
            self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self.thread.start()

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
