"""What a peer remembers of the rounds it applied (the metrics and the status line read it)."""

from __future__ import annotations

import collections
from dataclasses import dataclass


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
    index: int = 0  # 0, 1, 2 ... in the order applied here (readers on other threads resume from it)


class RoundLog(collections.deque):
    """The last rounds applied here (newest last), and ``total``: how many ever were."""

    def __init__(self, keep: int = 1000):
        super().__init__(maxlen=keep)
        self.total = 0

    def append(self, record: RoundRecord) -> None:
        super().append(record)
        self.total += 1
