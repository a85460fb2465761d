"""The benchmark's control channel: barriers and all-gathers between the peers of bench/lan.py.

Every peer runs the same phases in the same order; before and after each phase they meet
here. Rank 0 (the first entry of ``--peers``) hosts a ``torch.distributed.TCPStore`` on
its ``--port``; the others connect to it. Values are JSON (never pickle).

``exchange(name, value)`` publishes this peer's value under ``name`` and returns every
peer's value, in rank order, once all have published: a barrier that carries data. Names
must be unique per call and called in the same order everywhere. Every wait is bounded
by ``timeout`` (a peer that died makes the others fail with a TimeoutError-like
RuntimeError from the store, not hang).
"""

from __future__ import annotations

import json
import time
from datetime import timedelta


class Control:
    """The store client of one peer. ``close()`` on rank 0 waits (briefly) for the others to leave."""

    def __init__(self, host: str, port: int, rank: int, world: int, timeout: float):
        from torch.distributed import TCPStore

        self.rank = rank
        self.world = world
        self.store = TCPStore(host, port, world, rank == 0, timedelta(seconds=timeout),
                              wait_for_workers=True)

    def exchange(self, name: str, value=None) -> list:
        self.store.set(f"{name}/{self.rank}", json.dumps(value))
        keys = [f"{name}/{r}" for r in range(self.world)]
        self.store.wait(keys)
        return [json.loads(self.store.get(k)) for k in keys]

    def close(self, grace: float = 10.0) -> None:
        """Leave. Rank 0 hosts the store, so it waits until every other peer has left (or ``grace`` s)."""
        if self.rank:
            self.store.add("left", 1)
            return
        deadline = time.monotonic() + grace
        while self.store.add("left", 0) < self.world - 1 and time.monotonic() < deadline:
            time.sleep(0.05)
