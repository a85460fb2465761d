"""The accumulator: what a peer has computed and not contributed yet, on the model's device.

``step`` adds each batch's gradients times its sample count (``Accumulator.add``); a round
takes the sum (``swap``: a fresh buffer takes the next batches at once) and moves it to host
memory for the ring (``to_host``: no copy on CPU, pinned on CUDA); an aborted round gives it
back (``merge``); a state load voids it (``void``). On CUDA the ring also writes its sums into
pinned arrays (``result_buffers``), so the averaged gradient returns at full speed. A batch
alone is *kept* as backward left it until a round needs a vector: a peer alone applies it as it
is (``add``).
``RoundMetrics`` is what a peer reports per applied update; ``CommittedUpdate`` and
``Outgoing`` are the records ``peer.AsyncPeer`` keeps while a round holds its contribution or
an update waits for the caller's thread.

Which parameters had a gradient (``Accumulator.used``, one bool each, OR-ed over the batches it
holds) goes out with the sum (``Outgoing.used``) and across the ring in the round's messages
(``p2ptrain.cluster.used``): where no member had one, ``p.grad`` stays None (``apply``).
"""

from __future__ import annotations

import bisect
import collections
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from p2ptrain.device import HostStaging
from p2ptrain.cluster.rounds import SyncPoint
from p2ptrain.trainer.flat import param_starts, param_views, write_scaled

if TYPE_CHECKING:
    from p2ptrain.trainer.overlap import Filling

log = logging.getLogger("p2ptrain.trainer.peer")  # (the peer's lines, under the peer's name)


@dataclass(frozen=True)
class RoundMetrics:
    """One update applied here. Bytes and seconds are this peer's view of its round."""
    round: int  # the cluster's round number
    version: int  # updates applied here, this one included
    members: int
    samples: int  # averaged in this update, all members together
    local_samples: int  # of which this peer's
    staleness: int  # of this peer's oldest gradient in it (updates between computing and applying)
    staleness_max: int  # the largest so far
    dropped: int  # samples dropped so far (staler than the bound, or void after loading state)
    wire_bytes: int  # this peer's ring sent this much (compressed) ...
    raw_bytes: int  # ... standing for this much float32
    round_time: float  # seconds from taking this peer's contribution to the commit
    compute_time: float  # mean seconds per step outside step() (data, forward, backward) since the last update
    wait_time: float  # seconds step() blocked since the last update
    param_checksum: str = ""  # of the parameters after an update compared with the leader's (drift.sketch_checksum:
    #                          equal when bit-identical); "" for the others, and alone


@dataclass
class CommittedUpdate:  # a committed round, waiting for the caller's thread to apply it
    summed: np.ndarray | None  # None: nobody had anything (the round still counts for the lineage)
    total: int
    point: SyncPoint
    metrics: RoundMetrics | None
    ours: Outgoing | None = None  # our contribution's memory, when the cluster handed it back as the result
    compare: bool = False  # others are synced: report the parameter checksum after applying it
    used: np.ndarray | None = None  # which parameters some member had a gradient for (bools); None: all
    spread: tuple | None = None  # (largest, squares) of the members' samples (``roundmsg.spread_of``); None: not known


@dataclass
class Outgoing:  # this peer's contribution, with the cluster until applied or put back
    buffer: torch.Tensor | None  # the device sum it came from, while that is the host array itself (CPU)
    samples: int
    batches: int
    oldest: int | None
    taken_at: float
    members: int
    array: np.ndarray | None = None
    staging: HostStaging | None = None
    grads: list[torch.Tensor | None] | None = None  # a kept batch's gradients, not all written (``Accumulator``)
    filling: Filling | None = None  # backward still writes it (``overlap``)
    writer: WrittenAsRead | None = None  # ... or the ring's reads write the kept batch into it
    used: np.ndarray | None = None  # which parameters had a gradient in it (bools; ``Accumulator.used``)
    share_at: float | None = None  # when its batches first reached our share (``TrainerState.add_batch``)

    def used_flags(self) -> np.ndarray | None:
        """Which parameters had a gradient in it: a filling's once ``step`` confirmed it
        (``Filling.used``), else ``used``."""
        return self.filling.used if self.filling is not None else self.used


class WrittenAsRead:
    """A kept batch written into its contribution's buffer a range at a time, as the ring reads
    it (the ring's ``ready``), not all at once before the ring starts: its first chunk goes out
    after one chunk's multiplication, and the rest are written while chunks are on the wire
    (1 M values, N = 2 at 1 Gbit/s on 2 cores: the whole vector took 0.8 ms before the first
    encode, every round). The same ``batch x grad`` as ``Accumulator.add``, so the same bits.
    Once every value is written the buffer is the contribution, and ``out.grads`` is dropped;
    until then an aborted round takes the gradients back (``merge``). On the loop's thread."""

    def __init__(self, out: Outgoing, flat: torch.Tensor, starts: list[int]):
        """``starts``: where each parameter begins in ``flat``, and its end last."""
        self.out, self.flat, self.starts = out, flat, starts
        self.grads, self.batch_size = out.grads, out.samples
        self.written: list[tuple[int, int]] = []  # disjoint, sorted
        self.left = len(flat)

    async def until(self, start: int, stop: int) -> None:
        self.write(start, stop)

    def finish(self) -> None:
        self.write(0, len(self.flat))

    def write(self, start: int, stop: int) -> None:
        for a, b in self._gaps(start, stop):
            self._write(a, b)
            bisect.insort(self.written, (a, b))
            self.left -= b - a
        if not self.left:  # (the buffer holds the batch whole: it is the contribution now)
            self.out.grads = self.grads = None

    def _gaps(self, start: int, stop: int) -> list[tuple[int, int]]:
        gaps, at = [], start
        for a, b in self.written:
            if b <= at:
                continue
            if a >= stop:
                break
            if a > at:
                gaps.append((at, a))
            at = max(at, b)
        if at < stop:
            gaps.append((at, stop))
        return gaps

    def _write(self, start: int, stop: int) -> None:
        with torch.no_grad():
            i = bisect.bisect_right(self.starts, start) - 1
            while i < len(self.grads) and self.starts[i] < stop:
                lo, hi = max(start, self.starts[i]), min(stop, self.starts[i + 1])
                g = self.grads[i]
                part = None if g is None else g.reshape(-1)[lo - self.starts[i]: hi - self.starts[i]]
                write_scaled(self.flat[lo:hi], part, self.batch_size)
                i += 1


class ViewCache:
    """``param_views`` of the last few flat buffers, by buffer: a view costs a few microseconds
    of Python per parameter (milliseconds a round for a model of a few hundred tensors), and the
    buffers a round goes through are a few, reused. ``keep`` buffers at most (the views hold
    their buffer: an older one's are dropped, and made again if it comes back). One thread at a
    time."""

    def __init__(self, params, keep: int):
        self.params, self.keep = params, keep
        self._views: collections.OrderedDict[int, tuple] = collections.OrderedDict()  # id -> (buffer, views)

    def __call__(self, buffer, flat: torch.Tensor | None = None) -> list[torch.Tensor]:
        """The views of ``flat`` (default: ``buffer`` itself), remembered under ``buffer``."""
        entry = self._views.get(id(buffer))
        if entry is None or entry[0] is not buffer:
            entry = (buffer, param_views(buffer if flat is None else flat, self.params))
            self._views[id(buffer)] = entry
            while len(self._views) > self.keep:
                self._views.popitem(last=False)
        self._views.move_to_end(id(buffer))
        return entry[1]


class Accumulator:
    """``sum(batch_size * grad)`` in a flat float32 buffer on the model's device, and what it
    holds: samples, batches, the oldest parameter version. ``swap`` hands the sum over and
    starts a fresh one; on CPU the handed-over buffer *is* the host array (no copy), elsewhere
    ``to_host`` copies it to a host buffer (pinned on CUDA). The owner serializes calls.

    A buffer coming back for reuse is not cleared then (a pass over the whole vector, on the
    cluster's thread between a ring's end and the update reaching ``step``): it is *dirty*,
    and the first ``add`` into it writes ``batch_size * grad`` instead of adding it.

    A batch added with ``keep`` into an empty accumulator is *kept*: its gradient tensors are
    moved out of ``p.grad`` as they are, and written into the buffer only when ``to_host``
    needs a vector. A round whose sum is that contribution itself (a peer alone) then applies
    them with no pass over them at all (``Outgoing.grads``): before, a step of a peer alone
    wrote, divided and, on a GPU, copied its whole gradient to the host and back."""

    def __init__(self, params: list[torch.Tensor], device: torch.device):
        self.params, self.device = params, device
        self.numel = sum(p.numel() for p in params)
        self._starts = param_starts(params)  # (``WrittenAsRead``)
        self._spare: list[torch.Tensor] = []
        self._staging: list[HostStaging] = []
        self._flat = self._fresh()
        self._dirty = False  # _flat holds an old sum: the next add writes instead of adding
        self._views_of = ViewCache(self.params, keep=6)  # (the sum, one out, spares, overlap's host copy: a few)
        self._views = self._views_of(self._flat)
        self.samples = self.batches = 0
        self.oldest: int | None = None
        self.used = np.zeros(len(params), bool)  # parameters with a gradient in a batch added (OR-ed)
        self._kept: list[torch.Tensor | None] | None = None  # the one batch taken in, not written yet
        self._filling_staging: HostStaging | None = None  # (CUDA, overlap: the host copy of a batch being written)

    def _fresh(self) -> torch.Tensor:
        return self._spare.pop() if self._spare else torch.zeros(self.numel, dtype=torch.float32, device=self.device)

    def _staging_buffer(self) -> HostStaging:
        return self._staging.pop() if self._staging else HostStaging(self.numel, self.device)

    def _renew(self) -> None:
        """The sum went out: a fresh buffer takes the next batches (a reused one is dirty)."""
        self._dirty = bool(self._spare)
        self._flat = self._fresh()
        self._views = self._views_of(self._flat)

    def add(self, batch_size: int, version: int, keep: bool = False) -> None:
        """Add the parameters' gradients times ``batch_size``, and clear them. ``keep``: if
        nothing was added yet, keep them as they are instead (see the class docstring)."""
        grads = [p.grad for p in self.params]
        for p in self.params:
            p.grad = None
        self.used |= np.fromiter((g is not None for g in grads), bool, len(grads))
        self._accumulate(grads, batch_size, keep and not any(g is not None and g.is_sparse for g in grads))
        self.samples += batch_size
        self.batches += 1
        self.oldest = version if self.oldest is None else min(self.oldest, version)

    def _accumulate(self, grads: list, batch_size: int, keep: bool) -> None:
        """One batch's gradients into the sum: kept as they are where ``keep`` and nothing was
        added yet, else added (a kept batch is written first). The counts are the caller's."""
        if keep and not self.samples:
            self._kept = grads
            return
        self._write_kept()
        self._sum(self._views, grads, batch_size, write=self._dirty)
        self._dirty = False

    def _write_kept(self) -> None:
        """A kept batch goes into the buffer, which held nothing (another batch joins it)."""
        if self._kept is not None:
            self._sum(self._views, self._kept, self.samples, write=True)
            self._kept, self._dirty = None, False

    @staticmethod
    def _sum(views: list[torch.Tensor], grads: list, batch_size: int, write: bool) -> None:
        """``views += batch_size * grads``; with ``write``, ``views = batch_size * grads``
        (zeros where a parameter has none): the first batch into a dirty buffer."""
        with torch.no_grad():
            if write:
                for view, g in zip(views, grads):
                    write_scaled(view, g, batch_size)
                return
            f32_views, f32_grads = [], []
            for view, g in zip(views, grads):
                if g is None:
                    continue
                g = g.to_dense() if g.is_sparse else g
                if g.dtype == torch.float32:
                    f32_views.append(view)
                    f32_grads.append(g)
                else:
                    view.add_(g.float(), alpha=float(batch_size))
            if f32_views:
                torch._foreach_add_(f32_views, f32_grads, alpha=float(batch_size))  # one call for all

    def spans(self, flags: np.ndarray) -> list[tuple[int, int]]:
        """The ranges of the flat buffer of the parameters ``flags`` marks."""
        return [(self._starts[i], self._starts[i + 1]) for i in np.flatnonzero(flags)]

    def begin_filling(self) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """(empty) Where a backward's hooks write the next batch (``overlap``): the sum's views,
        and on CUDA views of a pinned host buffer the ring reads (else None). Until ``filled``,
        what they write is no sum (the next ``add`` writes over it)."""
        self._dirty = True
        if self.device.type != "cuda":
            return self._views, None
        staging = self._filling_staging = self._staging_buffer()
        return self._views, self._views_of(staging, staging.tensor)

    def filled(self, samples: int, version: int, used: np.ndarray) -> None:
        """The hooks wrote the whole batch into the sum, and no round took it yet: it is one
        (``used``: which parameters had a gradient in it)."""
        self._dirty = False
        self.samples, self.batches, self.oldest = samples, 1, version
        self.used = used.copy()
        self._unstage()

    def abandon_filling(self) -> None:
        """A filling never taken was withdrawn: the sum is empty, and what the hooks wrote into
        it is no sum (dirty: also after a ``void`` while they wrote)."""
        self._dirty = True
        self._unstage()

    def _unstage(self) -> None:
        if self._filling_staging is not None:
            self._staging.append(self._filling_staging)
            self._filling_staging = None

    def swap_filling(self, members: int, filling: Filling) -> Outgoing:
        """A round takes the batch backward is writing (``overlap``): the sum goes out as it is,
        counted as the hooks' guess, and its host array is the one the hooks copy into."""
        out = Outgoing(self._flat, filling.guess, 1, filling.version, time.perf_counter(), members,
                       filling=filling)  # (which parameters had a gradient: ``filling.used``, once confirmed)
        if self._filling_staging is not None:
            out.staging, self._filling_staging = self._filling_staging, None
            out.array = out.staging.array
        else:
            out.array = self._flat.numpy()
        self._renew()
        return out

    def begin_writing(self) -> list[torch.Tensor] | None:
        """The sum's views while it holds nothing, for a contribution written straight into them
        and then handed to ``add_weighted`` (a pseudo-gradient: no vector of its own); else None.
        Until then what they hold is no sum (dirty: a contribution left out leaves it so)."""
        if self.samples or self._kept is not None:
            return None
        self._dirty = True
        return self._views

    def add_weighted(self, tensors: list[torch.Tensor], samples: int, version: int) -> None:
        """Add ``samples * tensors`` (one per parameter: a pseudo-gradient in local-steps mode);
        or ``tensors`` are the views ``begin_writing`` gave, written since with ``samples *``
        the values (``LocalSteps.contribute``: weighted as it writes them)."""
        with torch.no_grad():
            if tensors is self._views:
                self._dirty = False
            elif self._dirty:
                torch._foreach_copy_(self._views, tensors)
                torch._foreach_mul_(self._views, float(samples))
                self._dirty = False
            else:
                torch._foreach_add_(self._views, tensors, alpha=float(samples))
        self.samples += samples
        self.batches += 1
        self.oldest = version if self.oldest is None else min(self.oldest, version)
        self.used[:] = True  # (a parameter change: one that no inner step moved changes by zero)

    def swap(self, members: int) -> Outgoing:
        """Start a fresh sum; the old one goes out (then ``to_host`` it, off the owner's lock)."""
        if self._dirty and self._kept is None:  # (nothing was added: it goes out as zeros)
            self._flat.zero_()
        out = Outgoing(self._flat, self.samples, self.batches, self.oldest, time.perf_counter(), members,
                       grads=self._kept, used=self.used)
        self._kept = None
        self.used = np.zeros(len(self.params), bool)
        self._renew()
        self.samples = self.batches = 0
        self.oldest = None
        return out

    def to_host(self, out: Outgoing, alone: bool = False) -> None:
        """``out.array``: the contribution as a host vector (no copy on CPU, pinned on CUDA).
        ``alone`` (the round's sum is this contribution itself): a kept batch stays as it is,
        and ``out.array`` is an empty token that the cluster hands back as the sum. Else, on
        the CPU, a kept batch is written as the ring reads it (``out.writer``, its ``ready``)."""
        if out.grads is not None:
            if alone:
                self._spare.append(out.buffer)  # (dirty: the next add writes over it)
                out.buffer, out.array = None, np.empty(0, np.float32)
                return
            if self.device.type == "cpu":  # (the ring writes it as it reads: ``out.writer``)
                out.writer, out.array = WrittenAsRead(out, out.buffer, self._starts), out.buffer.numpy()
                return
            self._sum(self._views_of(out.buffer), out.grads, out.samples, write=True)
            out.grads = None
        if self.device.type == "cpu":
            out.array = out.buffer.numpy()
            return
        out.staging = self._staging_buffer()
        out.array = out.staging.to_host([out.buffer])
        self._spare.append(out.buffer)  # (dirty: the next add writes over it)
        out.buffer = None

    def result_buffers(self, count: int) -> list[np.ndarray]:
        """Host arrays for the ring to write its sums into (``Cluster.recycle``): pinned on CUDA,
        so that the averaged gradient goes back to the device at the bus's full speed (a copy from
        pageable memory runs at a fraction of it, through the driver's own staging); none on
        other devices, where the ring's own arrays serve. Fewer where pinned memory runs out."""
        if self.device.type != "cuda":
            return []
        arrays = []
        try:
            for _ in range(count):
                arrays.append(HostStaging(self.numel, self.device).array)
        except RuntimeError as exc:  # (page-locked memory is a limited resource)
            log.debug("pinned result buffers: %d of %d (%s)", len(arrays), count, exc)
        return arrays

    def release(self, out: Outgoing) -> None:
        """The cluster is done with ``out``: its memory is reused."""
        if out.buffer is not None:
            self._spare.append(out.buffer)  # (dirty: the next add writes over it)
        if out.staging is not None:
            self._staging.append(out.staging)

    def merge(self, out: Outgoing) -> None:
        """Take a contribution back (its round aborted): the next round carries it."""
        if out.grads is not None:  # (a kept batch, never written: kept again, or added)
            self._accumulate(out.grads, out.samples, keep=True)
            self._count(out)
            self.release(out)
            return
        self._write_kept()
        back = out.buffer if out.buffer is not None else torch.from_numpy(out.array).to(self.device)
        self._flat.copy_(back) if self._dirty else self._flat.add_(back)
        self._dirty = False
        self._count(out)
        self.release(out)

    def _count(self, out: Outgoing) -> None:
        self.samples += out.samples
        self.batches += out.batches
        used = out.used_flags()
        if used is not None:
            self.used |= used
        if out.oldest is not None:
            self.oldest = out.oldest if self.oldest is None else min(self.oldest, out.oldest)

    def void(self) -> int:
        """Drop what was added; returns the samples dropped."""
        dropped = self.samples
        self._kept = None
        self._flat.zero_()
        self._dirty = False
        self.samples = self.batches = 0
        self.oldest = None
        self.used[:] = False
        return dropped
