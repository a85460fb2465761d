"""``TrainerState``: the one owner of what the training loop's thread and the cluster's thread share.

What it holds: the accumulator (``acc``), our contribution in a round (``out``), the committed
updates waiting (``queue``), the versions (``version``: applied here; ``committed``: committed by
the cluster; ``computing_on``: the batch in progress's; ``params_point``: the cluster's point of
the parameters here), the batch in progress (``batch``, ``computing``, ``step_end``,
``want_step``; ``window_began``: local steps by time, when our window began), the pacing
means (``pacing``), the state loads waiting (``restore``,
``reconcile``), ``leaving``, ``finished``, a peer alone (``solo``), the counters (``dropped``,
``staleness_max``, the compute and wait seconds) and the parts that change with the parameters
(``local``: local steps; ``predictor``: weight prediction).

Locks. ``lock`` guards every field above. ``params_lock`` is held while the parameters change
(an update, a state load; the user's optimizer in local-steps mode) or a snapshot copies them,
and guards ``applied_waiting``; it is always taken before ``lock``. A read without ``lock`` is a
peek where a stale answer is harmless (``has_work``; users read ``version``).

Who calls what (the operations write the fields; the parts read them under ``lock``):

=========================  =====================  ==========================================
operation                  thread                 lock held by the caller
=========================  =====================  ==========================================
``view``, ``drop_stale``,  cluster's (``take``)   ``lock``
``take_contribution``
``put_back``               cluster's              none (takes ``lock``)
``update_committed``       cluster's (``apply``)  ``lock``
``state_load_began``,      cluster's              none (takes ``lock``)
``reconcile_began``,
``finish``, ``leaving_began``
``batch_finished``         caller's (``step``)    ``params_lock`` and ``lock``
``step_ended``             caller's               ``params_lock`` (takes ``lock``)
``pop_update``,            whoever applies:       ``params_lock`` (takes ``lock``)
``update_applied``,        caller's in ``step``,
``take_restore``,          cluster's while
``take_reconcile``,        ``step`` waits or the
``state_load_ended``,      peer leaves
``applied_alone``
``add_pseudo_gradient``    either (applying)      ``params_lock`` and ``lock``
``take_want_step``         caller's, backward's   ``lock``
``must_wait``, ``share``,  either                 ``lock``
``lockstep``, ``metrics``,
``ours_pending``,
``settled``
``has_work``               cluster's              none (a peek)
``unapplied``              cluster's, leaving     none (takes ``lock``)
``loaded``                 caller's, before       none (one thread then)
                           entering
=========================  =====================  ==========================================

The decision of what to contribute is pure (``contribution_decision``): ``view`` feeds it, the
contributor carries it out with ``drop_stale`` and ``take_contribution``.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch

from p2ptrain.cluster import used
from p2ptrain.cluster.rounds import SyncPoint
from p2ptrain.codecs import encodable
from p2ptrain.trainer.accumulator import Accumulator, CommittedUpdate, Outgoing, RoundMetrics
from p2ptrain.trainer.contribution_decision import View
from p2ptrain.trainer.cpu_queue import cpu_times
from p2ptrain.trainer.pacing import SPARE_MAX, Pacing, must_wait, share
from p2ptrain.trainer.round_window import auto_waits, auto_window
from p2ptrain.trainer.solo import SoloLane

if TYPE_CHECKING:
    from p2ptrain.trainer.local_steps import LocalSteps
    from p2ptrain.trainer.overlap import Filling
    from p2ptrain.trainer.prediction import WeightPredictor

log = logging.getLogger("p2ptrain.trainer.peer")  # (the peer's lines, under the peer's name)


class TrainerState:
    """See the module docstring. ``members``: the live synced peers now (any thread)."""

    def __init__(self, params: list[torch.Tensor], device: torch.device, *, staleness: int, min_peers: int,
                 target_batch_size: int | None, members: Callable[[], int], local: LocalSteps | None = None,
                 predictor: WeightPredictor | None = None, predicted: bool = False):
        self.params = params
        self.staleness, self.min_peers, self.target_batch_size = staleness, min_peers, target_batch_size
        self.members = members
        self.lock = threading.Lock()
        self.params_lock = threading.Lock()
        self.acc = Accumulator(params, device)
        self.local = local
        self.predictor = predictor
        self.leaving = False  # closing: a round asking for our contribution gets what we have
        self.out: Outgoing | None = None  # our contribution, in a round
        self.queue: collections.deque[CommittedUpdate] = collections.deque()
        self.version = 0  # updates applied to the parameters here
        self.committed = 0  # updates committed by the cluster (applied here, or queued)
        self.computing_on = 0  # the version the batch in progress is computed on
        self.applied_waiting = 0  # updates applied before step() returns (it reports them; under params_lock)
        self.batch = 1  # the last batch size step() was given (the share counts whole batches)
        self.computing = True  # False while the caller is inside step() (no batch in progress)
        self.want_step = False  # a round waits for this peer's next batch: step() must say so
        self.restore: dict | None = None  # a member's state, loaded at the next safe point
        self.reconcile: tuple[dict, SyncPoint] | None = None  # the leader's state, loaded at its point
        self.params_point: SyncPoint | None = None  # the cluster's point of the parameters here
        self.dropped = 0  # samples dropped (too stale, or void after a state load)
        self.finished = False  # the cluster's run is over (``finish``; set on the cluster's thread)
        self.staleness_max = 0
        self.compute_s = self.wait_s = 0.0  # since the last update: for its metrics (``metrics``)
        self.compute_n = 0
        self.pacing = Pacing(predicted=predicted)  # the compute and ring seconds the staleness rule needs
        self.step_end = time.perf_counter()
        # Local steps by time: our window began when the step of our last contribution returned, so
        # a member that waits there for its round (``must_wait``) counts no wait as computing: its
        # window then began at the commit, and a window begun at the contribution itself ended a
        # little sooner each round beside a slower member's, until the waits filled it (four peers,
        # one 10x slower: waits 0.2 s in the first window, 2.0 s of 2.0 in the 24th).
        self.window_began = self.step_end
        self._window_opens = False  # (a contribution in this step: the next window begins as it returns)
        self.solo = SoloLane()  # alone: each batch is applied in step() at once, its round committed after
        self.share_at: float | None = None  # when the batches added last reached our share (``add_batch``)

    # -- the rules read under ``lock`` ----------------------------------------------------------
    def round_members(self) -> int:
        """The members a round of ours has: those live now, and no fewer than ``min_peers`` (no round
        runs with fewer)."""
        return max(self.members(), self.min_peers)

    def lockstep(self) -> bool:  # (``pacing.Pacing.lockstep``)
        return self.pacing.lockstep(self.round_members())

    def share(self) -> int:
        return share(self.target_batch_size, self.round_members(), self.batch)

    def fills(self) -> bool:
        """Our rounds may hold batches beyond the share, beside a slower member (gradient mode at
        staleness >= 1, without ``target_batch_size``, which bounds an update's samples)."""
        return self.local is None and self.target_batch_size is None and self.staleness > 0

    def more(self, now: float) -> bool:
        """Another batch of ours fits before a slower member's READY (where ``fills``;
        ``pacing.Pacing.fits``), within ``SPARE_MAX`` batches over the share."""
        share = self.share()
        return (self.fills() and share <= self.acc.samples < share + SPARE_MAX * self.batch
                and self.pacing.fits(now, self.share_at, added=self.acc.samples > share))

    def filling(self) -> bool:
        """The batch in progress was begun because it fits before a slower member's READY
        (``more`` when ``step`` returned): the round waits for it."""
        return self.computing and self.acc.samples >= self.share() and self.more(self.step_end)

    def must_wait(self) -> bool:
        """Whether ``step`` waits now (the rule is ``pacing.must_wait``)."""
        if self.solo.flush and not self.finished:  # (the run's last version, applied alone: until it ends)
            return True
        local = self.local
        waits = local is not None and local.auto and auto_waits(self.round_members())
        return must_wait(staleness=0 if waits else self.staleness, local_steps=local is not None,
                         finished=self.finished, accumulated=self.acc.samples, out=self.out is not None,
                         share=self.share(), lockstep=self.lockstep(), cores_short=self.pacing.cores_short(),
                         by_time=local is not None and local.window_s is not None,
                         more=self.more(time.perf_counter()))

    def view(self, *, filling_ready: bool, linger_due: bool, idle_rounds: int) -> View:
        """What ``contribution_decision.decide`` reads (the contributor's linger state added)."""
        acc, more = self.acc, self.more(time.perf_counter())
        return View(accumulated=acc.samples, oldest=acc.oldest, committed=self.committed,
                    computing_on=self.computing_on, computing=self.computing, step_end=self.step_end,
                    compute_mean=self.pacing.compute_mean, lockstep=self.staleness == 1 and self.lockstep(),
                    leaving=self.leaving, out=self.out is not None, restore_waiting=self.restore is not None,
                    filling_ready=filling_ready, linger_due=linger_due, idle_rounds=idle_rounds,
                    more_until=self.pacing.others_due(self.share_at) if more else None, filling=self.filling())

    def ours_pending(self) -> bool:
        """Samples of ours that no round applied yet: added, or out in a round (a peer leaving
        gives a round an empty contribution, which is nothing to wait for)."""
        return bool(self.acc.samples or (self.out is not None and self.out.samples))

    def settled(self) -> bool:
        """Nothing queued, no state load waiting, nothing applied alone uncommitted: the
        parameters are those of the last committed update (a snapshot may copy them)."""
        return not self.queue and self.restore is None and not self.solo.listed

    def has_work(self) -> bool:  # (a peek without the lock: a state load or an update to apply)
        return self.restore is not None or bool(self.queue)

    def metrics(self, r: int, version: int, members: int, samples: int, local_samples: int, staleness: int,
                round_time: float) -> RoundMetrics:
        """An update's metrics, with the compute and wait seconds since the last one (read and reset)."""
        m = RoundMetrics(round=r, version=version, members=members, samples=samples, local_samples=local_samples,
                         staleness=staleness, staleness_max=self.staleness_max, dropped=self.dropped, wire_bytes=0,
                         raw_bytes=0, round_time=round_time, compute_time=self.compute_s / max(self.compute_n, 1),
                         wait_time=self.wait_s)
        self.compute_s = self.wait_s = 0.0
        self.compute_n = 0
        return m

    # -- the cluster's side: a contribution's life ------------------------------------------------
    def drop_stale(self) -> None:
        """What was accumulated on a version more than the bound behind is dropped, counted."""
        dropped = self.acc.void()
        self.dropped += dropped
        log.info("dropped %d samples staler than %d updates", dropped, self.staleness)

    def take_contribution(self, members: int, filling: Filling | None = None) -> Outgoing:
        """Our contribution goes out to a round of ``members``: the accumulator's sum (swapped for a
        fresh one), or the buffer backward is writing (``filling``, marked taken)."""
        if filling is not None:
            filling.taken = True
            self.out = self.acc.swap_filling(members, filling)
        else:
            self.out = self.acc.swap(members)
        self.out.share_at, self.share_at = self.share_at, None
        return self.out

    def put_back(self, contribution: np.ndarray, not_finite: bool) -> tuple[Outgoing, bool | None] | None:
        """A round holding ``contribution`` aborted. None: not ours any more (from before a state
        load: void, counted then). Else the contribution and what became of it: None, given back
        to the accumulator or withdrawn (a batch backward still writes: ``step`` adds it); True or
        False, left out as not finite (True: ours was; False: the round's sum was), counted as
        dropped (a lossy codec cannot carry NaN, inf or |x| > 2**127: carried on, it would abort
        every round after; left out, as GradScaler skips such a step, and by every member where
        the round's sum was, as on every rank under DDP)."""
        with self.lock:
            out = self.out
            if out is None or contribution is not out.array:
                return None
            self.out = None
            if out.writer is not None:  # (the ring stopped before it read all of it)
                out.writer.finish()
            if out.filling is not None and not out.filling.complete:  # (step adds the batch from the gradients)
                out.filling.withdraw("its round aborted while backward ran")
                return out, None
            ours = not encodable(contribution)
            if ours or not_finite:  # (an abort only: no pass in a round)
                self.dropped += out.samples
                self.acc.release(out)
                return out, ours
            self.acc.merge(out)
            self.share_at = out.share_at if out.share_at is not None else self.share_at
            return out, None

    def used(self, contribution: np.ndarray) -> bytes | None:
        """(under ``lock``) Which parameters of ``contribution`` had a gradient (``used.encode``);
        None: all did, or it is not ours (from before a state load: its round is void here)."""
        out = self.out
        if out is None or contribution is not out.array:
            return None
        flags = out.used_flags()
        return None if flags is None else used.encode(flags)

    def update_committed(self, summed: np.ndarray, total_samples: int, point: SyncPoint, ring_s: float | None,
                         compare: bool, now: float, flags: np.ndarray | None = None,
                         exchange_s: float | None = None, spread: tuple | None = None,
                         others_after: float | None = None) -> bool:
        """A round committed: its update is queued for the caller's thread (none where nobody had
        anything: the round still counts for the lineage). True: our contribution was in it.
        ``flags``: which parameters some member had a gradient for (``flags``: None, all);
        ``exchange_s``: the cluster's usual ring from START (auto's window reads it); ``spread``:
        the members' samples as (largest, squares) (``LocalSteps.divisor``; None: not known);
        ``others_after``: seconds from our READY to the last of the others' (``Pacing.round_committed``)."""
        out, self.out = self.out, None
        ours = out if out is not None and total_samples and (
            summed is out.array or np.may_share_memory(summed, out.array)) else None
        if out is not None and ours is None:
            self.acc.release(out)
        if ring_s is not None and total_samples:
            self.pacing.ring_took(ring_s)
        self.pacing.exchange = exchange_s
        if out is not None and total_samples:
            self.pacing.round_committed(out.taken_at, out.share_at, others_after, out.members)
            if self.fills() and out.members > 1:
                line = self.pacing.paced(out.batches, now)
                if line:
                    log.warning(line)
        if total_samples == 0:
            if self.queue:  # (parameters do not change: nothing to compare)
                self.queue.append(CommittedUpdate(None, 0, point, None))
            else:
                self.params_point = point
            return False
        stale = self.committed - out.oldest if out is not None and out.oldest is not None else 0
        self.staleness_max = max(self.staleness_max, stale)
        self.committed += 1
        m = self.metrics(point.round, self.committed, out.members if out else 0, total_samples,
                         out.samples if out else 0, stale, now - out.taken_at if out else 0.0)
        self.queue.append(CommittedUpdate(summed, total_samples, point, m, ours, compare, flags, spread))
        return out is not None

    def flags(self, mask: bytes | None) -> np.ndarray | None:
        """(any thread) A COMMIT's mask as one flag per parameter; None: all had a gradient, or a
        mask that does not fit this model (the leader's fault: said, and read as all)."""
        try:
            return used.decode(mask, len(self.params))
        except ValueError as exc:
            log.warning("the leader's mask of parameters with a gradient is void (%s): every parameter is "
                        "stepped this round; check that every peer runs the same p2ptrain version", exc)
            return None

    def state_load_began(self, state: dict) -> int:
        """A member's state is handed over: what was accumulated or out is void (returned, counted),
        the queue cleared; it is loaded at the next safe point (``take_restore``)."""
        with self.lock:
            dropped = self.acc.void()
            if self.out is not None:  # the cluster forgets that round: its buffer is not reused
                dropped, self.out = dropped + self.out.samples, None
            self.dropped += dropped
            self.queue.clear()
            self.restore, self.reconcile = state, None
            self.solo.stop()  # (the cluster ended solo before; a caller of ours may not have)
        return dropped

    def reconcile_began(self, state: dict, point: SyncPoint) -> None:
        with self.lock:
            self.reconcile = (state, point)

    def finish(self) -> None:
        with self.lock:
            self.finished = True

    def leaving_began(self) -> None:
        """Closing: no batch in progress any more, no round need wait for one."""
        with self.lock:
            self.computing = self.want_step = False
            self.leaving = True

    def take_want_step(self) -> bool:
        """(under ``lock``) Whether a round waits for our next batch; it is told now."""
        want, self.want_step = self.want_step, False
        return want

    # -- the caller's side -------------------------------------------------------------------------
    def add_batch(self, batch_size: int, at: float, keep: bool) -> None:
        """(under both locks) A batch that ended at ``at`` goes to the accumulator (``keep``:
        ``Accumulator.add``); the one that reaches our share marks when (``share_at``: a slower
        member's READY is timed from it, ``pacing.Pacing.round_committed``)."""
        self.acc.add(batch_size, self.version, keep=keep)
        if self.acc.samples - batch_size < self.share() <= self.acc.samples:
            self.share_at = at

    def batch_finished(self, batch_size: int, began: float, measured: bool) -> None:
        """(under both locks) ``step`` began at ``began``: the compute time since the last one is
        counted, and no batch is in progress until ``step_ended``."""
        self.compute_s += began - self.step_end
        self.compute_n += 1
        self.pacing.computed(began - self.step_end)
        self.pacing.step_began(began if measured else None, measured and self.lockstep())
        self.batch = batch_size
        self.computing = False

    def step_ended(self) -> int:
        """(``params_lock`` held) ``step`` returns: the next batch computes on this version.
        Returns the updates applied while it waited (and resets them)."""
        applied, self.applied_waiting = self.applied_waiting, 0
        with self.lock:
            self.computing_on, self.computing = self.version, True
            self.step_end = time.perf_counter()
            if self._window_opens:
                self.window_began, self._window_opens = self.step_end, False
        return applied

    def add_pseudo_gradient(self) -> bool:
        """(both locks held) Local-steps mode: the pseudo-gradient owed goes to the accumulator.
        False where the inner steps diverged: left out, counted as dropped (``LocalSteps.contribute``
        started the model again)."""
        if self.staleness:  # (whether step waits for this one: the CPU time waited so far, ``pacing``)
            self.pacing.cpu_sampled(cpu_times())
        local = self.local
        self._window_opens = True  # (by time: the next window begins as this step returns)
        if local.auto:  # (the next window from the rings and steps measured so far: ``round_window``)
            local.window_s = auto_window(local.window_s, self.pacing.exchange, self.pacing.compute_mean,
                                         waits=auto_waits(self.round_members()))
        delta, samples = local.contribute(into=self.acc.begin_writing())
        if delta is None:
            self.dropped += samples
            return False
        self.acc.add_weighted(delta, samples, self.version)
        return True

    # -- applying (``params_lock`` held) ----------------------------------------------------------------
    def pop_update(self) -> CommittedUpdate | None:
        with self.lock:
            return self.queue.popleft() if self.queue else None

    def update_applied(self, update: CommittedUpdate) -> None:
        with self.lock:
            self.params_point = update.point
            self.version += update.summed is not None
            if update.ours is not None:  # (a peer alone: the ring's result was our own buffer)
                self.acc.release(update.ours)

    def applied_alone(self, batch_size: int) -> tuple[RoundMetrics, bool]:
        """A batch applied at once (alone): the versions move on, it is listed for its round.
        Returns its metrics and whether it was the run's last version."""
        with self.lock:
            self.version += 1
            self.committed += 1
            self.applied_waiting += 1
            r, last = self.solo.applied(batch_size, self.version, time.time())
            return self.metrics(r, self.version, 1, batch_size, batch_size, 0, 0.0), last

    def take_restore(self) -> dict | None:
        """A handed-over state to load now, if any (it is no longer waiting)."""
        with self.lock:
            state, self.restore = self.restore, None
        return state

    def state_load_ended(self, version: int, point: SyncPoint | None, stepped: int) -> int:
        """A handed-over state is loaded: the versions are its own, what was added since the
        load began (and ``stepped`` inner steps) is void (returned, counted), and a round waiting
        for us is told at the next step."""
        with self.lock:
            self.version = self.committed = self.computing_on = version
            self.params_point = point
            void = self.acc.void() + stepped
            self.dropped += void
            self.want_step = True
        return void

    def take_reconcile(self) -> tuple[dict, SyncPoint, SyncPoint] | None:
        """The leader's state, once our parameters reach its point (then it no longer waits):
        (state, its point, ours)."""
        with self.lock:
            if self.reconcile is None or self.params_point is None:
                return None
            (state, point), here = self.reconcile, self.params_point
            if here.version < point.version:
                return None  # not there yet
            self.reconcile = None
        return state, point, here

    def loaded(self, version: int) -> None:
        """(before entering, one thread) A checkpoint at ``version`` was loaded."""
        self.version = self.committed = self.computing_on = version

    def unapplied(self) -> int:
        """Samples stepped that no round took (leaving)."""
        with self.lock:
            return self.acc.samples + (self.local.samples if self.local is not None else 0)
