"""Whether this machine slept (a lid closed) between two events. Pure code.

A suspended machine's monotonic clock stops on Linux (``CLOCK_MONOTONIC``) and macOS, so the
event loop's time, and the round machine's with it, shows no gap after a lid opens, while its
peers gave it up meanwhile. The wall clock goes on; its gap past the monotonic one is the sleep.
(A process stopped by SIGSTOP shows a gap in both: the round machine sees that one itself.)
"""

from __future__ import annotations


class SleepWatch:
    """``slept(mono, wall)`` on every event: the seconds the wall clock ran ahead of the
    monotonic one since the last call, where that is past ``least`` (else 0.0). A wall clock
    set back, or forward by less (NTP's small steps), reads as no sleep; one set forward by
    more reads as a sleep, whose handling (peers forgiven, a led round voided) is harmless."""

    def __init__(self, least: float) -> None:
        self.least = least
        self._last: tuple[float, float] | None = None

    def slept(self, mono: float, wall: float) -> float:
        last, self._last = self._last, (mono, wall)
        if last is None:
            return 0.0
        ahead = (wall - last[1]) - (mono - last[0])
        return ahead if ahead > self.least else 0.0
