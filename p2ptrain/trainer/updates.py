"""Committed updates and handed-over states reach the model here: ``Updater``, the part of
``peer.AsyncPeer`` that changes the parameters (the peer holds it as ``_updater``).

``apply_queue`` applies the updates the cluster committed (``contributions.Contributor.apply``
queued them), in round order, at a safe point: the averaged gradient goes through
``apply.apply_update`` (``p.grad`` set to views of the ring's sum divided by the samples,
clipped, the optimizer and scheduler step), the ring's buffer goes back to the cluster
(``recycle``), the version moves on, and every ``reconcile_every`` updates a parameter sketch
goes to the leader (``cluster.drift``). A peer alone applies its batch at once instead
(``apply_alone``; the cluster commits its round after: ``solo``). A state the cluster handed
over (``Contributor.restore``, ``reconcile``) is loaded here too (``load_restore``, and the
leader's parameters inside ``apply_queue`` once ours reach its point). ``state_dict`` and
``load_state_dict`` give and load the state as of the last applied update (checkpoints).

Who owns what. ``Updater`` owns what only applying touches, set in its ``__init__``: the mean's
buffers (``_mean``), a sketch the device still copies (``_sketching``), ``_said_end``, the
progress log, and what it publishes: ``metrics``, ``history`` and ``corrected`` (the peer shows
them as read-only properties). The state it shares with the cluster's side (the queue, the
versions, the state loads waiting, the accumulator, ``_solo``) is the peer's core, reached
through ``self.peer`` and guarded by the peer's ``_lock`` (``peer``'s docstring).

Threads and locks. Whatever changes the parameters runs with the peer's ``_params_lock`` held,
never under a forward or a backward: on the caller's thread inside ``step``, or on the
cluster's thread while ``step`` waits there or the peer leaves (``Contributor.wait``,
``flush``: the caller is blocked then); ``load_state_dict`` only before entering (one thread
then, no lock). ``_lock`` is taken inside it (``_params_lock`` first, always), briefly, for the
shared core. ``true_state_dict`` and ``outer_state`` only read (a snapshot calls them on the
cluster's thread, ``_params_lock`` held).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from p2ptrain.cluster.drift import sketch_checksum, sketch_finite, start_sketch
from p2ptrain.cluster.fingerprint import param_checksum
from p2ptrain.cluster.rounds import SyncPoint
from p2ptrain.cluster.snapshot import tensors_checksum
from p2ptrain.errors import ConfigError, GroupError
from p2ptrain.trainer.accumulator import CommittedUpdate, RoundMetrics
from p2ptrain.trainer.apply import AveragedGradient, apply_gradients, apply_update
from p2ptrain.trainer.progress import ProgressLog

if TYPE_CHECKING:
    from p2ptrain.trainer.peer import AsyncPeer

log = logging.getLogger("p2ptrain.trainer.peer")  # (the peer's lines, under the peer's name)

SOLO_COMMIT_S = 10.0  # how long a checkpoint waits for the cluster to commit what a peer alone applied
HISTORY = 1000  # updates kept in ``history``


# What ``torch.compile``'s wrapper adds to every name of a model's ``state_dict()``.
COMPILED_PREFIX = "_orig_mod."


def _point(sync) -> SyncPoint | None:
    """A ``state_dict``'s or snapshot's ``sync`` list as a ``SyncPoint`` (None: none). A
    ``state_dict`` holds the digest as hex: ``torch.save`` pickles bytes through a global that
    torch before 2.5 refuses to load with ``weights_only`` (a Mac's older torch could not
    resume a checkpoint the CUDA desktop wrote); a snapshot, and a state saved before, as bytes."""
    if not sync:
        return None
    digest = bytes.fromhex(sync[1]) if isinstance(sync[1], str) else bytes(sync[1])
    return SyncPoint(int(sync[0]), digest, int(sync[2]), int(sync[3]))


def _checked_state(model: torch.nn.Module, optimizer, state) -> tuple[int, SyncPoint | None]:
    """``load_state_dict``'s argument checked before anything is loaded, so that a wrong one
    changes nothing (torch's own loads copy what fits and then raise): its version and point."""
    def bad(what: str) -> ConfigError:
        return ConfigError(f"load_state_dict: {what}: pass what state_dict() returned on a peer of this model")

    if not isinstance(state, dict) or not all(isinstance(state.get(k), dict) for k in ("model", "optimizer")):
        raise bad(f"got a {type(state).__name__} without 'model' and 'optimizer' dicts")
    mine, theirs = model.state_dict(), state["model"]
    name = next((k for k in mine if k not in theirs), None) or next((k for k in theirs if k not in mine), None)
    if name is not None:
        raise bad(f"{name!r} is in {'this model only' if name in mine else 'the state only'}")
    for name, t in mine.items():
        if not isinstance(theirs[name], torch.Tensor) or theirs[name].shape != t.shape:
            raise bad(f"{name!r} is {getattr(theirs[name], 'shape', type(theirs[name]).__name__)} in the state "
                      f"and {t.shape} here")
    groups = state["optimizer"].get("param_groups")
    if not isinstance(groups, list) or [len(g.get("params", ())) if isinstance(g, dict) else -1 for g in groups] \
            != [len(g["params"]) for g in optimizer.param_groups]:
        raise bad("its optimizer holds other parameter groups than this peer's")
    if not isinstance(state.get("scheduler") or {}, dict):
        raise bad("its 'scheduler' is not a scheduler's state_dict()")
    version = state.get("version", 0)
    if type(version) is not int or version < 0:
        raise bad(f"its version {version!r} is not an int >= 0")
    try:
        return version, _point(state.get("sync"))
    except (TypeError, ValueError, IndexError):
        raise bad("its 'sync' entry is malformed") from None


class Updater:
    """Applying committed updates and loading states, and what they give (see the module
    docstring). Its methods without an underscore are what the peer and ``Contributor`` call."""

    def __init__(self, peer: AsyncPeer):
        self.peer = peer  # the shared core: settings, locks, queue, versions, accumulator
        self._mean = AveragedGradient(peer.params, peer.device)  # (used under _params_lock)
        self._sketching = None  # (point, metrics, drift.SketchRead): a sketch the device still copies
        self._said_end = False  # the line naming where this peer finished was logged (``_say_finished``)
        self._progress = ProgressLog()
        self.metrics: RoundMetrics | None = None  # the last update applied here
        self.history: collections.deque[RoundMetrics] = collections.deque(maxlen=HISTORY)
        self.corrected = 0  # the leader's parameters loaded here because ours drifted past the tolerance

    def apply_queue(self) -> int:
        """Apply the committed updates in order (``_params_lock`` held). Returns how many."""
        peer = self.peer
        if not (peer._queue or peer._reconcile is not None or self._sketching is not None
                or peer._predictor is not None or peer._finished):
            return 0  # (nothing to do: most steps of a peer alone)
        applied = 0
        predictor = peer._predictor
        if predictor is not None:
            with peer._lock:  # (in lockstep no gradient is late: nothing to predict, staleness 0's rounds)
                predicting = not peer._lockstep()
        while True:
            self._load_reconcile()
            with peer._lock:
                update = peer._queue.popleft() if peer._queue else None
            if update is None:
                # (read once the device copied it, a CPU's at once; leaving or at the end, now)
                self._deliver_sketch(wait=peer._leaving or peer._finished)
                if predictor is not None:
                    predictor.predict() if predicting else predictor.pause()
                self._say_finished()
                return applied
            self._deliver_sketch(wait=True)  # (the last one's, read before the next update: copied by now)
            if update.summed is not None:
                if predictor is not None:
                    predictor.before_update() if predicting else predictor.pause()
                self._apply_update(update)
                if update.ours is None:  # (the ring's result, ours now: its memory serves a later ring)
                    peer.cluster.recycle(update.summed)
                applied += 1
            with peer._lock:
                peer._params_point = update.point
                peer.version += update.summed is not None
                if update.ours is not None:  # (a peer alone: the ring's result was our own buffer)
                    peer._acc.release(update.ours)
            metrics = update.metrics
            if update.compare and peer.reconcile_every and update.point.version % peer.reconcile_every == 0:
                # (the outer parameters in local-steps mode: the model holds this peer's local ones)
                read = start_sketch(peer._local.outer if peer._local is not None else peer.params)
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
        peer = self.peer
        if not sketch_finite(sketch):  # (a codec that carries NaN, ``none``, averages it into every replica)
            peer._contributor.look()
        peer._lifetime.loop.call_soon_threadsafe(peer.cluster.parameters_at, point, sketch)
        if metrics is not None:
            self._publish(replace(metrics, param_checksum=sketch_checksum(sketch)))

    def _say_finished(self) -> None:
        """Once the cluster's run is over and its last update is applied here (``_params_lock``
        held): one line naming the round, the version (the chain's digest too) and a digest of
        the parameters, so that replicas that end apart can be told apart from their logs."""
        peer = self.peer
        with peer._lock:
            if not peer._finished or peer._queue or peer._restore is not None or self._said_end:
                return
            self._said_end, point = True, peer._params_point
        end = peer.cluster.finished
        log.info("finished at the cluster's round %s, version %s: this peer holds version %d (chain %s), "
                 "parameters %s", end and end.r, end and end.version, peer.version,
                 point.digest.hex()[:16] if point else "-", self.parameters_checksum())

    def parameters_checksum(self) -> str:
        """The replicas' common parameters, hashed (``AsyncPeer.param_checksum``): the true ones
        where the model holds predicted ones, the outer ones in local-steps mode."""
        peer = self.peer
        if peer._local is None and peer._predictor is None:
            return param_checksum(peer.module)
        state = self.true_state_dict()
        return tensors_checksum((name, state[name]) for name, _ in peer.module.named_parameters())

    def apply_alone(self, batch_size: int) -> bool:
        """Alone (``_params_lock`` held): this batch's gradients are the update, applied now as
        the plain loop would; the cluster commits its round later (``Contributor.solo_*``).
        True: that was the run's last version, the cluster must hear of it now."""
        peer = self.peer
        grads = [p.grad for p in peer.params]  # (dense, as a round's mean would be)
        apply_gradients([g.to_dense() if g is not None and g.is_sparse else g for g in grads], peer.params,
                        peer.optimizer, peer.scheduler, peer.clip_grad_norm)
        with peer._lock:
            peer.version += 1
            peer._committed += 1
            peer._applied_waiting += 1
            r, last = peer._solo.applied(batch_size, peer.version, time.time())
            m = peer._metrics(r, peer.version, 1, batch_size, batch_size, 0, 0.0)
        self.metrics = m  # (as ``_publish``, with no cluster record to complete it: no ring ran)
        self.history.append(m)
        self._progress.applied(m, peer.staleness_max, peer.dropped)
        return last

    def _apply_update(self, update: CommittedUpdate) -> None:
        peer = self.peer
        if peer._local is not None:
            return peer._local.apply(self._mean.of(update)[0])
        if update.ours is not None and update.ours.grads is not None:  # alone: our batch as backward left it
            return apply_gradients(update.ours.grads, peer.params, peer.optimizer, peer.scheduler,
                                   peer.clip_grad_norm)
        apply_update(update, self._mean, peer.optimizer, peer.scheduler, peer.clip_grad_norm)

    def _publish(self, m: RoundMetrics) -> None:
        peer = self.peer
        m = self._progress.completed(m, peer.cluster)
        self.metrics = m
        self.history.append(m)
        self._progress.applied(m, peer.staleness_max, peer.dropped)

    # -- states handed over by the cluster (``Contributor.restore``, ``reconcile``) -------------
    def load_restore(self) -> bool:
        """Load a pending state (``_params_lock`` held; no forward or backward runs now).
        True: one was loaded (what was computed before it is void)."""
        peer = self.peer
        with peer._lock:
            state, peer._restore = peer._restore, None
        if state is None:
            return False
        stepped = peer._local.samples if peer._local is not None else 0  # (inner steps the load starts over)
        self._load_state(state)
        for p in peer.params:
            p.grad = None
        with peer._lock:
            peer.version = peer._committed = peer._computing_on = int(state.get("version", 0))
            peer._params_point = _point(state.get("sync"))
            void = peer._acc.void() + stepped  # (batches added since ``Contributor.restore`` voided the rest)
            peer.dropped += void
            peer._want_step = True
        if void:
            log.info("loading the cluster's state: %d samples computed here since are void", void)
        return True

    def _load_reconcile(self) -> None:
        """(``_params_lock`` held) Ours at the leader's point: take its parameters."""
        peer = self.peer
        with peer._lock:
            if peer._reconcile is None or peer._params_point is None:
                return
            (state, point), here = peer._reconcile, peer._params_point
            if here.version < point.version:
                return  # not there yet
            peer._reconcile = None
        if (here.version, here.digest) != (point.version, point.digest):
            log.debug("the leader's parameters for version %d came after ours passed it", point.version)
            return
        if peer._local is not None:  # the outer parameters: everything here moves by the difference
            names = dict(peer.module.named_parameters())
            peer._local.shift([state["model"][n] for n, _ in peer._local.named_outer(peer.module)
                               if names[n].requires_grad], (state.get("outer") or {}).get("momentum"))
        else:
            with torch.no_grad():
                for name, p in peer.module.named_parameters():
                    if name in state["model"]:
                        p.copy_(state["model"][name])
        if peer._predictor is not None:
            peer._predictor.forget()
        self.corrected += 1

    def _load_state(self, state: dict) -> None:
        """(``_params_lock`` held) Parameters and optimizer state from a member's snapshot (in
        local-steps mode the outer state: the model starts over on it, with its momentum)."""
        peer = self.peer
        peer.module.load_state_dict(state["model"])
        if peer._local is not None:
            peer._local.reset((state.get("outer") or {}).get("momentum"))
        peer.optimizer.load_state_dict(state["optimizer"])
        self._load_scheduler(state)
        if peer._predictor is not None:
            peer._predictor.forget()

    def _load_scheduler(self, state: dict) -> None:
        """The scheduler's state from a snapshot or a ``state_dict()``, where both sides have one."""
        if self.peer.scheduler is not None and state.get("scheduler"):
            self.peer.scheduler.load_state_dict(state["scheduler"])

    # -- checkpoints ----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """``AsyncPeer.state_dict``: the state as of the last applied update."""
        peer = self.peer
        self._commit_solo()
        with peer._params_lock, peer._lock:
            p = peer._params_point
            return {"model": self.true_state_dict(), "optimizer": peer.optimizer.state_dict(),
                    "scheduler": peer.scheduler.state_dict() if peer.scheduler is not None else None,
                    "version": peer.version, "sync": p and [p.version, p.digest.hex(), p.round, p.epoch],
                    **self.outer_state()}

    def _commit_solo(self) -> None:
        """Alone, the rounds of the batches applied at once are committed now (a checkpoint's
        point must be its version's)."""
        peer = self.peer
        with peer._lock:
            listed = bool(peer._solo.listed)
        if not listed or peer._lifetime.closed or threading.current_thread() is peer._lifetime.thread.thread:
            return  # (closed: committed on leaving; on the cluster's thread, in step: none listed)
        peer.cluster.check()
        try:
            peer._lifetime.thread.call(asyncio.wait_for(peer.cluster.commit_solo(), SOLO_COMMIT_S))
        except asyncio.TimeoutError:
            raise GroupError(f"the cluster did not commit this peer's last updates within {SOLO_COMMIT_S:.0f} s: "
                             "take the checkpoint again") from None

    def outer_state(self) -> dict:
        """Local-steps mode: the outer momentum, for a checkpoint or a joiner ({} otherwise)."""
        local = self.peer._local
        return {} if local is None else {"outer": {"momentum": local.velocity_state()}}

    def true_state_dict(self) -> dict:
        """``model.state_dict()``, with the true parameters where the model holds predicted ones,
        and the outer ones in local-steps mode (the model holds this peer's local ones)."""
        peer = self.peer
        if peer._local is not None:
            return peer._local.state_dict(peer.module)
        return peer.module.state_dict() if peer._predictor is None else peer._predictor.true_state_dict(peer.module)

    def load_state_dict(self, state: dict) -> None:
        """``AsyncPeer.load_state_dict``: before entering."""
        peer = self.peer
        if peer._lifetime.thread is not None:
            raise ConfigError("load_state_dict must come before entering the peer (before `with peer:`)")
        if isinstance(state, dict) and isinstance(state.get("model"), dict):  # (a compiled model's own)
            state = {**state, "model": {k.removeprefix(COMPILED_PREFIX): v for k, v in state["model"].items()}}
        version, point = _checked_state(peer.module, peer.optimizer, state)
        peer.module.load_state_dict(state["model"])
        peer.optimizer.load_state_dict(state["optimizer"])
        self._load_scheduler(state)
        if peer._local is not None:
            peer._local.reset((state.get("outer") or {}).get("momentum"))
        peer.version = peer._committed = peer._computing_on = version
        peer._start = point
