"""Overlap (``overlap=True``, staleness 0): a batch's gradients go into its round's buffer as
backward makes them, and the round's ring starts on the first ones while backward computes the
rest, as DDP's reducer does; a step costs about max(backward, ring), not their sum.

How. A hook per parameter (``register_post_accumulate_grad_hook``) fires once backward has
accumulated that parameter's gradient. The first hook after a ``step`` decides whether this
backward feeds a round (``BackwardFeed``, the peer's ``_feed``: staleness 0, gradient mode,
others to train with, nothing else accumulated); each then writes ``batch x grad`` into the
accumulator's buffer (the batch: the last one ``step`` was given, a guess), and once the ring's
first bucket is written (the buffer's end, where backward starts) the round may take that
buffer (``Filling``, the ring's ``ready``: it reads a range of our values only once the hooks
wrote it). Not sooner: a round's messages and a ring waiting on hooks would only contend with
backward for the interpreter. For the same reason a model of one bucket (up to ``BUCKET_ELEMS``,
4 M parameters) is not overlapped at all: its ring is short, and overlapping it cost more than
it hid (measured on 2 cores, N = 2, 150 K parameters: 1.5x DDP's time against 1.3x). ``step``
then confirms: the same batch size and one backward per parameter, and it writes what no hook did
(a parameter without a gradient: zeros, as ``Accumulator.add`` would). Until it confirms, the
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
(``ScaledStep``).

On CUDA each hook also copies its range to the pinned host buffer the ring reads (an
asynchronous copy on the stream backward used, with an event the ring waits on).
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import threading
import weakref
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from p2ptrain.collective import ring
from p2ptrain.collective.ring import bucket_bounds
from p2ptrain.errors import WithdrawnError
from p2ptrain.trainer.accumulator import write_scaled

if TYPE_CHECKING:
    from p2ptrain.trainer.peer import AsyncPeer

log = logging.getLogger(__name__)
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


class BackwardFeed:
    """The part of ``peer.AsyncPeer`` that overlaps (its ``_feed``): the hooks, and the filling
    of the backward in progress. The first hook after a step decides (``_begin``) whether this
    backward feeds a round; ``step`` ends it (``confirm``, then ``filled`` or ``withdraw``). It
    owns ``filling``, ``last_batch`` and the hooks; the rest is the peer's core, under its
    ``_lock`` (``peer``'s docstring). The hooks run on backward's thread, ``confirm``, ``filled``
    and ``withdraw`` on the caller's under ``_lock``; ``Contributor.take`` reads ``filling``."""

    def __init__(self, peer: AsyncPeer):
        self.peer, self.params = peer, peer.params
        self._offsets = offsets_of(self.params)
        buckets = bucket_bounds(sum(p.numel() for p in self.params))  # (the rounds' rings: ``cluster.rings``)
        # The first parameter in the ring's first bucket; None: one bucket, never overlapped.
        self._ring_from = max(0, bisect.bisect_right(self._offsets, buckets[0][0]) - 1) if len(buckets) > 1 else None
        if self._ring_from is None:  # (asked for, and it does nothing: say so once)
            log.info("overlap: this model's %s parameters are one bucket of the ring (up to %s): its ring is short, "
                     "and backward is not overlapped with it", f"{buckets[0][1]:,}", f"{ring.BUCKET_ELEMS:,}")
        self.filling: Filling | None = None
        self.last_batch: int | None = None  # what the last ``step`` was given: the next filling's guess
        self.last_scale: float | None = None  # ... and its loss scale (``DistributedOptimizer`` under GradScaler)
        self._decided = False  # this backward's first hook has run
        self._said_changed = False  # (the warning that the loop changes gradients before step: once)
        self._lock = threading.Lock()  # (the first hooks of a backward on several device threads)
        self._handles = [p.register_post_accumulate_grad_hook(self._hook(i)) for i, p in enumerate(self.params)]

    def _hook(self, i: int):
        def hook(p: torch.Tensor) -> None:
            f = self.filling
            if f is None:
                with self._lock:
                    if self._decided:
                        f = self.filling
                    else:
                        self._decided = True
                        f = self._begin()
                if f is None:
                    return
            if f.withdrawn is not None:
                return
            if f.marked(i):
                f.withdraw("a second backward before step() (accumulated gradients go in the next round)")
                return
            if f.write(i, p.grad):
                self._offer()
        return hook

    def _begin(self) -> Filling | None:
        """(backward's first hook after a step) Whether this backward's gradients go into a
        round's buffer as they come: at staleness 0, in gradient mode, with others to train
        with, nothing else accumulated or out, no state load waiting, and a model of more than
        one of the ring's buckets (the module docstring)."""
        peer = self.peer
        if self._ring_from is None:
            return None
        with peer._lock:
            if (peer._lifetime.closed or peer.cluster is None or peer._solo.on or peer.members <= 1
                    or peer._acc.samples or peer._out is not None or peer._restore is not None or peer._finished
                    or peer._lifetime.loop is None or self.last_batch is None):  # (the first step: no guess yet)
                return None
            views, host = peer._acc.begin_filling()
            self.filling = Filling(views, self._offsets, self.last_batch, peer.version, peer._lifetime.loop, host,
                                   self._ring_from, self.last_scale)
            return self.filling

    def _offer(self) -> None:
        """(backward's thread) The ring's first bucket is written: a round waiting for our batch
        may take it now (``Contributor.take``)."""
        peer = self.peer
        with peer._lock:
            notify, peer._want_step = peer._want_step, False
        if notify:
            peer._notify()

    def filled(self, filling: Filling, batch_size: int, scale: float | None = None) -> bool:
        """(``step``, under the peer's _lock) An overlapped backward ends: True if its batch went in
        whole; False: withdrawn (``step`` adds it as without overlap). ``scale``: the loss scale
        its gradients carry (GradScaler's), which the hooks guessed."""
        if batch_size != filling.guess:
            self.withdraw(filling, f"a batch of {batch_size} samples after one of {filling.guess}")
        elif scale != filling.scale:
            self.withdraw(filling, f"the loss scale is {scale} after {filling.scale} (GradScaler)")
        elif filling.withdrawn is None and scale is None and filling.changed_since(self.params):
            # (under GradScaler, its inf check runs over the gradients in place, multiplying by 1: not a change)
            self.withdraw(filling, "the loop changed the gradients between backward and step()")
            if not self._said_changed:
                self._said_changed = True
                log.warning("overlap reads the gradients as backward makes them, and this loop changed them before "
                            "step() (clipped them, or GradScaler.unscale_): such a step goes in without overlap, "
                            "as changed; to keep overlap, use clip_grad_norm= (and, for AMP's GradScaler, "
                            "p2ptrain.DistributedOptimizer, which needs no unscale_)")
        if filling.withdrawn is not None:
            return False
        for i in filling.unmarked():  # (no gradient from this backward: what add() would write)
            filling.write(i, self.params[i].grad)
        for p in self.params:
            p.grad = None
        if not filling.taken:
            self.peer._acc.filled(batch_size, filling.version)
        filling.finish()
        return True

    def withdraw(self, filling: Filling, why: str) -> None:
        """(under the peer's _lock) Its round fails (``WithdrawnError``); never taken, the sum
        is left empty."""
        filling.withdraw(why)
        if not filling.taken:
            self.peer._acc.abandon_filling()

    def confirm(self, batch_size: int, scaled: ScaledStep | None = None) -> Filling | None:
        """(``step``, under the peer's ``_lock``) The filling of the backward just done, if any;
        the next backward decides again, and guesses ``batch_size`` and the loss scale. Where
        the loop unscaled the gradients itself (``scaler.unscale_``, to clip them), the hooks
        cannot know the scale to divide by: the next backward is not overlapped."""
        with self._lock:
            f, self.filling, self._decided = self.filling, None, False
        guessable = scaled is None or scaled.scale is not None
        self.last_batch, self.last_scale = (batch_size if guessable else None), (scaled and scaled.scale)
        return f

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()


def offsets_of(params: list[torch.Tensor]) -> list[int]:
    return [int(x) for x in np.cumsum([0] + [p.numel() for p in params[:-1]])]
