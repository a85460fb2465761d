"""The trainer as the cluster sees it: ``Contributor``, the part of ``peer.AsyncPeer`` that
runs on the cluster's loop thread (the peer holds it as ``_contributor`` and gives it to
``Cluster`` as its ``trainer``: ``cluster.trainer_api.Contributions`` and ``SoloTrainer``).

Call order. The cluster calls ``take`` when a round collects (our accumulator is swapped out, or
None: nothing yet, and ``step`` or the linger timer calls ``contribution_available`` later;
``alone``: the round's sum will be what we hand over, so a batch kept as backward left it
stays so, ``Accumulator``; with ``overlap``, the batch backward is still writing, with its
``overlap.Filling`` as a third element; else, on the CPU, a kept batch with its
``WrittenAsRead``), then ``apply`` on commit or ``put_back`` on abort (a
batch still being written is then withdrawn, not merged: ``step`` adds it); ``snapshot``,
``restore`` and ``reconcile`` for state transfer; ``finish`` at the run's end; ``solo_*``
while the peer is alone. The peer runs ``wait`` here while ``step`` blocks (committed updates
and state loads land meanwhile) and ``flush`` when it leaves. A state handed over is loaded
later, at a safe point, never under a forward or a backward (``updates.Updater.load_restore``,
and the leader's parameters inside ``apply_queue``).

Who owns what. ``Contributor`` owns what only the cluster's side touches, set in its
``__init__``: the wake-up event ``_changed`` (``wait`` sleeps on it; every change here sets
it), the linger timer (``_linger``, ``_linger_due``, ``_idle_rounds``), the rounds committed
with us in them (``_rounds_seen``, which ``flush`` counts), the not-finite counts and
``_scheduler_unsent``. All of it is used on the cluster's loop thread only; the linger's and
the rounds' are written under the state's ``lock``, with the state they decide on. Everything
else is the trainer's shared state (``state.TrainerState``: its docstring says which thread
calls which operation, under which lock), changed through its operations.

When this member contributes is decided in ``contribution_decision`` (pure): ``take`` reads the
state's ``view``, decides, and carries the decision out (drop what is too stale, hand over our
sum, or arm the linger timer and tell the round to wait).
"""

from __future__ import annotations

import asyncio
import copy
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from p2ptrain.collective.allreduce import Ready
from p2ptrain.cluster import snapshot
from p2ptrain.cluster.rounds import SyncPoint
from p2ptrain.errors import ClosedError, DivergedError, GroupError
from p2ptrain.trainer.contribution_decision import Action, Decision, Mode, decide
from p2ptrain.trainer.finite import all_finite

if TYPE_CHECKING:
    from p2ptrain.trainer.backward_feed import BackwardFeed
    from p2ptrain.trainer.host import Host
    from p2ptrain.trainer.lifetime import Lifetime
    from p2ptrain.trainer.state import TrainerState
    from p2ptrain.trainer.updates import Updater

log = logging.getLogger("p2ptrain.trainer.peer")  # (the peer's lines, under the peer's name)

# Rounds in a row whose sum was NaN or inf after which a peer stops (``check_diverged``): its own
# gradients so often, or anyone's so much longer (a peer with bad data leaves first, and the
# others go on without it).
OWN_NAN_LIMIT, SUM_NAN_LIMIT = 10, 30
FLUSH_S = 10.0  # on a normal close, how long to wait for this peer's last samples to be applied


class Contributor:
    """What the cluster calls on the trainer, on its loop thread (see the module docstring).
    Its methods without an underscore are what the cluster and the peer call."""

    def __init__(self, host: Host, state: TrainerState, lifetime: Lifetime, updater: Updater,
                 feed: BackwardFeed | None, notify: Callable[[], None], step_timeout: float):
        self.host, self.state, self._lifetime, self._updater = host, state, lifetime, updater
        self._feed, self._notify, self._step_timeout = feed, notify, step_timeout
        self._mode = Mode(staleness=state.staleness, local_steps=state.local is not None, overlap=feed is not None)
        self._changed = asyncio.Event()  # set on every change that may end a wait (cluster's loop only)
        self._linger: asyncio.TimerHandle | None = None  # asks the cluster to take() again
        self._linger_due = False  # the linger ran out while a round waited: take what we have
        self._idle_rounds = 0  # consecutive rounds in which nobody had anything
        self._rounds_seen = 0  # rounds committed with this peer in them
        self._scheduler_unsent = False  # the scheduler's state could not go in a snapshot (said once)
        self._not_finite = [0, 0]  # rounds in a row whose sum was NaN or inf: any, and ours was (``put_back``)
        self._look = False  # one was left out since step last looked (``check_diverged``)

    def take(self, members: int, alone: bool) -> tuple[np.ndarray, int] | tuple[np.ndarray, int, Ready] | None:
        st = self.state
        with st.lock:
            filling = self._feed.filling if self._feed is not None else None
            ready = (filling is not None and filling.takeable and not filling.taken and filling.withdrawn is None)
            now = time.perf_counter()
            decision = decide(st.view(filling_ready=ready, linger_due=self._linger_due, idle_rounds=self._idle_rounds),
                              self._mode, now)
            if decision.drop_stale:
                st.drop_stale()
            if decision.action is Action.WAIT:
                return self._not_yet(decision, now)
            if decision.action is Action.TAKE_FILLING:  # backward still writes it: the ring reads each range
                out = st.take_contribution(members, filling)  # once written
                self._changed.set()
                return out.array, out.samples, filling
            self._linger_due = False
            out = st.take_contribution(members)
        st.acc.to_host(out, alone)  # (that buffer is no longer step()'s)
        self._changed.set()
        return (out.array, out.samples) if out.writer is None else (out.array, out.samples, out.writer)

    def wait_step(self):
        """The coroutine a blocked ``step`` waits on, on the cluster's loop (``lifetime.Work``)."""
        return self.wait(self.state.must_wait, self._step_timeout)

    async def wait(self, blocked: Callable[[], Any], timeout: float, flushing: bool = False) -> None:
        """On the cluster's loop, while the caller waits in step: wake on every change until
        ``blocked()`` is false. A pending state load lands here too."""
        st, cluster = self.state, self.host.cluster
        loop = asyncio.get_running_loop()
        began, deadline = time.perf_counter(), loop.time() + timeout
        try:
            while True:
                cluster.check()
                if self._lifetime.closed and not flushing:
                    raise ClosedError("this peer was closed while step() waited")
                # The caller waits in step (no forward or backward runs): a pending state
                # load lands here, and so do committed updates, so that a snapshot for a
                # joiner is never refused while this peer waits for a round to take its share.
                # Alone, the update that ends the wait is left to the caller's thread
                # (``_end_step``): measured, a peer alone then ran at 0.98-1.00 of the plain
                # loop against 0.92-0.95; with others, applying here was faster (N = 2).
                if st.members() <= 1:
                    with st.lock:
                        if not blocked():
                            return
                if st.has_work() and st.params_lock.acquire(blocking=False):
                    try:
                        self._updater.load_restore()
                        st.applied_waiting += self._updater.apply_queue()
                    finally:
                        st.params_lock.release()
                with st.lock:
                    if not blocked():
                        return
                self._changed.clear()
                left = deadline - loop.time()
                if left <= 0:
                    raise GroupError(f"no round took or applied this peer's batch within {timeout:.0f} s "
                                     f"({cluster.machine.table.can_train(st.min_peers)[1]}; linked: "
                                     f"{', '.join(cluster.mesh.peers) or 'nobody'}): check that the other "
                                     "peers run, with the same --cluster and --secret")
                try:  # (woken by every change; at least twice a second, for the cluster's failures)
                    await asyncio.wait_for(self._changed.wait(), min(left, 0.5))
                except asyncio.TimeoutError:
                    pass
        finally:
            with st.lock:
                st.wait_s += time.perf_counter() - began

    def wake(self) -> None:
        """(cluster's loop) Something changed: a ``wait`` in progress looks again."""
        self._changed.set()

    def _not_yet(self, decision: Decision, now: float) -> None:  # (under the lock) the round waits for us:
        st = self.state  # step() must call contribution_available, or the linger timer asks again
        log.debug("no contribution yet: %s (%s, computing %s)", decision.why, st.pacing, st.computing)
        st.want_step = True
        if decision.retry_at is not None:
            self._arm_linger(decision.retry_at - now)

    def _arm_linger(self, wait: float) -> None:  # (under the lock) take() is asked again by then
        loop = self._lifetime.loop
        when = loop.time() + wait
        if self._linger is not None and self._linger.when() <= when:
            return
        if self._linger is not None:
            self._linger.cancel()
        self._linger = loop.call_at(when, self._lingered)

    def _lingered(self) -> None:
        with self.state.lock:
            self._linger = None
            self._linger_due = self.state.want_step  # (a round still waits for us)
        if self._linger_due:
            self.host.cluster.contribution_available()

    def cancel_linger(self) -> None:
        """(cluster's loop, the peer closing) The linger timer fires no more."""
        if self._linger is not None:
            self._linger.cancel()

    def used(self, contribution: np.ndarray) -> bytes | None:
        """(its ring ended) Which parameters of our contribution had a gradient, for the round's
        DONE (``cluster.used``); None: all did, or it is not ours any more (void: a state load)."""
        with self.state.lock:
            return self.state.used(contribution)

    def apply(self, summed: np.ndarray, total_samples: int, used: bytes | None = None,
              spread: tuple | None = None) -> list[tuple[int, int]] | None:
        """A round committed (``trainer_api``); returns the ranges of ``summed`` it leaves out
        (parameters no member had a gradient for: their ``grad`` stays None), or None."""
        cluster = self.host.cluster
        point, now = cluster.machine.sync_point(), time.perf_counter()
        compare = len(cluster.machine.table.live_synced()) > 1
        took, others_after = cluster.ring_timing(point.round)  # (ring start to commit: a moving mean)
        flags = self.state.flags(used)
        with self.state.lock:
            if self.state.update_committed(summed, total_samples, point, took, compare, now, flags,
                                           cluster.machine.exchange_seconds(), spread, others_after):
                self._not_finite = [0, 0]  # (ours went in: finite)
            self._linger_due = False
            self._rounds_seen += 1
            self._idle_rounds = 0 if total_samples else self._idle_rounds + 1  # (nobody had anything)
        self._changed.set()
        return None if flags is None else self.state.acc.spans(~flags)

    def put_back(self, contribution: np.ndarray, samples: int, not_finite: bool = False) -> None:
        back = self.state.put_back(contribution, not_finite)
        if back is None:  # from before a state load: void (counted then)
            return
        if back[1] is not None:  # left out as not finite (``TrainerState.put_back``)
            out, ours = back
            self._look = True  # (step looks whether the model diverged: ``check_diverged``)
            self._not_finite[0] += 1
            self._not_finite[1] += ours
            n = self._not_finite[0]
            if n in (1, 10, 100) or n % 1000 == 0:  # (not one line a round)
                log.warning("%s: this peer's %d samples are left out (%d rounds in a row); if it recurs, lower the "
                            "learning rate or check the data (under AMP's GradScaler an overflow now and then is "
                            "routine)", "this peer's gradient sum holds NaN, inf or a value "
                            "past 2**127" if ours else "the round's sum held NaN or inf (another peer's batch, or "
                            "an overflow)", out.samples, n)
        self._changed.set()

    def look(self) -> None:
        """(``Updater``) A sketch of the parameters held NaN or inf: the next step looks at them."""
        self._look = True

    def check_diverged(self) -> None:
        """(``step``, ``params_lock`` held) Once a contribution was left out as not finite, or a
        sketch of the parameters was not (``look``), since the last look, raise DivergedError where
        training cannot go on: the parameters (the outer ones in local-steps mode) hold NaN or inf;
        or our own gradients were not finite OWN_NAN_LIMIT rounds in a row (this peer's data, or
        its model: it leaves, and the others can go on); or the rounds' sums were not,
        SUM_NAN_LIMIT rounds in a row."""
        if not self._look:
            return
        self._look = False
        st, (any_, own) = self.state, self._not_finite
        params = st.local.outer if st.local is not None else st.params
        if not all_finite(params):  # (a pass, on this path only)
            raise DivergedError(f"the model diverged: its parameters hold NaN or inf at update {st.version} (every "
                                "peer's do); lower the learning rate and resume from a checkpoint written before")
        if own >= OWN_NAN_LIMIT:
            raise DivergedError(f"this peer's gradients held NaN or inf {own} rounds in a row: the model diverged "
                                "(lower the learning rate and resume from a checkpoint written before), or this "
                                "peer's data holds NaN or inf (check it)")
        if any_ >= SUM_NAN_LIMIT:
            raise DivergedError(f"the rounds' gradient sums held NaN or inf {any_} rounds in a row: the model "
                                "diverged (lower the learning rate and resume from a checkpoint written before)")

    def finish(self) -> None:
        """The cluster's run is over: ``step`` waits for no round any more, and ``finished`` is
        true once what is queued is applied."""
        self.state.finish()
        self._changed.set()

    # -- alone: batches applied in step() at once (``cluster.trainer_api.SoloTrainer``) ----------------------
    def solo_begin(self, r: int, version: int, last_version: int) -> bool:
        """From now on ``step`` applies each batch at once (their rounds numbered from ``r``), if
        nothing is in flight here (committed updates queued are applied first) and an update is
        one batch: gradient mode, no prediction, and at staleness >= 1 no ``target_batch_size``
        (a peer alone's share is then one batch)."""
        st = self.state
        with st.lock:
            if (st.local is not None or st.predictor is not None or st.leaving or self._lifetime.closed
                    or st.finished or st.out is not None or st.acc.samples
                    or st.restore is not None or st.reconcile is not None or st.solo.listed
                    or version != st.committed or (last_version and version >= last_version)
                    or (st.staleness and st.target_batch_size is not None)):
                return False
            st.solo.begin(r, last_version)
            st.want_step = self._linger_due = False  # (no round waits for our batch now)
            if self._linger is not None:
                self._linger.cancel()
                self._linger = None
            return True

    def solo_take(self) -> list[tuple[int, int, float]]:
        with self.state.lock:
            return self.state.solo.take()

    def solo_end(self) -> list[tuple[int, int, float]]:
        st = self.state
        with st.params_lock:  # (waits for a batch being applied alone: it is listed after)
            with st.lock:
                st.solo.stop()
        return self.solo_take()

    def solo_committed(self, point: SyncPoint, rounds: int) -> None:
        st = self.state
        with st.lock:
            st.params_point = point
            self._rounds_seen += rounds
            self._idle_rounds = 0
        self._changed.set()

    # -- state transfer ---------------------------------------------------------------------------
    def snapshot(self, parameters_only: bool = False) -> dict | None:
        """The state as of the last applied update, copied (the caller's thread may go on
        training); None while updates are queued or being applied (ask again soon). With
        ``parameters_only`` (a member correcting its drift): the trainable parameters alone."""
        st, host = self.state, self.host
        if not st.params_lock.acquire(blocking=False):
            return None
        try:
            with st.lock:
                if not st.settled():
                    return None
                version, p = st.version, host.cluster.machine.sync_point()
            model = self._updater.true_state_dict()
            if parameters_only:
                names = {name for name, q in host.module.named_parameters() if q.requires_grad}
                return {"model": {k: v.detach().clone() for k, v in model.items() if k in names},
                        "sync": [p.version, p.digest, p.round, p.epoch]}
            return {"model": {k: v.detach().clone() for k, v in model.items()},
                    "optimizer": copy.deepcopy(host.optimizer.state_dict()), "version": version,
                    "scheduler": self._scheduler_snapshot(), "sync": [p.version, p.digest, p.round, p.epoch],
                    **{k: copy.deepcopy(v) for k, v in self._updater.outer_state().items()}}
        finally:
            st.params_lock.release()

    def restore(self, state: dict) -> None:
        """A member's snapshot: void what was accumulated here; load it at the next safe point."""
        dropped = self.state.state_load_began(state)
        if dropped:
            log.info("loading the cluster's state: %d samples accumulated here are void", dropped)
        self._changed.set()

    def reconcile(self, state: dict, point: SyncPoint) -> None:
        """The leader's parameters at ``point`` (ours drifted past the tolerance): loaded in place
        of ours once ours reach that point; what is accumulated stays, and so does our optimizer
        state (moments that differ by rounding only)."""
        self.state.reconcile_began(state, point)
        self._changed.set()

    def _scheduler_snapshot(self) -> dict | None:
        """The scheduler's state for a joiner, so that it steps at the cluster's learning rate
        (a fresh scheduler on a joiner would start its schedule over); None when it has none, or
        when its state holds something a snapshot cannot carry (a callable: said once)."""
        scheduler = self.host.scheduler
        if scheduler is None:
            return None
        state = copy.deepcopy(scheduler.state_dict())
        try:
            snapshot.pack(state)
        except (ValueError, TypeError) as exc:
            if not self._scheduler_unsent:
                self._scheduler_unsent = True
                log.warning("the scheduler's state is not sent to joiners (%s): they start its schedule over", exc)
            return None
        return state

    # -- leaving --------------------------------------------------------------------------------
    async def flush(self) -> None:
        """Staleness >= 1: stay until this peer's samples are applied, then two more rounds, so
        that what the others computed before we left (taken by the next round, or held by
        the one after for a batch in progress) is applied with us. At most ``FLUSH_S``."""
        st, cluster = self.state, self.host.cluster
        st.leaving_began()
        loop = asyncio.get_running_loop()
        deadline, target = loop.time() + FLUSH_S, None

        def blocked() -> bool:  # (under the lock)
            nonlocal target
            if st.finished or not cluster.machine.table.can_train(st.min_peers)[0]:
                return False
            if st.ours_pending():
                return True
            target = self._rounds_seen + 2 if target is None else target
            return self._rounds_seen < target

        # (local steps: once our contribution in flight is applied, the inner steps made since go
        # too; the model ends on the outer parameters. A stopped cluster applies nothing more.)
        if (st.staleness or st.local is not None) and cluster.failure is None:
            self._notify()
            try:
                if st.local is not None:
                    await self._flush_inner_steps(deadline)
                await self.wait(blocked, max(0.0, deadline - loop.time()), flushing=True)
            except GroupError:
                log.warning("leaving with %d samples not applied: no round took them within %.0f s",
                            st.acc.samples, FLUSH_S)
        # (what was handed over or committed meanwhile lands as the peer leaves: ``AsyncPeer._leave``)

    async def _flush_inner_steps(self, deadline: float) -> None:
        """Local steps, leaving: wait for our contribution in flight, then contribute the inner
        steps made since (fewer than ``sync_every``, or more if the last round was slow)."""
        st, cluster = self.state, self.host.cluster

        def in_flight() -> bool:  # (under the lock)
            return not st.finished and cluster.machine.table.can_train(st.min_peers)[0] and st.ours_pending()

        await self.wait(in_flight, max(0.0, deadline - asyncio.get_running_loop().time()), flushing=True)
        with st.params_lock:  # (the caller is in close(): no forward or backward runs)
            self._updater.apply_queue()
            with st.lock:
                if st.finished or st.ours_pending() or not st.local.samples:
                    return
                if not st.add_pseudo_gradient():
                    return
        self._notify()
