"""The ring-allreduce schedule: which piece of the buffer moves where, and when. Pure code.

N peers in a ring; peer ``r`` sends to ``r+1`` and receives from ``r-1``. The buffer is cut
into N near-equal segments, each segment into chunks of at most ``chunk_elems`` values.

The 2(N-1) steps are numbered ``g = 0 .. 2N-3``:

- reduce-scatter, ``g = k`` for k < N-1: send segment ``r-k``, receive segment ``r-k-1`` and
  add our own values into it. After the last one, peer r holds the full sum of segment ``r+1``
  (it *owns* that segment).
- all-gather, ``g = N-1+k``: send segment ``r+1-k``, receive segment ``r-k`` (final values).

What peer r sends at step g is exactly what it received at step g-1 (after its add, in the
reduce-scatter), chunk for chunk. So a chunk can leave as soon as the same chunk of the
previous step has arrived: that dependency is the whole pipeline, and ``Transfer.after``
names it. Each link carries 2(N-1)/N of the buffer: bandwidth-optimal.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

DEFAULT_CHUNK_ELEMS = 1 << 19  # 2 MiB of float32: the largest chunk
MIN_CHUNK_ELEMS = 1 << 17  # 512 KiB of float32 (128 KiB as int8): below this, per-chunk overhead dominates
CHUNKS_PER_SEGMENT = 8
BUCKET_ELEMS = 1 << 22  # 16 MiB of float32: a bucket's most (DDP's default cap is 25 MB)


def chunk_elems_for(length: int, size: int, max_elems: int = DEFAULT_CHUNK_ELEMS) -> int:
    """The chunk size for a buffer: small enough that a segment has ``CHUNKS_PER_SEGMENT``
    chunks, within [MIN_CHUNK_ELEMS, max_elems]. A pure function of the call, so every
    peer derives the same value.

    Each chunk costs fixed CPU on both sides of a hop (a frame, a hand-off to a data thread
    and back, a dozen numpy calls): with 32 chunks of at most 1 MiB per segment, that was
    a quarter to a half of a 64 MiB call's CPU on loopback (2 cores). A wire-bound ring
    loses about one chunk's wire time to filling and draining its pipeline (every later
    chunk's predecessor has long arrived): 1/(2(N-1)*8) of the call at 8 per segment.
    Measured on loopback, 64 MiB, N = 2 and 4, fp32 and int8: 2 MiB chunks beat 1 MiB
    (less CPU, same or less wall time) and 4 MiB (more wall time at N = 2).

    A small segment gets fewer, larger chunks (``MIN_CHUNK_ELEMS``): within a segment, chunks
    only overlap one chunk's compute with the wire, and two already do that, while each one
    costs its frame and its Python on both sides. Measured (2 cores, loopback, 4 peers
    training a 1 M-parameter model in local-steps mode, int8): chunks of 128 K values instead
    of 31 K took the loop thread's CPU from 13.4 to 9.1 ms a round and the ring from 48 to 38
    ms; ``bench/allreduce.py`` int8 at 4 MiB went from 37 to 13 ms (N = 4) and 12 to 3.3 ms
    (N = 2)."""
    segment = -(-length // max(1, size))
    return max(min(MIN_CHUNK_ELEMS, max_elems), min(max_elems, -(-segment // CHUNKS_PER_SEGMENT)))


def bucket_bounds(length: int, bucket_elems: int | None = None) -> tuple[tuple[int, int], ...]:
    """The buckets of a round's ring, in ring order: the buffer cut into near-equal ranges of
    at most ``bucket_elems`` (``BUCKET_ELEMS``), its end first (where backward's first gradients
    land). A pure function of the length, so every peer derives the same."""
    return tuple(reversed(split(length, max(1, -(-length // (bucket_elems or BUCKET_ELEMS))))))


def split(length: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous near-equal ranges covering ``range(length)``; the first ones are longer."""
    if parts < 1 or length < 0:
        raise ValueError(f"cannot split {length} into {parts} parts")
    base, extra = divmod(length, parts)
    bounds, start = [], 0
    for i in range(parts):
        stop = start + base + (1 if i < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def chunks_of(start: int, stop: int, chunk_elems: int) -> list[tuple[int, int]]:
    """``[start, stop)`` cut into chunks of at most ``chunk_elems`` (none if empty)."""
    return [(a, min(a + chunk_elems, stop)) for a in range(start, stop, chunk_elems)]


@dataclass(frozen=True)
class Transfer:
    """One chunk moving one hop at step ``g``: values ``[start, stop)`` of the buffer."""

    g: int  # the step, numbered on across buckets (unique in a plan)
    chunk: int
    start: int
    stop: int
    reduce: bool  # reduce-scatter (receiver adds its own values) or all-gather (receiver copies)
    step: int  # the step within its bucket's ring (``g`` in a plan of one bucket)

    @property
    def after(self) -> tuple[int, int] | None:
        """The (step, chunk) whose arrival this send waits for; None for our own first data."""
        return None if self.step == 0 else (self.g - 1, self.chunk)


@dataclass(frozen=True)
class RingPlan:
    """The schedule of one allreduce of ``length`` values for peer ``rank`` of ``size``."""

    rank: int
    size: int
    length: int
    chunk_elems: int = DEFAULT_CHUNK_ELEMS
    buckets: tuple[tuple[int, int], ...] | None = None  # rings in order (None: one over the whole buffer)

    def __post_init__(self):
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank {self.rank} outside a ring of {self.size}")
        if self.chunk_elems < 1:
            raise ValueError("chunk_elems must be positive")
        if not self._covers():
            raise ValueError(f"buckets {self.buckets} do not cover [0, {self.length}) once")

    def _covers(self) -> bool:
        bounds = sorted(self.buckets or ((0, self.length),))
        return (bounds[0][0] == 0 and bounds[-1][1] == self.length
                and all(a[1] == b[0] for a, b in zip(bounds, bounds[1:])) and all(a <= b for a, b in bounds))

    @cached_property
    def _bucket_segments(self) -> list[list[tuple[int, int]]]:
        """Each bucket's ring's N segments, in ring order (one bucket: the whole buffer's)."""
        return [[(start + a, start + b) for a, b in split(stop - start, self.size)]
                for start, stop in (self.buckets or ((0, self.length),))]

    @cached_property
    def final_chunks(self) -> list[tuple[int, int]]:
        """Every chunk's range, each once (what the all-gather makes final), in buffer order."""
        return sorted(c for segments in self._bucket_segments for start, stop in segments
                      for c in chunks_of(start, stop, self.chunk_elems))

    @property
    def steps(self) -> int:
        return 2 * (self.size - 1)

    @property
    def owned(self) -> int:
        """The segment this peer holds the full sum of after the reduce-scatter."""
        return (self.rank + 1) % self.size

    def send_segment(self, g: int) -> int:
        k = g if g < self.size - 1 else g - (self.size - 1) - 1
        return (self.rank - k) % self.size

    def recv_segment(self, g: int) -> int:
        k = g if g < self.size - 1 else g - (self.size - 1)
        return (self.rank - k - 1) % self.size if g < self.size - 1 else (self.rank - k) % self.size

    def _transfers(self, segment_of) -> list[Transfer]:
        out = []
        for bucket, segments in enumerate(self._bucket_segments):
            for step in range(self.steps):
                start, stop = segments[segment_of(step)]
                for c, (a, b) in enumerate(chunks_of(start, stop, self.chunk_elems)):
                    out.append(Transfer(bucket * self.steps + step, c, a, b, reduce=step < self.size - 1,
                                        step=step))
        return out

    @cached_property
    def sends(self) -> list[Transfer]:
        """Everything this peer sends, in wire order."""
        return self._transfers(self.send_segment)

    @cached_property
    def recvs(self) -> list[Transfer]:
        """Everything this peer receives, in wire order (= its predecessor's ``sends``)."""
        return self._transfers(self.recv_segment)
