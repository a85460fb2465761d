"""What a peer reports of the updates it applies: each update's metrics completed with the
cluster's record of its round, a DEBUG line per update, and an INFO line every ``LOG_EVERY_S``."""

from __future__ import annotations

import logging
import time
from dataclasses import replace

from p2ptrain.trainer.accumulator import RoundMetrics

log = logging.getLogger("p2ptrain.trainer.peer")  # (the peer's lines, under the peer's name)

LOG_EVERY_S = 10.0  # a progress line at INFO at most this often (every update at DEBUG)


def cluster_record(cluster, r: int):
    """The cluster's record of round r (members, bytes), among its last few; None if gone."""
    rounds = getattr(cluster, "rounds", None)
    return rounds.find(r) if rounds is not None else None


class ProgressLog:
    """Counts applied updates and samples between INFO lines (the caller's thread only)."""

    def __init__(self):
        self._at, self._rounds, self._samples = time.perf_counter(), 0, 0

    def completed(self, m: RoundMetrics, cluster) -> RoundMetrics:
        """``m`` with the members and bytes of the cluster's record of its round, where known."""
        record = cluster_record(cluster, m.round)
        if record is None:
            return m
        return replace(m, members=record.members, wire_bytes=record.wire_bytes, raw_bytes=record.raw_bytes)

    def applied(self, m: RoundMetrics, staleness_max: int, dropped: int) -> None:
        log.debug("round %d applied (version %d): %d samples (%d here) from %d members, staleness %d, %.3f s, "
                  "%d bytes sent", m.round, m.version, m.samples, m.local_samples, m.members, m.staleness,
                  m.round_time, m.wire_bytes)
        self._rounds += 1
        self._samples += m.samples
        now = time.perf_counter()
        if now - self._at >= LOG_EVERY_S:
            log.info("%d updates in %.0f s, %.0f samples/s, %d members, staleness max %d, %d samples dropped",
                     self._rounds, now - self._at, self._samples / (now - self._at), m.members, staleness_max,
                     dropped)
            self._at, self._rounds, self._samples = now, 0, 0
