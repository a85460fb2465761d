"""Whether a lossy codec's chunk reaches the next peer sooner encoded or as raw float32.

int8 sends a quarter of fp32's bytes but costs CPU for every value, to encode here and to
decode there. On a link that carries raw bytes faster than the codec turns them out
(loopback, a fast LAN, peers short of CPU, a GIL shared with a busy loop) encoding only
delays the ring: there the chunk goes raw, which is also exact. ``LinkPace`` keeps, per send
link and across calls, two figures measured while the ring runs: how fast the link drains
(bytes the kernel got rid of while a send ran or while it held bytes of ours throughout;
never over an idle gap) and the codec's seconds per value (our encodes and decodes). It says
raw when the bytes that encoding would save take the link less time than the codec takes to
save them, less the time the link needs to drain what it holds of ours already (the encode
runs meanwhile): a link that is behind keeps the codec only where its queue takes longer to
drain than the codec takes (a slow link); a fast one that holds bytes because the next peer
is busy reading is no reason to encode, which only makes both ends busier. Nothing goes raw
until the link has drained ``SETTLED_BYTES`` in the samples: a rate read over less may be a
burst's (a token bucket's, a switch's buffer; 100 Mbit/s read as several times that after a
few small calls). Raw must win by ``MARGIN``: where the two come out about even, fewer bytes
are the better use of a link that others may share (and of a rate that is only an estimate).

A link to a peer on this machine (``Link.same_host``: loopback, two GPUs' peers on one
desktop) is not judged by the figures: its "wire" is the kernel copying between processes
on the same cores, and the drain rate there (seldom measured: the kernel takes most chunks
whole) is how fast the next peer reads, which its own decoding slows, so the figures keep
choosing the codec because they chose it. Which way is sooner there depends on the machine:
on one 2-core VM raw was quicker (int8 N = 2 48-51 -> 26-28 ms, N = 4 99-101 -> 78-86 ms), on
another the codec (the kernel's copies cost more there: 64 MiB at N = 4, raw 181.8 ms,
40 ms of a peer's CPU in the kernel; encoded 113.6 ms, 7 ms; ``none`` 163.4 ms). So once the
link has carried ``SETTLED_BYTES`` (a short run uses the codec as asked) whole calls are timed
both ways: ``TRIAL_EACH`` calls raw and as many encoded, by the call's parity (every peer
of a ring sends as many bytes a call, so all reach the trial at the same call and try the
same way in each), from the first chunk's arrival to the end, per value; the quicker way is
kept for ``TRIAL_EVERY`` calls, then timed again.

Pure: no sockets and no clock of its own; the allreduce feeds it times and queue lengths.
``P2PTRAIN_RAW_CHUNKS=0`` turns it off (every chunk encoded, as a user may want to keep a
shared link's bytes low whatever the speed).
"""

from __future__ import annotations

import statistics
import weakref

from p2ptrain.switches import env_switch

ENV = "P2PTRAIN_RAW_CHUNKS"
ALPHA = 0.25               # weight of a new sample in the moving averages
MARGIN = 2.0               # raw only where the codec would take this many times the time it saves
MIN_SAMPLE_BYTES = 64 << 10  # a drain figure over fewer bytes is the kernel's bursts, not the link
MIN_SAMPLE_S = 100e-6
SETTLED_BYTES = 8 << 20    # drained in the samples before the rate is trusted (a chunk may go raw)
TRIAL_EACH = 3             # a link to this machine: calls timed raw, and as many encoded, before choosing
TRIAL_EVERY = 256          # ... and calls the choice is kept before they are timed again


def raw_chunks_enabled() -> bool:
    """``P2PTRAIN_RAW_CHUNKS``: 1 (default) lets a lossy codec's chunks go raw where that is
    sooner; 0 encodes every chunk. Anything else is a ConfigError (``join`` checks at start)."""
    return env_switch(ENV, default=True)


def _average(old: float | None, new: float) -> float:
    return new if old is None else old + ALPHA * (new - old)


class LinkPace:
    """One send link's drain rate and the codec's cost, and the choice they make."""

    def __init__(self, same_host: bool = False) -> None:
        self.same_host = same_host  # (the peer runs on this machine: raw once SETTLED_BYTES are sent)
        self.sent_bytes = 0
        self._drained = [0.0, 0.0]  # bytes the kernel got rid of, and in how many seconds (decayed sums)
        self.encode_s: float | None = None    # seconds per value to encode (moving average)
        self.decode_s: float | None = None    # ... and to decode
        self._after: tuple[float, int] | None = None  # (time, queued bytes) when the last send returned
        self.measured = 0  # bytes drained in all the samples so far (not decayed)
        # A link to this machine: the way of the call now running (None: the codec, as asked, until
        # settled); seconds per value of the calls timed each way; the way chosen, for how many calls.
        self._call_raw: bool | None = None
        self._timed: dict[bool, list[float]] = {True: [], False: []}
        self.chosen: bool | None = None
        self._kept = 0

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
        self.sent_bytes += nbytes
        if queued_before is None or queued_after is None:
            self._after = None
            return
        if self._after is not None and queued_before > 0:  # the gap since the last send, the link
            t, q = self._after                               # busy throughout: it drained alone
            self._sample(q - queued_before, began - t)
        # (a gap in which it ran dry is idle time, not the link's speed: not counted)
        self._sample(queued_before + nbytes - queued_after, ended - began)
        self._after = (ended, queued_after)

    def _sample(self, drained: int, seconds: float) -> None:
        """``drained`` bytes left the kernel in ``seconds``. Summed, bytes and seconds apart,
        so that a short burst (a token bucket's, bunched acknowledgements) weighs little
        beside the link's steady pace."""
        if drained < MIN_SAMPLE_BYTES or seconds < MIN_SAMPLE_S:
            return
        b, s = self._drained
        self._drained = [b * (1 - ALPHA) + drained, s * (1 - ALPHA) + seconds]
        self.measured += drained

    @property
    def rate(self) -> float | None:
        """Bytes per second the link drains (None: not measured yet)."""
        b, s = self._drained
        return b / s if s else None

    # -- a link to this machine: whole calls timed both ways ----------------------------------
    def call_began(self, op: int) -> None:
        """A call (``op``: its number, the same on every peer) begins on this link."""
        if not self.same_host or self.sent_bytes < SETTLED_BYTES:
            self._call_raw = None
        elif self.chosen is not None and self._kept < TRIAL_EVERY:
            self._call_raw = self.chosen
            self._kept += 1
        else:
            self.chosen, self._call_raw = None, op % 2 == 0  # (timing: the peers of the ring alike)

    def call_ended(self, values: int, seconds: float | None) -> None:
        """The call began last ended well, ``seconds`` from its first chunk's arrival (None: none came)."""
        way, self._call_raw = self._call_raw, None
        if way is None or self.chosen is not None or seconds is None or values <= 0:
            return
        timed = self._timed[way]
        timed.append(seconds / values)
        if min(len(t) for t in self._timed.values()) >= TRIAL_EACH:
            raw, coded = (statistics.median(self._timed[w]) for w in (True, False))
            self.chosen, self._kept = raw < coded, 0
            self._timed = {True: [], False: []}

    # -- the choice -----------------------------------------------------------------------
    def send_raw(self, values: int, encoded_bytes: int, queued: int | None) -> bool:
        """Whether ``values`` float32 reach the next peer sooner raw than as ``encoded_bytes``
        of codec (``queued``: our bytes the kernel holds now; None: the OS cannot tell)."""
        if self.same_host:
            return bool(self._call_raw)
        rate = self.rate
        if queued is None or rate is None or self.encode_s is None or self.measured < SETTLED_BYTES:
            return False  # (nothing known, or a rate over too little traffic: as asked, encoded)
        # Raw arrives at (queued + 4 values) / rate; encoded at max(codec, queued / rate) plus
        # its bytes / rate: raw is sooner by the bytes saved against the codec's time beyond
        # the drain (none, so never raw, where the queue outlasts the codec).
        saved_s = (4 * values - encoded_bytes) / rate
        codec_s = values * (self.encode_s + (self.decode_s or 0.0)) - queued / rate
        return MARGIN * saved_s < codec_s


_PACES: "weakref.WeakKeyDictionary[object, LinkPace]" = weakref.WeakKeyDictionary()


def pace_of(link) -> LinkPace:
    """The link's ``LinkPace`` (a ``transport.Link``), kept as long as the link: what it
    measured serves later calls."""
    pace = _PACES.get(link)
    if pace is None:
        pace = _PACES[link] = LinkPace(same_host=link.same_host)
    return pace
