"""Overlap (``overlap=True``, staleness 0): a batch's gradients go into its round's buffer as
backward makes them, and the round's ring starts on the first ones while backward computes the
rest, as DDP's reducer does; a step costs about max(backward, ring), not their sum.

How. A hook per parameter (``register_post_accumulate_grad_hook``) fires once backward has
accumulated that parameter's gradient. The first hook after a ``step`` decides whether this
backward feeds a round (``backward_feed.BackwardFeed``, the peer's ``_feed``: staleness 0, gradient mode,
others to train with, nothing else accumulated); each then writes ``batch x grad`` into the
accumulator's buffer (the batch: the last one ``step`` was given, a guess), and once the ring's
first bucket is written (the buffer's end, where backward starts) the round may take that
buffer (``Filling``, the ring's ``ready``: it reads a range of our values only once the hooks
wrote it). Not sooner: a round's messages and a ring waiting on hooks would only contend with
backward for the interpreter. For the same reason a model of one bucket (up to ``BUCKET_ELEMS``,
4 M parameters) is not overlapped at all: its ring is short, and overlapping it cost more than
it hid (measured on 2 cores, N = 2, 150 K parameters: 1.5x DDP's time against 1.3x). ``step``
then confirms: the same batch size and one backward per parameter, and it writes what no hook did
(a parameter without a gradient: zeros, as ``Accumulator.add`` would, and ``Filling.used`` says
it had none). Until it confirms, the
first parameter's range is held (its gradient comes last anyway), so no round can end on a
wrong guess. A different batch size, a second backward before ``step`` (gradient accumulation),
or the round aborting meanwhile withdraws the contribution (``WithdrawnError`` fails our ring;
the round aborts and is tried again), and ``step`` adds the batch as it would have without
overlap: the parameters' gradients are left in place until ``step``. The result is bit for bit
what ``step`` computes without overlap (``batch x grad``, the same multiplication).

What the user must know: the gradients are read as backward makes them, so a change made to
them between ``backward`` and ``step`` (clipping them yourself) is one the hooks did not see:
``step`` tells by the gradients' versions (torch counts in-place changes) and adds that batch
as changed, without overlap (``Filling.changed_since``; said once); ``clip_grad_norm=``, which
clips the averaged gradient, keeps overlap. AMP's ``GradScaler`` unscales
after backward too: through ``DistributedOptimizer`` it hands ``step`` its scale instead, the
hooks divide by the last step's (``Filling.scale``; GradScaler's are powers of two, so the same
bits as unscaling first), and ``step`` confirms it, withdraws the batch where the scale changed
(it goes in unscaled, as without overlap), or skips it where the scaler found an overflow
(``ScaledStep``). The ring reads such a batch only once it has looked that each range it reads
is finite (``until``): an overflow withdraws the batch there, so the others' batches wait for
the next round, as they do without overlap, where the skipped step never reached a round.

On CUDA each hook also copies its range to the pinned host buffer the ring reads (an
asynchronous copy on the stream backward used, with an event the ring waits on).
"""

from __future__ import annotations

import asyncio
import bisect
import weakref
from typing import NamedTuple

import numpy as np
import torch

from p2ptrain.errors import WithdrawnError
from p2ptrain.trainer.flat import write_scaled

POLL_S = 0.0005  # how often the ring looks again at a CUDA copy that has not finished


class ScaledStep(NamedTuple):
    """A step under AMP's ``GradScaler`` with overlap (``DistributedOptimizer``, which the scaler
    hands its scale instead of unscaling the gradients the hooks already read): the loss scale
    the gradients carry (None: the loop unscaled them itself, ``scaler.unscale_``), and whether
    the scaler found inf or NaN in them (the batch is skipped, as GradScaler skips the step)."""

    scale: float | None
    skip: bool


def unscale(params: list[torch.Tensor], scale: float) -> None:
    """The gradients divided by the loss scale in place, as ``GradScaler.unscale_`` does (where
    the batch does not go in as the hooks wrote it: ``step`` adds it as without overlap)."""
    inverse = 1.0 / scale
    with torch.no_grad():
        for p in params:
            if p.grad is not None:
                p.grad.mul_(inverse)


class Filling:
    """One batch's gradients being written into a contribution (``collective.allreduce.Ready``).
    The hooks (backward's thread) write and ``mark``; ``step`` (the caller's) ``complete``s or
    ``withdraw``s; the ring (the cluster's loop) awaits ``until``. ``guess``: the batch size the
    hooks multiply by; ``version``: the parameters' version the batch is computed on."""

    def __init__(self, views: list[torch.Tensor], offsets: list[int], guess: int, version: int,
                 loop: asyncio.AbstractEventLoop, host: list[torch.Tensor] | None = None, ring_from: int = 0,
                 scale: float | None = None):
        self.views, self.host = views, host
        self.guess, self.version = guess, version
        self.scale = scale  # the loss scale guessed (AMP's GradScaler: the last step's), or None
        self._factor = guess if scale is None else guess / scale  # (a power of two: the same bits as unscaling first)
        self._starts = offsets  # where each parameter's range starts, in order
        self._marked = bytearray(len(views))
        self._read: list = [None] * len(views)  # (a weak reference to each gradient the hook read, its version)
        self._events: list = [None] * len(views)  # (CUDA: the copy to ``host``)
        self._loop = loop
        self._waits: list[tuple[int, int]] = []  # the parameter ranges rings await (``until``)
        self._changed = asyncio.Event()  # (the loop's; set through call_soon_threadsafe)
        self._ring_from = ring_from  # (the first parameter in the ring's first bucket)
        self.takeable = False  # the ring's first bucket is written: a round may take it
        self.taken = False  # a round holds it (``Contributor.take``)
        self.complete = False
        self.withdrawn: str | None = None  # why, once withdrawn
        self.used: np.ndarray | None = None  # which parameters had a gradient (``step`` says, before ``finish``)
        self._finite = bytearray(len(views))  # (under a loss scale: the ranges the ring looked were finite)

    def write(self, i: int, grad: torch.Tensor | None) -> bool:
        """(backward's thread) Parameter ``i``'s gradient times the guess, into its range. True:
        that made it takeable (the hook offers it to a round waiting)."""
        view = self.views[i]
        with torch.no_grad():
            write_scaled(view, grad, self._factor)  # (as ``Accumulator.add`` writes it: the same bits)
            self._read[i] = None if grad is None else (weakref.ref(grad), grad._version)
            if self.host is not None:
                self.host[i].copy_(view, non_blocking=True)
                self._events[i] = event = torch.cuda.Event()
                event.record()
        self._marked[i] = 1
        if any(0 not in self._marked[first:last] for first, last in list(self._waits)):
            self._wake()
        if not self.takeable and 0 not in self._marked[self._ring_from:]:
            self.takeable = True
            return True
        return False

    def marked(self, i: int) -> bool:
        return bool(self._marked[i])

    def changed_since(self, params: list[torch.Tensor]) -> bool:
        """(``step``) Whether the loop changed the gradients the hooks read before ``step`` (clipped
        them, or ``GradScaler.unscale_``, in place; or replaced them): torch counts a tensor's
        in-place changes (its version), so this costs nothing on the device."""
        for p, read in zip(params, self._read):
            if read is not None and (read[0]() is not p.grad or p.grad._version != read[1]):
                return True
        return False

    def unmarked(self) -> list[int]:
        return [i for i, m in enumerate(self._marked) if not m]

    def finish(self) -> None:
        """(``step``) Every range is written: the ring may read them all."""
        self.complete = self.takeable = True
        self._wake()

    def withdraw(self, why: str) -> None:
        if self.withdrawn is None and not self.complete:
            self.withdrawn = why
            self._wake()

    def _wake(self) -> None:
        if self._waits and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._changed.set)

    async def until(self, start: int, stop: int) -> None:
        """(the ring) Return once ``[start, stop)`` is written; raise ``WithdrawnError`` if withdrawn."""
        first = max(0, bisect.bisect_right(self._starts, start) - 1)
        last = bisect.bisect_left(self._starts, stop)  # (parameters first..last-1 overlap the range)
        wait = (first, last)
        self._waits.append(wait)  # (before looking: a write after the look wakes us)
        try:
            while True:
                if self.withdrawn is not None:
                    raise WithdrawnError(f"this peer withdrew its batch from the round: {self.withdrawn}")
                if self.complete or (first > 0 and 0 not in self._marked[first:last]):  # (the first: held)
                    break
                self._changed.clear()
                await self._changed.wait()
        finally:
            self._waits.remove(wait)
        for event in self._events[first:last]:  # (CUDA: the copies to host memory)
            while event is not None and not event.query():
                await asyncio.sleep(POLL_S)
        if self.scale is not None:
            self._look_finite(first, last)

    def _look_finite(self, first: int, last: int) -> None:
        """(the ring, under a loss scale) Withdraw the batch where a range it is about to read
        holds inf or NaN: GradScaler will skip this step. Without the look, a sum the others
        finish first would hold it, and the whole round would be left out on every peer,
        where without overlap the others' batches went into it."""
        values = self.views if self.host is None else self.host
        for i in range(first, last):
            if not self._finite[i]:
                if not bool(torch.isfinite(values[i]).all()):
                    self.withdraw("inf or NaN in its gradients: an overflow under GradScaler, whose step is skipped")
                    if self.withdrawn is None:  # (step confirmed it first: the ring's own checks see it)
                        return
                    raise WithdrawnError(f"this peer withdrew its batch from the round: {self.withdrawn}")
                self._finite[i] = 1


def offsets_of(params: list[torch.Tensor]) -> list[int]:
    return [int(x) for x in np.cumsum([0] + [p.numel() for p in params[:-1]])]
