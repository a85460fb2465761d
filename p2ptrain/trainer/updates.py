"""Committed updates reach the model here: ``UpdatesSide``, a mixin of ``peer.AsyncPeer`` (as
``contributions.ContributionsSide`` is), for the caller's thread.

``_apply_queue`` applies the updates the cluster committed (``contributions.apply`` queued
them), in round order, at a safe point (inside ``step``, or while ``step`` waits;
``_params_lock`` held): the averaged gradient goes through ``apply.apply_update`` (``p.grad``
set to views of the ring's sum divided by the samples, clipped, the optimizer and scheduler
step), the ring's buffer goes back to the cluster (``recycle``), the version moves on, and
every ``reconcile_every`` updates a parameter sketch goes to the leader (``cluster.drift``).
A peer alone applies its batch at once instead (``_apply_alone``; the cluster commits its round
after: ``solo``). ``state_dict``/``load_state_dict`` give and load the state as of the last
applied update (checkpoints). The state used is the peer's: ``_queue``, ``_lock``, ``version``,
``_params_point``, ``_acc``, ``_mean``, ``_predictor``, ``_local``, ``_solo``, ``cluster``,
``metrics``, ``history``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import replace

from p2ptrain.cluster.drift import sketch_checksum, start_sketch
from p2ptrain.cluster.fingerprint import param_checksum
from p2ptrain.cluster.snapshot import tensors_checksum
from p2ptrain.errors import ConfigError, GroupError
from p2ptrain.trainer.accumulator import CommittedUpdate, RoundMetrics
from p2ptrain.trainer.apply import apply_gradients, apply_update
from p2ptrain.trainer.contributions import _point

log = logging.getLogger("p2ptrain.trainer.peer")  # (the peer's lines, under the peer's name)

SOLO_COMMIT_S = 10.0  # how long a checkpoint waits for the cluster to commit what a peer alone applied


class UpdatesSide:
    """Applying committed updates, and the state they give (see the module docstring). A mixin:
    the state is the peer's."""

    def _apply_queue(self) -> int:
        """Apply the committed updates in order (caller's thread, ``_params_lock`` held)."""
        if not (self._queue or self._reconcile is not None or self._sketching is not None
                or self._predictor is not None or self._finished):
            return 0  # (nothing to do: most steps of a peer alone)
        applied = 0
        while True:
            self._load_reconcile()
            with self._lock:
                update = self._queue.popleft() if self._queue else None
            if update is None:
                # (read once the device copied it, a CPU's at once; leaving or at the end, now)
                self._deliver_sketch(wait=self._leaving or self._finished)
                if self._predictor is not None:
                    self._predictor.predict()
                self._say_finished()
                return applied
            self._deliver_sketch(wait=True)  # (the last one's, read before the next update: copied by now)
            if update.summed is not None:
                if self._predictor is not None:
                    self._predictor.before_update()
                self._apply_update(update)
                if update.ours is None:  # (the ring's result, ours now: its memory serves a later ring)
                    self.cluster.recycle(update.summed)
                applied += 1
            with self._lock:
                self._params_point = update.point
                self.version += update.summed is not None
                if update.ours is not None:  # (a peer alone: the ring's result was our own buffer)
                    self._acc.release(update.ours)
            metrics = update.metrics
            if update.compare and self.reconcile_every and update.point.version % self.reconcile_every == 0:
                # (the outer parameters in local-steps mode: the model holds this peer's local ones)
                read = start_sketch(self._local.outer if self._local is not None else self.params)
                self._sketching, metrics = (update.point, metrics, read), None  # (published with it)
                self._deliver_sketch(wait=False)
            if metrics is not None:
                self._publish(metrics)

    def _deliver_sketch(self, wait: bool) -> None:
        """The parameter sketch started at an update (``drift.start_sketch``) goes to the
        cluster, and that update's metrics (with its checksum) are published, once its numbers
        are on the host: on CUDA the device copies them while the caller computes, and they are
        read at the next update at the latest (``wait``), in order; on a CPU at once."""
        pending = self._sketching
        if pending is None or not (wait or pending[2].ready()):
            return
        self._sketching = None
        point, metrics, read = pending
        sketch = read.result()
        self._loop.call_soon_threadsafe(self.cluster.parameters_at, point, sketch)
        if metrics is not None:
            self._publish(replace(metrics, param_checksum=sketch_checksum(sketch)))

    def _say_finished(self) -> None:
        """Once the cluster's run is over and its last update is applied here (``_params_lock``
        held): one line naming the round, the version (the chain's digest too) and a digest of
        the parameters, so that replicas that end apart can be told apart from their logs."""
        with self._lock:
            if not self._finished or self._queue or self._restore is not None or self._said_end:
                return
            self._said_end, point = True, self._params_point
        end = self.cluster.finished
        log.info("finished at the cluster's round %s, version %s: this peer holds version %d (chain %s), "
                 "parameters %s", end and end.r, end and end.version, self.version,
                 point.digest.hex()[:16] if point else "-", self._parameters_digest())

    def _parameters_digest(self) -> str:
        """The replicas' common parameters, hashed (``join``'s summary checksum in gradient mode):
        the true ones where the model holds predicted ones, the outer ones in local-steps mode."""
        if self._local is None and self._predictor is None:
            return param_checksum(self.model)
        state = self._true_state_dict()
        return tensors_checksum((name, state[name]) for name, _ in self.model.named_parameters())

    def _apply_alone(self, batch_size: int) -> bool:
        """Alone (``_params_lock`` held): this batch's gradients are the update, applied now as
        the plain loop would; the cluster commits its round later (``contributions.solo_*``).
        True: that was the run's last version, the cluster must hear of it now."""
        grads = [p.grad for p in self.params]  # (dense, as a round's mean would be)
        apply_gradients([g.to_dense() if g is not None and g.is_sparse else g for g in grads], self.params,
                        self.optimizer, self.scheduler, self.clip_grad_norm)
        with self._lock:
            self.version += 1
            self._committed += 1
            self._applied_waiting += 1
            r, last = self._solo.applied(batch_size, self.version, time.time())
            m = self._metrics(r, self.version, 1, batch_size, batch_size, 0, 0.0)
        self.metrics = m  # (as ``_publish``, with no cluster record to complete it: no ring ran)
        self.history.append(m)
        self._progress.applied(m, self.staleness_max, self.dropped)
        return last

    def _apply_update(self, update: CommittedUpdate) -> None:
        if self._local is not None:
            return self._local.apply(self._mean.of(update)[0])
        if update.ours is not None and update.ours.grads is not None:  # alone: our batch as backward left it
            return apply_gradients(update.ours.grads, self.params, self.optimizer, self.scheduler,
                                   self.clip_grad_norm)
        apply_update(update, self._mean, self.optimizer, self.scheduler, self.clip_grad_norm)

    def _publish(self, m: RoundMetrics) -> None:
        m = self._progress.completed(m, self.cluster)
        self.metrics = m
        self.history.append(m)
        self._progress.applied(m, self.staleness_max, self.dropped)

    # -- checkpoints ----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Everything a resumed loop needs: model, optimizer, ``scheduler`` (None without one),
        version, and the cluster's point at the last applied update. Save it as you save
        anything (``torch.save``). Call it between steps."""
        self._commit_solo()
        with self._params_lock, self._lock:
            p = self._params_point
            return {"model": self._true_state_dict(), "optimizer": self.optimizer.state_dict(),
                    "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
                    "version": self.version, "sync": p and [p.version, p.digest, p.round, p.epoch],
                    **self._outer_state()}

    def _commit_solo(self) -> None:
        """Alone, the rounds of the batches applied at once are committed now (a checkpoint's
        point must be its version's)."""
        with self._lock:
            listed = bool(self._solo.listed)
        if not listed or self._closed or threading.current_thread() is self._thread.thread:
            return  # (closed: committed on leaving; on the cluster's thread, in step: none listed)
        self.cluster.check()
        try:
            self._thread.call(asyncio.wait_for(self.cluster.commit_solo(), SOLO_COMMIT_S))
        except asyncio.TimeoutError:
            raise GroupError(f"the cluster did not commit this peer's last updates within {SOLO_COMMIT_S:.0f} s: "
                             "take the checkpoint again") from None

    def _outer_state(self) -> dict:
        """Local-steps mode: the outer momentum, for a checkpoint or a joiner ({} otherwise)."""
        return {} if self._local is None else {"outer": {"momentum": self._local.velocity_state()}}

    def _true_state_dict(self) -> dict:
        """``model.state_dict()``, with the true parameters where the model holds predicted ones,
        and the outer ones in local-steps mode (the model holds this peer's local ones)."""
        if self._local is not None:
            return self._local.state_dict(self.model)
        return self.model.state_dict() if self._predictor is None else self._predictor.true_state_dict(self.model)

    def load_state_dict(self, state: dict) -> None:
        """Load a ``state_dict()`` before entering: the peer continues that lineage, so peers
        restarted from the same checkpoint form one cluster again, and the ``scheduler`` (if
        both the state and this peer have one) continues at the saved update's learning rate."""
        if self._thread is not None:
            raise ConfigError("load_state_dict must come before entering the peer (before `with peer:`)")
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self._load_scheduler(state)
        if self._local is not None:
            self._local.reset((state.get("outer") or {}).get("momentum"))
        self.version = self._committed = self._computing_on = int(state.get("version", 0))
        self._start = _point(state.get("sync"))
