"""``BackwardFeed``: overlap's hooks (``overlap`` says how overlap works). One hook per parameter
writes its gradient into the round's buffer (a ``Filling``) as backward makes it; the first hook
after a ``step`` decides whether this backward feeds a round; ``step`` confirms or withdraws it."""

from __future__ import annotations

import bisect
import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch

from p2ptrain.collective import ring
from p2ptrain.collective.ring import bucket_bounds
from p2ptrain.trainer.overlap import Filling, ScaledStep, offsets_of

if TYPE_CHECKING:
    from p2ptrain.trainer.lifetime import Lifetime
    from p2ptrain.trainer.state import TrainerState

log = logging.getLogger("p2ptrain.trainer.overlap")


class BackwardFeed:
    """The part of ``peer.AsyncPeer`` that overlaps (its ``_feed``): the hooks, and the filling
    of the backward in progress. The first hook after a step decides (``_begin``) whether this
    backward feeds a round; ``step`` ends it (``confirm``, then ``filled`` or ``withdraw``). It
    owns ``filling``, ``last_batch`` and the hooks; the rest is the trainer's state, under its
    ``lock`` (``state.TrainerState``). The hooks run on backward's thread, ``confirm``, ``filled``
    and ``withdraw`` on the caller's under ``lock``; ``Contributor.take`` reads ``filling``."""

    def __init__(self, state: TrainerState, lifetime: Lifetime, notify: Callable[[], None]):
        self.state, self.params = state, state.params
        self._lifetime, self._notify = lifetime, notify
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
        st, lifetime = self.state, self._lifetime
        if self._ring_from is None:
            return None
        with st.lock:  # (members: 0 before the cluster exists)
            if (lifetime.closed or lifetime.loop is None or st.members() <= 1 or st.solo.on or st.acc.samples
                    or st.out is not None or st.restore is not None or st.finished
                    or self.last_batch is None):  # (the first step: no guess yet)
                return None
            views, host = st.acc.begin_filling()
            self.filling = Filling(views, self._offsets, self.last_batch, st.version, lifetime.loop, host,
                                   self._ring_from, self.last_scale)
            return self.filling

    def _offer(self) -> None:
        """(backward's thread) The ring's first bucket is written: a round waiting for our batch
        may take it now (``Contributor.take``)."""
        with self.state.lock:
            notify = self.state.take_want_step()
        if notify:
            self._notify()

    def filled(self, filling: Filling, batch_size: int, scale: float | None = None) -> bool:
        """(``step``, under the state's lock) An overlapped backward ends: True if its batch went in
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
        used = np.ones(len(self.params), bool)
        for i in filling.unmarked():  # (no gradient from this backward: what add() would write)
            used[i] = self.params[i].grad is not None
            filling.write(i, self.params[i].grad)
        for p in self.params:
            p.grad = None
        if not filling.taken:
            self.state.acc.filled(batch_size, filling.version, used)
        filling.used = used  # (before ``finish``: the ring's DONE, which reads it, waits for that)
        filling.finish()
        return True

    def withdraw(self, filling: Filling, why: str) -> None:
        """(under the state's lock) Its round fails (``WithdrawnError``); never taken, the sum
        is left empty."""
        filling.withdraw(why)
        if not filling.taken:
            self.state.acc.abandon_filling()

    def confirm(self, batch_size: int, scaled: ScaledStep | None = None) -> Filling | None:
        """(``step``, under the state's ``lock``) The filling of the backward just done, if any;
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
