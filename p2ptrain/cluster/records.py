"""What a peer remembers of the rounds it applied (the metrics and the status line read it)."""

from __future__ import annotations

import collections
import itertools
import threading
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from p2ptrain.cluster.rounds import SyncPoint


@dataclass(frozen=True)
class RoundRecord:
    """One round applied here, as the metrics and the status line report it."""
    round: int
    members: int
    samples: int  # the whole cluster's, this round
    own_samples: int  # this peer's contribution to it
    wire_bytes: int  # what this peer sent in its ring (compressed)
    raw_bytes: int  # the same uncompressed
    seconds: float  # ring start to apply
    time: float  # wall clock at apply (time.time())
    index: int = 0  # 0, 1, 2 ... in the order applied here (``RoundLog.append`` sets it; readers resume from it)


class Loaded(NamedTuple):
    """A state this peer loaded (``Cluster.loads``), and where that fell among its rounds: after
    the first ``after`` records its ``RoundLog`` ever kept. A reader that takes records and loads
    at once keeps that order (a peer that stops being alone commits its last solo rounds just
    before it loads the cluster's state)."""
    point: SyncPoint
    after: int


class RoundLog:
    """The last rounds applied here, newest last, and ``total``: how many ever were.

    The cluster's thread appends; any other thread (``join``'s loop) reads with ``since`` and
    ``last``, which copy under a lock: a reader never sees the log change under it."""

    def __init__(self, keep: int = 1000):
        self._records: collections.deque[RoundRecord] = collections.deque(maxlen=keep)
        self._lock = threading.Lock()
        self.total = 0

    def append(self, record: RoundRecord) -> None:
        """Keep ``record`` as the next one (its ``index`` set to its place)."""
        with self._lock:
            self._records.append(replace(record, index=self.total))
            self.total += 1

    def since(self, index: int) -> list[RoundRecord]:
        """The records kept whose ``index`` is ``index`` or later, oldest first."""
        with self._lock:
            newest = list(itertools.islice(reversed(self._records), max(0, self.total - index)))
        return newest[::-1]

    def find(self, r: int, among: int = 8) -> RoundRecord | None:
        """The record of round ``r`` among the newest ``among`` (None: not there)."""
        with self._lock:
            return next((rec for rec in itertools.islice(reversed(self._records), among) if rec.round == r), None)

    def last(self) -> RoundRecord | None:
        with self._lock:
            return self._records[-1] if self._records else None

    def __len__(self) -> int:
        with self._lock:
            return len(self._records)


def in_order(records: list[RoundRecord], loads: list[Loaded]) -> list[RoundRecord | Loaded]:
    """Records (oldest first) and loads taken at one look, as they happened here: each load after
    the records kept before it."""
    out: list[RoundRecord | Loaded] = []
    i = 0
    for load in loads:
        while i < len(records) and records[i].index < load.after:
            out.append(records[i])
            i += 1
        out.append(load)
    return out + records[i:]
