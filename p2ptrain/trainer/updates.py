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
versions, the state loads waiting, the accumulator, ``solo``) is the trainer's state
(``state.TrainerState``), changed through its operations (``pop_update``, ``update_applied``,
``take_restore``, ``state_load_ended``, ``applied_alone``) and read under its ``lock``.

Threads and locks. Whatever changes the parameters runs with the state's ``params_lock`` held,
never under a forward or a backward: on the caller's thread inside ``step``, or on the
cluster's thread while ``step`` waits there or the peer leaves (``Contributor.wait``,
``flush``: the caller is blocked then); ``load_state_dict`` only before entering (one thread
then, no lock). ``lock`` is taken inside it (``params_lock`` first, always), briefly, for the
shared state. ``true_state_dict`` and ``outer_state`` only read (a snapshot calls them on the
cluster's thread, ``params_lock`` held).
"""

from __future__ import annotations

import asyncio
import collections
import logging
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
    from collections.abc import Callable

    from p2ptrain.trainer.host import Host
    from p2ptrain.trainer.lifetime import Lifetime
    from p2ptrain.trainer.state import TrainerState

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

    def __init__(self, host: Host, state: TrainerState, lifetime: Lifetime, device, look: Callable[[], None]):
        self.host, self.state, self._lifetime = host, state, lifetime
        self._look = look  # (a sketch of the parameters held NaN or inf: ``Contributor.look``)
        self._start: SyncPoint | None = None  # a checkpoint's point (``load_state_dict``), else genesis
        self._mean = AveragedGradient(state.params, device)  # (used under params_lock)
        self._sketching = None  # (point, metrics, drift.SketchRead): a sketch the device still copies
        self._said_end = False  # the line naming where this peer finished was logged (``_say_finished``)
        self._progress = ProgressLog()
        self.metrics: RoundMetrics | None = None  # the last update applied here
        self.history: collections.deque[RoundMetrics] = collections.deque(maxlen=HISTORY)
        self.corrected = 0  # the leader's parameters loaded here because ours drifted past the tolerance

    def apply_queue(self) -> int:
        """Apply the committed updates in order (``params_lock`` held). Returns how many."""
        st, host = self.state, self.host
        if not (st.queue or st.reconcile is not None or self._sketching is not None
                or st.predictor is not None or st.finished):
            return 0  # (nothing to do: most steps of a peer alone)
        applied = 0
        predictor = st.predictor
        if predictor is not None:
            with st.lock:  # (in lockstep no gradient is late: nothing to predict, staleness 0's rounds)
                predicting = not st.lockstep()
        while True:
            self._load_reconcile()
            update = st.pop_update()
            if update is None:
                # (read once the device copied it, a CPU's at once; leaving or at the end, now)
                self._deliver_sketch(wait=st.leaving or st.finished)
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
                    host.cluster.recycle(update.summed)
                applied += 1
            st.update_applied(update)
            metrics = update.metrics
            if update.compare and host.reconcile_every and update.point.version % host.reconcile_every == 0:
                # (the outer parameters in local-steps mode: the model holds this peer's local ones)
                read = start_sketch(st.local.outer if st.local is not None else st.params)
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
        if not sketch_finite(sketch):  # (a codec that carries NaN, ``none``, averages it into every replica)
            self._look()
        self._lifetime.loop.call_soon_threadsafe(self.host.cluster.parameters_at, point, sketch)
        if metrics is not None:
            self._publish(replace(metrics, param_checksum=sketch_checksum(sketch)))

    def _say_finished(self) -> None:
        """Once the cluster's run is over and its last update is applied here (``params_lock``
        held): one line naming the round, the version (the chain's digest too) and a digest of
        the parameters, so that replicas that end apart can be told apart from their logs."""
        st = self.state
        with st.lock:
            if not st.finished or st.queue or st.restore is not None or self._said_end:
                return
            self._said_end, point = True, st.params_point
        end = self.host.cluster.finished
        log.info("finished at the cluster's round %s, version %s: this peer holds version %d (chain %s), "
                 "parameters %s", end and end.r, end and end.version, st.version,
                 point.digest.hex()[:16] if point else "-", self.parameters_checksum())

    def parameters_checksum(self) -> str:
        """The replicas' common parameters, hashed (``AsyncPeer.param_checksum``): the true ones
        where the model holds predicted ones, the outer ones in local-steps mode."""
        st, module = self.state, self.host.module
        if st.local is None and st.predictor is None:
            return param_checksum(module)
        state = self.true_state_dict()
        return tensors_checksum((name, state[name]) for name, _ in module.named_parameters())

    def apply_alone(self, batch_size: int) -> bool:
        """Alone (``params_lock`` held): this batch's gradients are the update, applied now as
        the plain loop would; the cluster commits its round later (``Contributor.solo_*``).
        True: that was the run's last version, the cluster must hear of it now."""
        st, host = self.state, self.host
        grads = [p.grad for p in st.params]  # (dense, as a round's mean would be)
        apply_gradients([g.to_dense() if g is not None and g.is_sparse else g for g in grads], st.params,
                        host.optimizer, host.scheduler, host.clip_grad_norm)
        m, last = st.applied_alone(batch_size)
        self.metrics = m  # (as ``_publish``, with no cluster record to complete it: no ring ran)
        self.history.append(m)
        self._progress.applied(m, st.staleness_max, st.dropped)
        return last

    def _apply_update(self, update: CommittedUpdate) -> None:
        st, host = self.state, self.host
        if st.local is not None:
            return st.local.apply(self._mean.of(update, st.local.divisor(update.total, update.spread))[0])
        if update.ours is not None and update.ours.grads is not None:  # alone: our batch as backward left it
            return apply_gradients(update.ours.grads, st.params, host.optimizer, host.scheduler,
                                   host.clip_grad_norm)
        apply_update(update, self._mean, host.optimizer, host.scheduler, host.clip_grad_norm)

    def _publish(self, m: RoundMetrics) -> None:
        m = self._progress.completed(m, self.host.cluster)
        self.metrics = m
        self.history.append(m)
        self._progress.applied(m, self.state.staleness_max, self.state.dropped)

    # -- states handed over by the cluster (``Contributor.restore``, ``reconcile``) -------------
    def load_restore(self) -> bool:
        """Load a pending state (``params_lock`` held; no forward or backward runs now).
        True: one was loaded (what was computed before it is void)."""
        st = self.state
        state = st.take_restore()
        if state is None:
            return False
        stepped = st.local.samples if st.local is not None else 0  # (inner steps the load starts over)
        self._load_state(state)
        for p in st.params:
            p.grad = None
        # (batches added since ``Contributor.restore`` voided the rest)
        void = st.state_load_ended(int(state.get("version", 0)), _point(state.get("sync")), stepped)
        if void:
            log.info("loading the cluster's state: %d samples computed here since are void", void)
        return True

    def _load_reconcile(self) -> None:
        """(``params_lock`` held) Ours at the leader's point: take its parameters."""
        st, module = self.state, self.host.module
        taken = st.take_reconcile()
        if taken is None:
            return
        state, point, here = taken
        if (here.version, here.digest) != (point.version, point.digest):
            log.debug("the leader's parameters for version %d came after ours passed it", point.version)
            return
        if st.local is not None:  # the outer parameters: everything here moves by the difference
            names = dict(module.named_parameters())
            st.local.shift([state["model"][n] for n, _ in st.local.named_outer(module)
                            if names[n].requires_grad], (state.get("outer") or {}).get("momentum"))
        else:
            with torch.no_grad():
                for name, p in module.named_parameters():
                    if name in state["model"]:
                        p.copy_(state["model"][name])
        if st.predictor is not None:
            st.predictor.forget()
        self.corrected += 1

    def _load_state(self, state: dict) -> None:
        """(``params_lock`` held) Parameters and optimizer state from a member's snapshot (in
        local-steps mode the outer state: the model starts over on it, with its momentum)."""
        st, host = self.state, self.host
        host.module.load_state_dict(state["model"])
        if st.local is not None:
            st.local.reset((state.get("outer") or {}).get("momentum"))
        host.optimizer.load_state_dict(state["optimizer"])
        self._load_scheduler(state)
        if st.predictor is not None:
            st.predictor.forget()

    def _load_scheduler(self, state: dict) -> None:
        """The scheduler's state from a snapshot or a ``state_dict()``, where both sides have one."""
        if self.host.scheduler is not None and state.get("scheduler"):
            self.host.scheduler.load_state_dict(state["scheduler"])

    # -- checkpoints ----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """``AsyncPeer.state_dict``: the state as of the last applied update."""
        st, host = self.state, self.host
        self._commit_solo()
        with st.params_lock, st.lock:
            p = st.params_point
            return {"model": self.true_state_dict(), "optimizer": host.optimizer.state_dict(),
                    "scheduler": host.scheduler.state_dict() if host.scheduler is not None else None,
                    "version": st.version, "sync": p and [p.version, p.digest.hex(), p.round, p.epoch],
                    **self.outer_state()}

    def _commit_solo(self) -> None:
        """Alone, the rounds of the batches applied at once are committed now (a checkpoint's
        point must be its version's)."""
        st, cluster, lifetime = self.state, self.host.cluster, self._lifetime
        with st.lock:
            listed = bool(st.solo.listed)
        if not listed or lifetime.closed or lifetime.on_loop():
            return  # (closed: committed on leaving; on the cluster's thread, in step: none listed)
        cluster.check()
        try:
            lifetime.thread.call(asyncio.wait_for(cluster.commit_solo(), SOLO_COMMIT_S))
        except asyncio.TimeoutError:
            raise GroupError(f"the cluster did not commit this peer's last updates within {SOLO_COMMIT_S:.0f} s: "
                             "take the checkpoint again") from None

    def outer_state(self) -> dict:
        """Local-steps mode: the outer momentum, for a checkpoint or a joiner ({} otherwise)."""
        local = self.state.local
        return {} if local is None else {"outer": {"momentum": local.velocity_state()}}

    def true_state_dict(self) -> dict:
        """``model.state_dict()``, with the true parameters where the model holds predicted ones,
        and the outer ones in local-steps mode (the model holds this peer's local ones)."""
        st, module = self.state, self.host.module
        if st.local is not None:
            return st.local.state_dict(module)
        return module.state_dict() if st.predictor is None else st.predictor.true_state_dict(module)

    def load_state_dict(self, state: dict) -> None:
        """``AsyncPeer.load_state_dict``: before entering."""
        st, host = self.state, self.host
        if self._lifetime.thread is not None:
            raise ConfigError("load_state_dict must come before entering the peer (before `with peer:`)")
        if isinstance(state, dict) and isinstance(state.get("model"), dict):  # (a compiled model's own)
            state = {**state, "model": {k.removeprefix(COMPILED_PREFIX): v for k, v in state["model"].items()}}
        version, point = _checked_state(host.module, host.optimizer, state)
        host.module.load_state_dict(state["model"])
        host.optimizer.load_state_dict(state["optimizer"])
        self._load_scheduler(state)
        if st.local is not None:
            st.local.reset((state.get("outer") or {}).get("momentum"))
        st.loaded(version)
        self._start = point

    @property
    def start(self) -> SyncPoint | None:
        """The point a loaded checkpoint's parameters are at (None: none loaded, genesis)."""
        return self._start
