"""Limits on connections that have not passed the handshake yet. Pure code: no I/O, no clock.

Anyone who reaches a listening port may open connections, so what a stranger can make a
listener hold is bounded here: ``PendingHandshakes`` caps the handshakes in progress per
source address and in all (each is also closed at the handshake's timeout, by the caller),
and ``SaidPerSource`` lets one refusal per source address per ``every`` seconds be logged, so
that a flood of connections is one line a minute, not one per connection (a connection's own
address, with its port, would be a new key every time). A frame's payload before admission is
``wire``'s limit (``PENDING_MAX_PAYLOAD_BYTES``).
"""

from __future__ import annotations

import collections

MAX_PENDING_PER_SOURCE = 8  # handshakes in progress from one address
MAX_PENDING = 64  # handshakes in progress in all
SAY_EVERY = 60.0  # seconds between two log lines about one source address
MAX_SOURCES_SAID = 1024  # source addresses remembered by ``SaidPerSource``


def source_of(remote: str) -> str:
    """The address of ``host:port`` (``[v6]:port`` or ``v6:port`` too), without the port."""
    host = remote.rpartition(":")[0] or remote
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


class PendingHandshakes:
    """The handshakes in progress, counted per source address. Call ``begin(source)`` when a
    connection is accepted: False means over a limit (close it at once, no handshake); after
    True, call ``end(source)`` exactly once when its handshake is over, whichever way."""

    def __init__(self, per_source: int = MAX_PENDING_PER_SOURCE, total: int = MAX_PENDING):
        self.per_source, self.total = per_source, total
        self._by_source: collections.Counter[str] = collections.Counter()
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def begin(self, source: str) -> bool:
        if self._count >= self.total or self._by_source[source] >= self.per_source:
            return False
        self._by_source[source] += 1
        self._count += 1
        return True

    def end(self, source: str) -> None:
        if self._by_source[source] <= 0:
            raise RuntimeError(f"end() without begin() for {source}")  # (our bug)
        self._by_source[source] -= 1
        if not self._by_source[source]:
            del self._by_source[source]
        self._count -= 1


class SaidPerSource:
    """Which refusals get a log line: the first from a source address, then one per ``every``
    seconds; the rest go to debug. ``say(source, now)`` returns how many were kept quiet since
    the last line said (0 or more), or None when this one is to be kept quiet."""

    def __init__(self, every: float = SAY_EVERY, remember: int = MAX_SOURCES_SAID):
        self.every, self.remember = every, remember
        self._last: dict[str, float] = {}
        self._quiet: collections.Counter[str] = collections.Counter()

    def say(self, source: str, now: float) -> int | None:
        last = self._last.get(source)
        if last is not None and now - last < self.every:
            self._quiet[source] += 1
            return None
        if last is None and len(self._last) >= self.remember:  # (forget the oldest line said)
            oldest = min(self._last, key=self._last.__getitem__)
            del self._last[oldest]
            self._quiet.pop(oldest, None)
        self._last[source] = now
        return self._quiet.pop(source, 0)
