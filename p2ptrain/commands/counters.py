"""What ``join`` counts for its status line, metrics and summary: this run's rounds and samples,
the cluster's round and update numbers as they are, and rates over the last few seconds.

A count that a resume, a state load or a late join would make lie is not kept: rounds and
samples are those applied in this run (a checkpoint's old totals are not added in: two peers
restarted from their checkpoints said ``rounds 550`` and ``rounds 525`` of one cluster); the
round shown is the cluster's number of the last update applied here (not how many this peer
applied: a joiner said ``round 3`` right after loading round 75); and a rate is measured over
the last ``WINDOW_S`` seconds (not this run's totals over its whole time, which counted a
checkpoint's samples as if made since the start, and a joiner's wait and download as idle).
"""

from __future__ import annotations

import collections

WINDOW_S = 10.0  # seconds a rate is measured over


class Rate:
    """An amount per second over the last ``window`` seconds (since ``start`` while younger)."""

    def __init__(self, start: float, window: float = WINDOW_S):
        self.window, self.total, self._start = window, 0, start
        self._points: collections.deque[tuple[float, int]] = collections.deque([(start, 0)])

    def add(self, amount: int, now: float) -> None:
        self.total += amount
        self._points.append((now, self.total))
        while len(self._points) > 2 and self._points[1][0] <= now - self.window:
            self._points.popleft()  # (one point at or before the window's start is kept)

    def per_second(self, now: float) -> float:
        before = self._points[0][1]
        cutoff = max(self._start, now - self.window)
        for t, total in self._points:  # the total at the window's start: that of the last point before it
            if t > cutoff:
                break
            before = total
        return (self.total - before) / (now - cutoff) if now > cutoff else 0.0


class RunCounters:
    """This run's counts. Feed ``stepped`` after each step, ``applied`` for each round record
    (``cluster.records.RoundRecord``)."""

    def __init__(self, start: float):
        self.rounds = 0  # updates applied in this run (an idle round, nobody had anything, is none)
        self.samples = 0  # every member's samples in them
        self.own_samples = 0  # this peer's steps in this run
        self.round: int | None = None  # the cluster's number of the last round applied here
        self.own, self.cluster, self.wire = Rate(start), Rate(start), Rate(start)
        self.updates = Rate(start)  # the cluster's updates applied here (the status line's ETA)

    def stepped(self, samples: int, now: float) -> None:
        self.own_samples += samples
        self.own.add(samples, now)

    def applied(self, record, now: float) -> None:
        self.rounds += record.samples > 0  # (the cluster's version counts the same: ``History``)
        self.samples += record.samples
        self.round = record.round if self.round is None else max(self.round, record.round)
        self.cluster.add(record.samples, now)
        self.wire.add(record.wire_bytes, now)
        self.updates.add(int(record.samples > 0), now)
