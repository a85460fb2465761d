"""Whether a lossy codec's chunk reaches the next peer sooner encoded or as raw float32.

int8 sends a quarter of fp32's bytes but costs CPU for every value, to encode here and to
decode there. On a link that carries raw bytes faster than the codec turns them out
(loopback, a fast LAN, peers short of CPU, a GIL shared with a busy loop) encoding only
delays the ring: there the chunk goes raw, which is also exact. ``LinkPace`` keeps, per send
link and across calls, two figures measured while the ring runs: how fast the link drains
(bytes per second the kernel got rid of while it held bytes of ours; lower bounds where it
ran dry) and the codec's seconds per value (our encodes and decodes). It says raw when the
bytes that encoding would save take the link less time than the codec takes to save them,
and never while the link is behind (it holds more of our bytes than an encoded chunk). Raw
must win by ``MARGIN``: where the two come out about even, fewer bytes are the better use of
a link that others may share (and of a rate estimate that is only an estimate).

Pure: no sockets and no clock of its own; the allreduce feeds it times and queue lengths.
``P2PTRAIN_RAW_CHUNKS=0`` turns it off (every chunk encoded, as a user may want to keep a
shared link's bytes low whatever the speed).
"""

from __future__ import annotations

import os

from p2ptrain.errors import ConfigError

ENV = "P2PTRAIN_RAW_CHUNKS"
ALPHA = 0.25               # weight of a new sample in the moving averages
MARGIN = 2.0               # raw only where the codec would take this many times the time it saves
MIN_SAMPLE_BYTES = 64 << 10  # a drain figure over fewer bytes is the kernel's bursts, not the link
MIN_SAMPLE_S = 100e-6


def raw_chunks_enabled() -> bool:
    """``P2PTRAIN_RAW_CHUNKS``: 1 (default) lets a lossy codec's chunks go raw where that is
    sooner; 0 encodes every chunk. Anything else is a ConfigError (``join`` checks at start)."""
    value = os.environ.get(ENV, "").strip()
    if value in ("", "1"):
        return True
    if value == "0":
        return False
    raise ConfigError(f"{ENV}={value!r}: expected 0 or 1")


def _average(old: float | None, new: float) -> float:
    return new if old is None else old + ALPHA * (new - old)


class LinkPace:
    """One send link's drain rate and the codec's cost, and the choice they make."""

    def __init__(self) -> None:
        self._busy = [0.0, 0.0]   # bytes drained and seconds taken while the kernel held ours (decayed sums)
        self._dry = 0.0           # bytes/s drained where it ran dry: a lower bound (decaying maximum)
        self.encode_s: float | None = None    # seconds per value to encode (moving average)
        self.decode_s: float | None = None    # ... and to decode
        self._after: tuple[float, int] | None = None  # (time, queued bytes) when the last send returned

    # -- what the ring measured --------------------------------------------------------------
    def encoded(self, values: int, seconds: float) -> None:
        if values > 0:
            self.encode_s = _average(self.encode_s, seconds / values)

    def decoded(self, values: int, seconds: float) -> None:
        if values > 0:
            self.decode_s = _average(self.decode_s, seconds / values)

    def sent(self, began: float, queued_before: int | None, ended: float, queued_after: int | None,
             nbytes: int) -> None:
        """A send of ``nbytes`` ran from ``began`` to ``ended``, the kernel holding
        ``queued_before`` and ``queued_after`` unacknowledged bytes of ours around it."""
        if queued_before is None or queued_after is None:
            self._after = None
            return
        if self._after is not None:  # the gap since the last send: the link drained alone
            t, q = self._after
            self._sample(q - queued_before, began - t, dry=queued_before == 0)
        self._sample(queued_before + nbytes - queued_after, ended - began, dry=queued_after == 0)
        self._after = (ended, queued_after)

    def _sample(self, drained: int, seconds: float, dry: bool) -> None:
        """``drained`` bytes left the kernel in ``seconds``; ``dry``: it ran out of them
        meanwhile, so the link could have done more (a lower bound). Busy samples are summed,
        bytes and seconds apart: a short one of bunched acknowledgements weighs little."""
        if drained < MIN_SAMPLE_BYTES or seconds < MIN_SAMPLE_S:
            return
        if dry:
            self._dry = max(self._dry * (1 - ALPHA), drained / seconds)
        else:
            self._busy = [self._busy[0] * (1 - ALPHA) + drained, self._busy[1] * (1 - ALPHA) + seconds]

    @property
    def rate(self) -> float | None:
        """Bytes per second the link drains (None: not measured yet)."""
        busy = self._busy[0] / self._busy[1] if self._busy[1] else 0.0
        return max(busy, self._dry) or None

    # -- the choice -----------------------------------------------------------------------
    def send_raw(self, values: int, encoded_bytes: int, queued: int | None) -> bool:
        """Whether ``values`` float32 reach the next peer sooner raw than as ``encoded_bytes``
        of codec (``queued``: our bytes the kernel holds now; None: the OS cannot tell)."""
        rate = self.rate
        if queued is None or rate is None or self.encode_s is None:
            return False  # (nothing known: as asked, encoded)
        if queued > encoded_bytes:
            return False  # the link is behind: it sets the pace, and fewer bytes are sooner
        saved_s = (4 * values - encoded_bytes) / rate
        return MARGIN * saved_s < values * (self.encode_s + (self.decode_s or 0.0))
