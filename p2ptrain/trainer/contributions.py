"""The cluster's side of ``AsyncPeer``: the ``Contributions`` it asks of the trainer (``cluster.trainer_api``).

``ContributionsSide`` is a mixin of ``p2ptrain.trainer.peer.AsyncPeer``: it has no state of its
own. It uses the peer's locks (``_lock``, ``_params_lock``), its wake-up event ``_changed``,
``cluster`` and ``_loop``, the accumulator
``_acc`` with ``_out`` (our contribution, in a round) and ``_queue`` (committed updates), the
versions (``version``, ``_committed``, ``_computing_on``, ``_params_point``), the batch in
progress (``_computing``, ``_want_step``, ``_step_end``, ``_compute_mean``), the linger timer
(``_linger``, ``_linger_due``, ``_idle_rounds``), the state loads waiting for a safe point
(``_restore``, ``_reconcile``), the counters (``dropped``, ``staleness_max``, ``_rounds_seen``,
``_compute_s``, ``_compute_n``, ``_wait_s``), its settings (``staleness``,
``target_batch_size``) and ``model``, ``optimizer``, ``scheduler``, ``params``. ``peer`` is the caller's side
(``step`` and what it applies); this module is what the cluster calls.

Call order. The cluster calls ``take`` when a round collects (our accumulator is swapped out, or
None: nothing yet, and ``step`` or the linger timer calls ``contribution_available`` later;
``alone``: the round's sum will be what we hand over, so a batch kept as backward left it
stays so, ``Accumulator``),
then ``apply`` on commit or ``put_back`` on abort;
``snapshot``, ``restore`` and ``reconcile`` for state transfer. All of these run on the
cluster's loop thread, and so does ``_wait``: what a blocked ``step`` runs there (committed
updates and state loads land meanwhile). A state handed over is loaded later, at a safe point, on the caller's
thread (``_load_restore`` and ``_load_reconcile``, ``_params_lock`` held), never under a
forward or a backward.

When this member contributes (staleness tau >= 1; ``take``; the rules are ``peer``'s
docstring): a member whose batch in progress would be staler than tau is waited for, but a
peer that stops stepping (evaluation, a checkpoint) only ``PATIENCE_*`` long; what it computed
then comes too late. A member with nothing yet waits ``LINGER_S`` for its batch, then
contributes nothing (rounds in which nobody had anything back off to one per ``LINGER_MAX_S``).
"""

from __future__ import annotations

import asyncio
import copy
import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from p2ptrain.trainer.accumulator import CommittedUpdate, RoundMetrics
from p2ptrain.cluster import snapshot
from p2ptrain.cluster.rounds import SyncPoint
from p2ptrain.errors import ClosedError, GroupError

log = logging.getLogger("p2ptrain.trainer.peer")  # (the peer's lines, under the peer's name)

LINGER_S = 0.02  # a member with nothing yet waits this long for its batch before contributing nothing
LINGER_MAX_S = 2.0  # ... doubling after each round in which no member had anything (an idle cluster:
#                    a round every 2 s, under the leader's first stall warning, half its 5 s floor)
PATIENCE_S, PATIENCE_STEPS = 2.0, 4.0  # a batch later than both (and than that many mean steps) is not waited for


def _point(sync) -> SyncPoint | None:
    """A ``state_dict``'s or snapshot's ``sync`` list as a ``SyncPoint`` (None: none)."""
    return SyncPoint(int(sync[0]), bytes(sync[1]), int(sync[2]), int(sync[3])) if sync else None


class ContributionsSide:
    """What the cluster calls on ``AsyncPeer`` (``cluster.trainer_api.Contributions``), on its loop thread.
    A mixin: the state is the peer's (see the module docstring)."""

    def take(self, members: int, alone: bool) -> tuple[np.ndarray, int] | None:
        with self._lock:
            if self._restore is not None or self._out is not None:
                return self._not_yet("a state load waits" if self._out is None else "our last one is still out")
            if self._local is not None:
                if not self._acc.samples and not self._leaving:
                    if not self._computing:  # inside step(): it says when its pseudo-gradient is ready
                        return self._not_yet("inner steps")
                    late = time.perf_counter() - self._step_end
                    patience = max(PATIENCE_S, PATIENCE_STEPS * self._pacing.compute_mean)
                    if late < patience:  # its inner steps go on: wait for them
                        self._arm_linger(patience - late)
                        return self._not_yet("inner steps")
                    # (a peer not stepping: nothing this round; its progress goes in a later one. But
                    # once a round found nothing anywhere, every member is paused: back off as idle)
                    if self._idle_rounds and not self._linger_due:
                        return self._linger_idle()
            elif self.staleness == 0:
                if not self._acc.samples:
                    return self._not_yet("no batch yet")
            else:
                late = time.perf_counter() - self._step_end
                patience = max(PATIENCE_S, PATIENCE_STEPS * self._pacing.compute_mean)
                too_late = self._committed + 1 - self._computing_on > self.staleness
                # (in lockstep at staleness 1 also a batch that would not be too late, so that each
                # round holds every member's; at 2 or more a slower member is not waited for then.
                # That includes the next batch of a member still in step() applying the last update:
                # a quicker member's batch starts the round before it computes one.)
                lockstep = self.staleness == 1 and self._pacing.lockstep()
                if late < patience and ((self._computing and (too_late or lockstep))
                                        or (lockstep and not self._acc.samples and not self._leaving)):
                    self._arm_linger(patience - late)  # the batch in progress would come too late: wait for it
                    return self._not_yet("the batch in progress" if self._computing else "the next batch")
                if self._acc.oldest is not None and self._committed - self._acc.oldest > self.staleness:
                    dropped = self._acc.void()
                    self.dropped += dropped
                    log.info("dropped %d samples staler than %d updates", dropped, self.staleness)
                # (a member not waited for any more, still computing, gives nothing at once, so that
                # the others' rounds go on; but once a round found nothing anywhere, it backs off too:
                # every member paused, rounds went on at once, hundreds a second)
                if not self._acc.samples and not self._linger_due and (late < patience or not self._computing
                                                                       or self._idle_rounds):
                    return self._linger_idle()
            self._linger_due = False
            out = self._out = self._acc.swap(members)
        self._acc.to_host(out, alone)  # (that buffer is no longer step()'s)
        self._changed.set()
        return out.array, out.samples

    async def _wait(self, blocked: Callable[[], Any], timeout: float, flushing: bool = False) -> None:
        """On the cluster's loop, while the caller waits in step: wake on every change until
        ``blocked()`` is false. A pending state load lands here too."""
        loop = asyncio.get_running_loop()
        began, deadline = time.perf_counter(), loop.time() + timeout
        try:
            while True:
                self.cluster.check()
                if self._closed and not flushing:
                    raise ClosedError("this peer was closed while step() waited")
                # The caller waits in step (no forward or backward runs): a pending state
                # load lands here, and so do committed updates, so that a snapshot for a
                # joiner is never refused while this peer waits for a round to take its share.
                # Alone, the update that ends the wait is left to the caller's thread
                # (``_end_step``): measured, a peer alone then ran at 0.98-1.00 of the plain
                # loop against 0.92-0.95; with others, applying here was faster (N = 2).
                if self.members <= 1:
                    with self._lock:
                        if not blocked():
                            return
                if (self._restore is not None or self._queue) and self._params_lock.acquire(blocking=False):
                    try:
                        self._load_restore()
                        self._applied_waiting += self._apply_queue()
                    finally:
                        self._params_lock.release()
                with self._lock:
                    if not blocked():
                        return
                self._changed.clear()
                left = deadline - loop.time()
                if left <= 0:
                    raise GroupError(f"no round took or applied this peer's batch within {timeout:.0f} s "
                                     f"({self.cluster.machine.table.can_train(self.min_peers)[1]}; linked: "
                                     f"{', '.join(self.cluster.mesh.peers) or 'nobody'}): check that the other "
                                     "peers run, with the same --cluster and --secret")
                try:  # (woken by every change; at least twice a second, for the cluster's failures)
                    await asyncio.wait_for(self._changed.wait(), min(left, 0.5))
                except asyncio.TimeoutError:
                    pass
        finally:
            with self._lock:
                self._wait_s += time.perf_counter() - began

    def _not_yet(self, why: str) -> None:  # (under _lock) the round waits for us: step() must call contribution_available
        log.debug("no contribution yet: %s (%s, computing %s)", why, self._pacing, self._computing)
        self._want_step = True

    def _linger_idle(self) -> None:  # (under _lock) nothing here yet: wait a while, longer after idle rounds
        self._arm_linger(min(LINGER_MAX_S, LINGER_S * 2 ** min(self._idle_rounds, 16)))
        return self._not_yet("lingering for a batch")

    def _arm_linger(self, wait: float) -> None:  # (under _lock) take() is asked again by then
        when = self._loop.time() + wait
        if self._linger is not None and self._linger.when() <= when:
            return
        if self._linger is not None:
            self._linger.cancel()
        self._linger = self._loop.call_at(when, self._lingered)

    def _lingered(self) -> None:
        with self._lock:
            self._linger = None
            self._linger_due = self._want_step  # (a round still waits for us)
        if self._linger_due:
            self.cluster.contribution_available()

    def apply(self, summed: np.ndarray, total_samples: int) -> None:
        point, now = self.cluster.machine.sync_point(), time.perf_counter()
        compare = len(self.cluster.machine.table.live_synced()) > 1
        with self._lock:
            out, self._out = self._out, None
            ours = out if out is not None and total_samples and (
                summed is out.array or np.may_share_memory(summed, out.array)) else None
            if out is not None and ours is None:
                self._acc.release(out)
            took = self.cluster.ring_seconds(point.round)  # (ring start to commit: a moving mean)
            if took is not None and total_samples:
                self._pacing.ring_took(took)
            self._linger_due = False
            self._rounds_seen += 1
            if total_samples == 0:  # nobody had anything: nothing to apply (nor a version: ``History``)
                self._idle_rounds += 1
                if self._queue:  # (parameters do not change: nothing to compare)
                    self._queue.append(CommittedUpdate(None, 0, point, None))
                else:
                    self._params_point = point
            else:
                self._idle_rounds = 0
                stale = self._committed - out.oldest if out is not None and out.oldest is not None else 0
                self.staleness_max = max(self.staleness_max, stale)
                self._committed += 1
                m = self._metrics(point.round, self._committed, out.members if out else 0, total_samples,
                                  out.samples if out else 0, stale, now - out.taken_at if out else 0.0)
                self._queue.append(CommittedUpdate(summed, total_samples, point, m, ours, compare))
        self._changed.set()

    def _metrics(self, r: int, version: int, members: int, samples: int, local_samples: int, staleness: int,
                 round_time: float) -> RoundMetrics:
        """(under _lock) An update's metrics, with the compute and wait seconds since the last
        update (read and reset here)."""
        m = RoundMetrics(round=r, version=version, members=members, samples=samples, local_samples=local_samples,
                         staleness=staleness, staleness_max=self.staleness_max, dropped=self.dropped, wire_bytes=0,
                         raw_bytes=0, round_time=round_time, compute_time=self._compute_s / max(self._compute_n, 1),
                         wait_time=self._wait_s)
        self._compute_s = self._wait_s = 0.0
        self._compute_n = 0
        return m

    def put_back(self, contribution: np.ndarray, samples: int) -> None:
        with self._lock:
            out = self._out
            if out is None or contribution is not out.array:  # from before a state load: void (counted then)
                return
            self._out = None
            self._acc.merge(out)
        self._changed.set()

    def finish(self) -> None:
        """The cluster's run is over: ``step`` waits for no round any more, and ``finished`` is
        true once what is queued is applied."""
        with self._lock:
            self._finished = True
        self._changed.set()

    # -- alone: batches applied in step() at once (``cluster.trainer_api.SoloTrainer``) ----------------------
    def solo_begin(self, r: int, version: int, last_version: int) -> bool:
        """From now on ``step`` applies each batch at once (their rounds numbered from ``r``), if
        nothing is in flight here (committed updates queued are applied first) and an update is
        one batch: gradient mode, no prediction, and at staleness >= 1 no ``target_batch_size``
        (a peer alone's share is then one batch)."""
        with self._lock:
            if (self._local is not None or self._predictor is not None or self._leaving or self._closed
                    or self._finished or self._out is not None or self._acc.samples
                    or self._restore is not None or self._reconcile is not None or self._solo.listed
                    or version != self._committed or (last_version and version >= last_version)
                    or (self.staleness and self.target_batch_size is not None)):
                return False
            self._solo.begin(r, last_version)
            self._want_step = self._linger_due = False  # (no round waits for our batch now)
            if self._linger is not None:
                self._linger.cancel()
                self._linger = None
            return True

    def solo_take(self) -> list[tuple[int, int, float]]:
        with self._lock:
            return self._solo.take()

    def solo_end(self) -> list[tuple[int, int, float]]:
        with self._params_lock:  # (waits for a batch being applied alone: it is listed after)
            with self._lock:
                self._solo.stop()
        return self.solo_take()

    def solo_committed(self, point: SyncPoint, rounds: int) -> None:
        with self._lock:
            self._params_point = point
            self._rounds_seen += rounds
            self._idle_rounds = 0
        self._changed.set()

    def snapshot(self, parameters_only: bool = False) -> dict | None:
        """The state as of the last applied update, copied (the caller's thread may go on
        training); None while updates are queued or being applied (ask again soon). With
        ``parameters_only`` (a member correcting its drift): the trainable parameters alone."""
        if not self._params_lock.acquire(blocking=False):
            return None
        try:
            with self._lock:
                if self._queue or self._restore is not None or self._solo.listed:
                    return None
                version, p = self.version, self.cluster.machine.sync_point()
            if parameters_only:
                names = {name for name, q in self.model.named_parameters() if q.requires_grad}
                return {"model": {k: v.detach().clone() for k, v in self._true_state_dict().items() if k in names},
                        "sync": [p.version, p.digest, p.round, p.epoch]}
            return {"model": {k: v.detach().clone() for k, v in self._true_state_dict().items()},
                    "optimizer": copy.deepcopy(self.optimizer.state_dict()), "version": version,
                    "scheduler": self._scheduler_snapshot(), "sync": [p.version, p.digest, p.round, p.epoch],
                    **{k: copy.deepcopy(v) for k, v in self._outer_state().items()}}
        finally:
            self._params_lock.release()

    def restore(self, state: dict) -> None:
        """A member's snapshot: void what was accumulated here; load it at the next safe point."""
        with self._lock:
            dropped = self._acc.void()
            if self._out is not None:  # the cluster forgets that round: its buffer is not reused
                dropped, self._out = dropped + self._out.samples, None
            self.dropped += dropped
            self._queue.clear()
            self._restore, self._reconcile = state, None
            self._solo.stop()  # (the cluster ended solo before; a caller of ours may not have)
        if dropped:
            log.info("loading the cluster's state: %d samples accumulated here are void", dropped)
        self._changed.set()

    def reconcile(self, state: dict, point: SyncPoint) -> None:
        """The leader's parameters at ``point`` (ours drifted past the tolerance): loaded in place
        of ours once ours reach that point; what is accumulated stays, and so does our optimizer
        state (moments that differ by rounding only)."""
        with self._lock:
            self._reconcile = (state, point)
        self._changed.set()

    def _load_reconcile(self) -> None:
        """(``_params_lock`` held) Ours at the leader's point: take its parameters."""
        with self._lock:
            if self._reconcile is None or self._params_point is None:
                return
            (state, point), here = self._reconcile, self._params_point
            if here.version < point.version:
                return  # not there yet
            self._reconcile = None
        if (here.version, here.digest) != (point.version, point.digest):
            log.debug("the leader's parameters for version %d came after ours passed it", point.version)
            return
        if self._local is not None:  # the outer parameters: everything here moves by the difference
            names = dict(self.model.named_parameters())
            self._local.shift([state["model"][n] for n, _ in self._local.named_outer(self.model)
                               if names[n].requires_grad], (state.get("outer") or {}).get("momentum"))
        else:
            with torch.no_grad():
                for name, p in self.model.named_parameters():
                    if name in state["model"]:
                        p.copy_(state["model"][name])
        if self._predictor is not None:
            self._predictor.forget()
        self.corrected += 1

    def _load_state(self, state: dict) -> None:
        """(``_params_lock`` held) Parameters and optimizer state from a member's snapshot (in
        local-steps mode the outer state: the model starts over on it, with its momentum)."""
        self.model.load_state_dict(state["model"])
        if self._local is not None:
            self._local.reset((state.get("outer") or {}).get("momentum"))
        self.optimizer.load_state_dict(state["optimizer"])
        self._load_scheduler(state)
        if self._predictor is not None:
            self._predictor.forget()

    def _scheduler_snapshot(self) -> dict | None:
        """The scheduler's state for a joiner, so that it steps at the cluster's learning rate
        (a fresh scheduler on a joiner would start its schedule over); None when it has none, or
        when its state holds something a snapshot cannot carry (a callable: said once)."""
        if self.scheduler is None:
            return None
        state = copy.deepcopy(self.scheduler.state_dict())
        try:
            snapshot.pack(state)
        except (ValueError, TypeError) as exc:
            if not self._scheduler_unsent:
                self._scheduler_unsent = True
                log.warning("the scheduler's state is not sent to joiners (%s): they start its schedule over", exc)
            return None
        return state

    def _load_scheduler(self, state: dict) -> None:
        """The scheduler's state from a snapshot or a ``state_dict()``, where both sides have one."""
        if self.scheduler is not None and state.get("scheduler"):
            self.scheduler.load_state_dict(state["scheduler"])

    def _load_restore(self) -> bool:
        """Load a pending state (``_params_lock`` held; no forward or backward runs now)."""
        with self._lock:
            state, self._restore = self._restore, None
        if state is None:
            return False
        self._load_state(state)
        for p in self.params:
            p.grad = None
        with self._lock:
            self.version = self._committed = self._computing_on = int(state.get("version", 0))
            self._params_point = _point(state.get("sync"))
            self._acc.void()
            self._want_step = True
        return True
