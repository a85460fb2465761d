"""What local-steps mode's ``sync_every`` (``join --sync-every``) may be. Pure code, no I/O.

- a count, ``16``: a round every 16 inner steps of each peer, whatever their speed;
- a window of time, ``2s``, ``500ms``, ``1.5s``: a round every window, each peer taking the inner
  steps that fit in it (a fast GPU 40, a laptop 4), its parameter change weighted by its samples;
- ``auto``: the window picked from the measured link and compute, so that a round's exchange
  takes well under it.

``parse_sync_every`` turns what a user wrote (an int, or text from a flag or a variable) into a
``SyncEvery``, or raises ``ConfigError`` with one line saying what is allowed; ``settings`` states
its canonical form in the handshake, so every peer of a cluster compares the same text (a count
stays an int there, as peers without windows state it).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from p2ptrain.errors import ConfigError

MIN_WINDOW_S = 0.01  # a window shorter than this is a round per step: give a count of 1 instead
MAX_WINDOW_S = 3600.0  # a window longer than an hour is a typo (an hour without a round)
MAX_STEPS = 1_000_000
_DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ms|s)")
EXPECTED = "an int >= 1 (inner steps per round), a window of time (e.g. 2s, 500ms) or auto"


@dataclass(frozen=True)
class SyncEvery:
    """A round every ``steps`` inner steps, or every ``seconds``; neither: ``auto``."""

    steps: int | None = None
    seconds: float | None = None

    @property
    def by_time(self) -> bool:
        """Rounds by time (a window or ``auto``), not by a count of steps."""
        return self.steps is None

    @property
    def auto(self) -> bool:
        return self.steps is None and self.seconds is None

    def canonical(self) -> int | str:
        """What the handshake states (``settings``): the count as an int, else ``2s``, ``500ms``, ``auto``."""
        if self.steps is not None:
            return self.steps
        if self.seconds is None:
            return "auto"
        ms = self.seconds * 1e3
        return f"{ms:g}ms" if ms < 1000 else f"{self.seconds:g}s"

    def __str__(self) -> str:
        return str(self.canonical())


def parse_sync_every(value) -> SyncEvery:
    """``value`` as a ``SyncEvery``: an int >= 1, a ``SyncEvery``, or text (``16``, ``2s``, ``500ms``,
    ``auto``; case and surrounding spaces ignored). Anything else: ``ConfigError``, one line."""
    if isinstance(value, SyncEvery):
        return value
    if type(value) is int:
        if not 1 <= value <= MAX_STEPS:
            raise ConfigError(f"sync_every must be {EXPECTED}; got {value!r} (at most {MAX_STEPS:,} steps)")
        return SyncEvery(steps=value)
    if not isinstance(value, str):
        raise ConfigError(f"sync_every must be {EXPECTED}; got {value!r}")
    text = value.strip().lower()
    if text == "auto":
        return SyncEvery()
    if text.isdigit():
        return parse_sync_every(int(text))
    found = _DURATION.fullmatch(text)
    if found is None:
        shown = value if len(value) <= 40 else value[:40] + "..."
        raise ConfigError(f"sync_every must be {EXPECTED}; got {shown!r}")
    seconds = float(found.group(1)) / (1e3 if found.group(2) == "ms" else 1.0)
    if not MIN_WINDOW_S <= seconds <= MAX_WINDOW_S:
        raise ConfigError(f"sync_every={value.strip()!r}: a window must be {MIN_WINDOW_S * 1e3:g}ms..{MAX_WINDOW_S:g}s "
                          "(for a round every inner step, give 1)")
    return SyncEvery(seconds=seconds)
