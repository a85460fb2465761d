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
with us in them (``_rounds_seen``, which ``flush`` counts) and ``_scheduler_unsent``. All of
it is used on the cluster's loop thread only; all but the event and ``_scheduler_unsent`` are
written under the peer's ``_lock``, with the core they decide on. Everything else it reads
and writes is the peer's core, shared with the caller's thread (``peer``'s docstring: the
accumulator, our contribution ``_out``, the queue of committed updates, the versions, the
batch in progress, the state loads waiting, the counters), reached through ``self.peer`` and
guarded by the peer's ``_lock``; ``snapshot`` and ``wait`` also take ``_params_lock`` (without
blocking: a busy one means the parameters are changing), ``solo_end`` and ``flush`` block on
it; always before ``_lock``.

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
from typing import TYPE_CHECKING, Any

import numpy as np

from p2ptrain.collective.allreduce import Ready
from p2ptrain.trainer.accumulator import CommittedUpdate
from p2ptrain.trainer.cpu_queue import cpu_times
from p2ptrain.cluster import snapshot
from p2ptrain.codecs import encodable
from p2ptrain.cluster.rounds import SyncPoint
from p2ptrain.errors import ClosedError, DivergedError, GroupError
from p2ptrain.trainer.finite import all_finite

if TYPE_CHECKING:
    from p2ptrain.trainer.peer import AsyncPeer

log = logging.getLogger("p2ptrain.trainer.peer")  # (the peer's lines, under the peer's name)

LINGER_S = 0.02  # a member with nothing yet waits this long for its batch before contributing nothing
LINGER_MAX_S = 2.0  # ... doubling after each round in which no member had anything (an idle cluster:
#                    a round every 2 s, under the leader's first stall warning, half its 5 s floor)
PATIENCE_S, PATIENCE_STEPS = 2.0, 4.0  # a batch later than both (and than that many mean steps) is not waited for
# Rounds in a row whose sum was NaN or inf after which a peer stops (``check_diverged``): its own
# gradients so often, or anyone's so much longer (a peer with bad data leaves first, and the
# others go on without it).
OWN_NAN_LIMIT, SUM_NAN_LIMIT = 10, 30
FLUSH_S = 10.0  # on a normal close, how long to wait for this peer's last samples to be applied


class Contributor:
    """What the cluster calls on the trainer, on its loop thread (see the module docstring).
    Its methods without an underscore are what the cluster and the peer call."""

    def __init__(self, peer: AsyncPeer):
        self.peer = peer  # the shared core: settings, locks, accumulator, queue, versions
        self._changed = asyncio.Event()  # set on every change that may end a wait (cluster's loop only)
        self._linger: asyncio.TimerHandle | None = None  # asks the cluster to take() again
        self._linger_due = False  # the linger ran out while a round waited: take what we have
        self._idle_rounds = 0  # consecutive rounds in which nobody had anything
        self._rounds_seen = 0  # rounds committed with this peer in them
        self._scheduler_unsent = False  # the scheduler's state could not go in a snapshot (said once)
        self._not_finite = [0, 0]  # rounds in a row whose sum was NaN or inf: any, and ours was (``put_back``)
        self._look = False  # one was left out since step last looked (``check_diverged``)

    def take(self, members: int, alone: bool) -> tuple[np.ndarray, int] | tuple[np.ndarray, int, Ready] | None:
        peer = self.peer
        with peer._lock:
            if peer._restore is not None or peer._out is not None:
                return self._not_yet("a state load waits" if peer._out is None else "our last one is still out")
            if peer._local is not None:
                if not peer._acc.samples and not peer._leaving:
                    if not peer._computing:  # inside step(): it says when its pseudo-gradient is ready
                        return self._not_yet("inner steps")
                    late = time.perf_counter() - peer._step_end
                    patience = max(PATIENCE_S, PATIENCE_STEPS * peer._pacing.compute_mean)
                    if late < patience:  # its inner steps go on: wait for them
                        self._arm_linger(patience - late)
                        return self._not_yet("inner steps")
                    # (a peer not stepping: nothing this round; its progress goes in a later one. But
                    # once a round found nothing anywhere, every member is paused: back off as idle)
                    if self._idle_rounds and not self._linger_due:
                        return self._linger_idle()
            elif peer.staleness == 0:
                filling = peer._feed.filling if peer._feed is not None else None
                if (not peer._acc.samples and filling is not None and filling.takeable and not filling.taken
                        and filling.withdrawn is None):
                    filling.taken = True  # backward still writes it: the ring reads each range once written
                    out = peer._out = peer._acc.swap_filling(members, filling)
                    self._changed.set()
                    return out.array, out.samples, filling
                if not peer._acc.samples:
                    return self._not_yet("no batch yet")
            else:
                late = time.perf_counter() - peer._step_end
                patience = max(PATIENCE_S, PATIENCE_STEPS * peer._pacing.compute_mean)
                too_late = peer._committed + 1 - peer._computing_on > peer.staleness
                # (in lockstep at staleness 1 also a batch that would not be too late, so that each
                # round holds every member's; at 2 or more a slower member is not waited for then.
                # That includes the next batch of a member still in step() applying the last update:
                # a quicker member's batch starts the round before it computes one.)
                lockstep = peer.staleness == 1 and peer._lockstep()
                if late < patience and ((peer._computing and (too_late or lockstep))
                                        or (lockstep and not peer._acc.samples and not peer._leaving)):
                    self._arm_linger(patience - late)  # the batch in progress would come too late: wait for it
                    return self._not_yet("the batch in progress" if peer._computing else "the next batch")
                if peer._acc.oldest is not None and peer._committed - peer._acc.oldest > peer.staleness:
                    dropped = peer._acc.void()
                    peer.dropped += dropped
                    log.info("dropped %d samples staler than %d updates", dropped, peer.staleness)
                # (a member not waited for any more, still computing, gives nothing at once, so that
                # the others' rounds go on; but once a round found nothing anywhere, it backs off too:
                # every member paused, rounds went on at once, hundreds a second)
                if not peer._acc.samples and not self._linger_due and (late < patience or not peer._computing
                                                                       or self._idle_rounds):
                    return self._linger_idle()
            self._linger_due = False
            out = peer._out = peer._acc.swap(members)
        peer._acc.to_host(out, alone)  # (that buffer is no longer step()'s)
        self._changed.set()
        return (out.array, out.samples) if out.writer is None else (out.array, out.samples, out.writer)

    async def wait(self, blocked: Callable[[], Any], timeout: float, flushing: bool = False) -> None:
        """On the cluster's loop, while the caller waits in step: wake on every change until
        ``blocked()`` is false. A pending state load lands here too."""
        peer = self.peer
        loop = asyncio.get_running_loop()
        began, deadline = time.perf_counter(), loop.time() + timeout
        try:
            while True:
                peer.cluster.check()
                if peer._lifetime.closed and not flushing:
                    raise ClosedError("this peer was closed while step() waited")
                # The caller waits in step (no forward or backward runs): a pending state
                # load lands here, and so do committed updates, so that a snapshot for a
                # joiner is never refused while this peer waits for a round to take its share.
                # Alone, the update that ends the wait is left to the caller's thread
                # (``_end_step``): measured, a peer alone then ran at 0.98-1.00 of the plain
                # loop against 0.92-0.95; with others, applying here was faster (N = 2).
                if peer.members <= 1:
                    with peer._lock:
                        if not blocked():
                            return
                if (peer._restore is not None or peer._queue) and peer._params_lock.acquire(blocking=False):
                    try:
                        peer._updater.load_restore()
                        peer._applied_waiting += peer._updater.apply_queue()
                    finally:
                        peer._params_lock.release()
                with peer._lock:
                    if not blocked():
                        return
                self._changed.clear()
                left = deadline - loop.time()
                if left <= 0:
                    raise GroupError(f"no round took or applied this peer's batch within {timeout:.0f} s "
                                     f"({peer.cluster.machine.table.can_train(peer.min_peers)[1]}; linked: "
                                     f"{', '.join(peer.cluster.mesh.peers) or 'nobody'}): check that the other "
                                     "peers run, with the same --cluster and --secret")
                try:  # (woken by every change; at least twice a second, for the cluster's failures)
                    await asyncio.wait_for(self._changed.wait(), min(left, 0.5))
                except asyncio.TimeoutError:
                    pass
        finally:
            with peer._lock:
                peer._wait_s += time.perf_counter() - began

    def wake(self) -> None:
        """(cluster's loop) Something changed: a ``wait`` in progress looks again."""
        self._changed.set()

    def _not_yet(self, why: str) -> None:  # (under _lock) the round waits for us: step() must call contribution_available
        peer = self.peer
        log.debug("no contribution yet: %s (%s, computing %s)", why, peer._pacing, peer._computing)
        peer._want_step = True

    def _linger_idle(self) -> None:  # (under _lock) nothing here yet: wait a while, longer after idle rounds
        self._arm_linger(min(LINGER_MAX_S, LINGER_S * 2 ** min(self._idle_rounds, 16)))
        return self._not_yet("lingering for a batch")

    def _arm_linger(self, wait: float) -> None:  # (under _lock) take() is asked again by then
        loop = self.peer._lifetime.loop
        when = loop.time() + wait
        if self._linger is not None and self._linger.when() <= when:
            return
        if self._linger is not None:
            self._linger.cancel()
        self._linger = loop.call_at(when, self._lingered)

    def _lingered(self) -> None:
        peer = self.peer
        with peer._lock:
            self._linger = None
            self._linger_due = peer._want_step  # (a round still waits for us)
        if self._linger_due:
            peer.cluster.contribution_available()

    def cancel_linger(self) -> None:
        """(cluster's loop, the peer closing) The linger timer fires no more."""
        if self._linger is not None:
            self._linger.cancel()

    def apply(self, summed: np.ndarray, total_samples: int) -> None:
        peer = self.peer
        point, now = peer.cluster.machine.sync_point(), time.perf_counter()
        compare = len(peer.cluster.machine.table.live_synced()) > 1
        with peer._lock:
            out, peer._out = peer._out, None
            ours = out if out is not None and total_samples and (
                summed is out.array or np.may_share_memory(summed, out.array)) else None
            if out is not None and total_samples:
                self._not_finite = [0, 0]  # (ours went in: finite)
            if out is not None and ours is None:
                peer._acc.release(out)
            took = peer.cluster.ring_seconds(point.round)  # (ring start to commit: a moving mean)
            if took is not None and total_samples:
                peer._pacing.ring_took(took)
            self._linger_due = False
            self._rounds_seen += 1
            if total_samples == 0:  # nobody had anything: nothing to apply (nor a version: ``History``)
                self._idle_rounds += 1
                if peer._queue:  # (parameters do not change: nothing to compare)
                    peer._queue.append(CommittedUpdate(None, 0, point, None))
                else:
                    peer._params_point = point
            else:
                self._idle_rounds = 0
                stale = peer._committed - out.oldest if out is not None and out.oldest is not None else 0
                peer.staleness_max = max(peer.staleness_max, stale)
                peer._committed += 1
                m = peer._metrics(point.round, peer._committed, out.members if out else 0, total_samples,
                                  out.samples if out else 0, stale, now - out.taken_at if out else 0.0)
                peer._queue.append(CommittedUpdate(summed, total_samples, point, m, ours, compare))
        self._changed.set()

    def put_back(self, contribution: np.ndarray, samples: int, not_finite: bool = False) -> None:
        peer = self.peer
        with peer._lock:
            out = peer._out
            if out is None or contribution is not out.array:  # from before a state load: void (counted then)
                return
            peer._out = None
            if out.writer is not None:  # (the ring stopped before it read all of it)
                out.writer.finish()
            if out.filling is not None and not out.filling.complete:  # (step adds the batch from the gradients)
                out.filling.withdraw("its round aborted while backward ran")
            elif (ours := not encodable(contribution)) or not_finite:  # (an abort only: no pass in a round)
                # A lossy codec cannot carry NaN, inf or |x| > 2**127 (the ring fails on it); carried
                # on, it would abort every round after. Left out, as torch's GradScaler skips such a step;
                # by every member where the round's sum was (``not_finite``), as on every rank under DDP.
                peer.dropped += out.samples
                peer._acc.release(out)
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
            else:
                peer._acc.merge(out)
        self._changed.set()

    def look(self) -> None:
        """(``Updater``) A sketch of the parameters held NaN or inf: the next step looks at them."""
        self._look = True

    def check_diverged(self) -> None:
        """(``step``, ``_params_lock`` held) Once a contribution was left out as not finite, or a
        sketch of the parameters was not (``look``), since the last look, raise DivergedError where
        training cannot go on: the parameters (the outer ones in local-steps mode) hold NaN or inf;
        or our own gradients were not finite OWN_NAN_LIMIT rounds in a row (this peer's data, or
        its model: it leaves, and the others can go on); or the rounds' sums were not,
        SUM_NAN_LIMIT rounds in a row."""
        if not self._look:
            return
        self._look = False
        peer, (any_, own) = self.peer, self._not_finite
        params = peer._local.outer if peer._local is not None else peer.params
        if not all_finite(params):  # (a pass, on this path only)
            raise DivergedError(f"the model diverged: its parameters hold NaN or inf at update {peer.version} (every "
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
        with self.peer._lock:
            self.peer._finished = True
        self._changed.set()

    # -- alone: batches applied in step() at once (``cluster.trainer_api.SoloTrainer``) ----------------------
    def solo_begin(self, r: int, version: int, last_version: int) -> bool:
        """From now on ``step`` applies each batch at once (their rounds numbered from ``r``), if
        nothing is in flight here (committed updates queued are applied first) and an update is
        one batch: gradient mode, no prediction, and at staleness >= 1 no ``target_batch_size``
        (a peer alone's share is then one batch)."""
        peer = self.peer
        with peer._lock:
            if (peer._local is not None or peer._predictor is not None or peer._leaving or peer._lifetime.closed
                    or peer._finished or peer._out is not None or peer._acc.samples
                    or peer._restore is not None or peer._reconcile is not None or peer._solo.listed
                    or version != peer._committed or (last_version and version >= last_version)
                    or (peer.staleness and peer.target_batch_size is not None)):
                return False
            peer._solo.begin(r, last_version)
            peer._want_step = self._linger_due = False  # (no round waits for our batch now)
            if self._linger is not None:
                self._linger.cancel()
                self._linger = None
            return True

    def solo_take(self) -> list[tuple[int, int, float]]:
        with self.peer._lock:
            return self.peer._solo.take()

    def solo_end(self) -> list[tuple[int, int, float]]:
        peer = self.peer
        with peer._params_lock:  # (waits for a batch being applied alone: it is listed after)
            with peer._lock:
                peer._solo.stop()
        return self.solo_take()

    def solo_committed(self, point: SyncPoint, rounds: int) -> None:
        peer = self.peer
        with peer._lock:
            peer._params_point = point
            self._rounds_seen += rounds
            self._idle_rounds = 0
        self._changed.set()

    # -- state transfer ---------------------------------------------------------------------------
    def snapshot(self, parameters_only: bool = False) -> dict | None:
        """The state as of the last applied update, copied (the caller's thread may go on
        training); None while updates are queued or being applied (ask again soon). With
        ``parameters_only`` (a member correcting its drift): the trainable parameters alone."""
        peer = self.peer
        if not peer._params_lock.acquire(blocking=False):
            return None
        try:
            with peer._lock:
                if peer._queue or peer._restore is not None or peer._solo.listed:
                    return None
                version, p = peer.version, peer.cluster.machine.sync_point()
            if parameters_only:
                names = {name for name, q in peer.module.named_parameters() if q.requires_grad}
                return {"model": {k: v.detach().clone() for k, v in peer._updater.true_state_dict().items()
                                  if k in names},
                        "sync": [p.version, p.digest, p.round, p.epoch]}
            return {"model": {k: v.detach().clone() for k, v in peer._updater.true_state_dict().items()},
                    "optimizer": copy.deepcopy(peer.optimizer.state_dict()), "version": version,
                    "scheduler": self._scheduler_snapshot(), "sync": [p.version, p.digest, p.round, p.epoch],
                    **{k: copy.deepcopy(v) for k, v in peer._updater.outer_state().items()}}
        finally:
            peer._params_lock.release()

    def restore(self, state: dict) -> None:
        """A member's snapshot: void what was accumulated here; load it at the next safe point."""
        peer = self.peer
        with peer._lock:
            dropped = peer._acc.void()
            if peer._out is not None:  # the cluster forgets that round: its buffer is not reused
                dropped, peer._out = dropped + peer._out.samples, None
            peer.dropped += dropped
            peer._queue.clear()
            peer._restore, peer._reconcile = state, None
            peer._solo.stop()  # (the cluster ended solo before; a caller of ours may not have)
        if dropped:
            log.info("loading the cluster's state: %d samples accumulated here are void", dropped)
        self._changed.set()

    def reconcile(self, state: dict, point: SyncPoint) -> None:
        """The leader's parameters at ``point`` (ours drifted past the tolerance): loaded in place
        of ours once ours reach that point; what is accumulated stays, and so does our optimizer
        state (moments that differ by rounding only)."""
        with self.peer._lock:
            self.peer._reconcile = (state, point)
        self._changed.set()

    def _scheduler_snapshot(self) -> dict | None:
        """The scheduler's state for a joiner, so that it steps at the cluster's learning rate
        (a fresh scheduler on a joiner would start its schedule over); None when it has none, or
        when its state holds something a snapshot cannot carry (a callable: said once)."""
        scheduler = self.peer.scheduler
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
        peer = self.peer
        with peer._lock:
            peer._computing = False  # no batch in progress any more: no round need wait for one
            peer._want_step = False
            peer._leaving = True
        loop = asyncio.get_running_loop()
        deadline, target = loop.time() + FLUSH_S, None

        def blocked() -> bool:  # (under _lock)
            nonlocal target
            if peer._finished or not peer.cluster.machine.table.can_train(peer.min_peers)[0]:
                return False
            if self._ours_pending():
                return True
            target = self._rounds_seen + 2 if target is None else target
            return self._rounds_seen < target

        # (local steps: once our contribution in flight is applied, the inner steps made since go
        # too; the model ends on the outer parameters. A stopped cluster applies nothing more.)
        if (peer.staleness or peer._local is not None) and peer.cluster.failure is None:
            peer._notify()
            try:
                if peer._local is not None:
                    await self._flush_inner_steps(deadline)
                await self.wait(blocked, max(0.0, deadline - loop.time()), flushing=True)
            except GroupError:
                log.warning("leaving with %d samples not applied: no round took them within %.0f s",
                            peer._acc.samples, FLUSH_S)
        # (what was handed over or committed meanwhile lands as the peer leaves: ``AsyncPeer._leave``)

    async def _flush_inner_steps(self, deadline: float) -> None:
        """Local steps, leaving: wait for our contribution in flight, then contribute the inner
        steps made since (fewer than ``sync_every``, or more if the last round was slow)."""
        peer = self.peer

        def in_flight() -> bool:  # (under _lock)
            return (not peer._finished and peer.cluster.machine.table.can_train(peer.min_peers)[0]
                    and self._ours_pending())

        await self.wait(in_flight, max(0.0, deadline - asyncio.get_running_loop().time()), flushing=True)
        with peer._params_lock:  # (the caller is in close(): no forward or backward runs)
            peer._updater.apply_queue()
            with peer._lock:
                if peer._finished or self._ours_pending() or not peer._local.samples:
                    return
                if not self.add_local():
                    return
        peer._notify()

    def _ours_pending(self) -> bool:
        """(Under _lock) Samples of ours that no round applied yet: added, or out in a round (a
        peer leaving gives a round an empty contribution, which is nothing to wait for)."""
        peer = self.peer
        return bool(peer._acc.samples or (peer._out is not None and peer._out.samples))

    def add_local(self) -> bool:
        """(Both locks held) Local-steps mode: the pseudo-gradient owed goes to the accumulator.
        False where the inner steps diverged: left out, counted as dropped (``LocalSteps.contribute``
        started the model again)."""
        peer = self.peer
        if peer.staleness:  # (whether step waits for this one: the CPU time waited so far, ``pacing``)
            peer._pacing.cpu_sampled(cpu_times())
        delta, samples = peer._local.contribute(into=peer._acc.begin_writing())
        if delta is None:
            peer.dropped += samples
            return False
        peer._acc.add_weighted(delta, samples, peer.version)
        return True
