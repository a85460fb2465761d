"""``AsyncPeer``: a training loop's member of a cluster, for asyncio programs (``p2ptrain.Peer``,
in ``sync_peer``, is the same for ordinary loops).

    async with p2ptrain.AsyncPeer(model, optimizer, staleness=1, compression="int8") as peer:
        for x, y in loader:
            loss = F.cross_entropy(model(x.to(peer.device)), y.to(peer.device))
            loss.backward()
            await peer.step(batch_size=len(x))

How it works. The cluster (rounds, ring, discovery) runs on its own event loop on a daemon
thread (``LoopThread``), so a forward or backward that holds the caller's thread (or its
event loop) never stalls a ring. ``step`` adds the batch's gradient times its sample count
into an accumulator on the model's device (``Accumulator``) and notes the parameter version
it was computed on (the version counts the updates applied here). At a round's start the
cluster takes the accumulator (``take``: swapped for a fresh one, so compute goes on); on
commit every member holds ``sum(G_i)`` and ``sum(n_i)``. That averaged gradient is queued
(``apply``) and applied in round order inside the next ``step``, on the caller's thread: set
into ``p.grad``, clipped (``clip_grad_norm``), the optimizer steps (its own step hooks see
it), then ``scheduler`` steps: once per applied update. Parameters change only inside
``step``, never under a forward or a backward.

Alone (no other live peer known, gradient mode), a round would carry each batch to the
cluster's thread and back for nothing: ``step`` applies the batch at once, as the plain loop
would, and the cluster commits its round afterwards (``solo``, ``cluster.trainer_api``), leaving
that mode before anything else happens (a peer linked, a state asked for).

Who owns what. What the caller's thread and the cluster's share (the accumulator, our
contribution, the queue of committed updates, the versions, the batch in progress, the state
loads waiting, the counters, the two locks) has one owner, ``_state`` (``state.TrainerState``:
its docstring says which thread calls which operation, under which lock). The parts, each a
plain class in its own module owning what only it uses: ``_lifetime`` (``lifetime.Lifetime``:
the loop thread, ``closed``, and the crossings both front ends make; ``lifetime_of`` hands it to
``sync_peer.Peer``); ``_contributor`` (``contributions.Contributor``: the trainer the cluster is
given, ``cluster.trainer_api``, the ``wait`` a blocked ``step`` runs and the ``flush`` on
leaving, on the cluster's thread; when to contribute is ``contribution_decision``'s);
``_updater`` (``updates.Updater``: applying committed updates, loading handed-over states,
checkpoints; ``metrics``, ``history``, ``corrected``); ``_feed`` (``backward_feed``, overlap's
hooks). This module is the caller's side: settings (set once), the async front end, the step's
work (``_begin_step``, ``_end_step``), opening and leaving. The trainer package's docstring
traces a gradient's trip to the ring and an update's back.

Staleness. A gradient computed on version v and applied to version V has staleness V - v.

- 0: ``step`` returns once the round holding its batch was applied: DDP's mathematics.
- tau >= 1 (stale-synchronous): rounds run at the network's pace and each member contributes
  what it has, up to its share of the target batch (``target_batch_size``; default members x
  its batch, DDP's, and beside a slower member those of its batches that end before the
  slower one's is due: ``pacing``): a member holding that blocks in ``step`` until a round takes it
  (the next batch is computed while the ring runs, unless measured timing shows that
  overlapping would not pay for the staleness of one it costs every gradient: then the member
  waits for its round as at staleness 0; ``pacing``). Without a bound, a device faster than the
  ring piled dozens of batches into each update at one learning rate, and progress per sample
  collapsed. A member whose batch in progress would be staler than tau after the round being
  collected does not contribute yet, so the round waits for it (a bounded while:
  ``contributions``): the fastest peer runs at most tau updates ahead of the slowest, a slow
  peer contributes fewer samples, and nothing computed within the bound is dropped. Anything
  staler than tau when its round starts is dropped and counted (``dropped``).

Overlap (``overlap=True``, staleness 0; ``overlap``): hooks write each gradient into the
accumulator's buffer as backward makes it (``_feed``, a ``BackwardFeed``; its ``filling``, read
by ``take`` under the state's lock), a round takes that buffer once its ring's first bucket is
written, and the ring reads each range once written; ``step`` confirms the batch (``BackwardFeed.filled``) or withdraws it
and adds the batch as without overlap.

Local steps (``sync_every=H``, DiLoCo; ``local_steps``): ``step`` runs the user's optimizer on
the batch at once (and the scheduler, per inner step); after H inner steps (or, with a window
``sync_every="2s"`` or ``"auto"``, after the first step ending once the window since the last
contribution passed: each peer the steps that fit, ``round_window``) the parameter change
goes to the accumulator as a pseudo-gradient, and a committed round is an outer Nesterov step
on parameters every replica holds alike. At staleness 0 ``step`` waits for that round; at >= 1
it steps on while the ring runs and while a round waits for slower peers' inner steps, unless
this machine has no core to spare for the ring beside them: then it waits as at 0 (``pacing``).

Leaving: at staleness >= 1 (and in local-steps mode) a normal exit first waits (at most
``contributions.FLUSH_S``) until this peer's samples are applied (in local-steps mode the inner
steps not contributed yet go in one more round), and two rounds more for what the others
computed meanwhile. Loops should end with the cluster, not after their own steps: a faster
peer takes more steps, and one that left early could leave the others short of
``min_peers``. With ``max_rounds`` or ``duration`` the run's end is the cluster's
(``cluster.ending``): ``while not peer.finished``, and every member leaves after the same
update with the same parameters; without, count the cluster's updates (``while peer.version
< n``).

State: ``snapshot``/``restore`` (``Contributor``) serve the cluster's state transfer; a restore
lands at the next safe point (in ``step``) and voids the gradients accumulated before it.
``state_dict``/``load_state_dict`` are for checkpoints (load before entering).

Failure: ``step`` raises ``GroupError`` when no round takes or applies its batch within
``step_timeout``, whatever stopped the cluster (``FingerprintError``, ...), and
``ClosedError`` after ``close``: never a bare timeout.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from p2ptrain.net import auth, tls
from p2ptrain.trainer.accumulator import RoundMetrics
from p2ptrain.trainer.apply import optimizer_step
from p2ptrain.cluster.cluster import Cluster
from p2ptrain.codecs import parse_codec
from p2ptrain.trainer.contributions import Contributor
from p2ptrain.trainer.updates import Updater
from p2ptrain.device import check_numpy_bridge, device_kind, pick_device
from p2ptrain.net.discovery import Discovery, peer_list
from p2ptrain.errors import ClosedError, ConfigError
from p2ptrain.identity import new_peer_id
from p2ptrain.taskset import TaskSet
from p2ptrain.trainer.local_steps import local_steps, outer_whole
from p2ptrain.trainer.lifetime import Lifetime, Work
from p2ptrain.trainer.backward_feed import BackwardFeed
from p2ptrain.trainer.overlap import ScaledStep, unscale
from p2ptrain.cluster.membership import genesis
from p2ptrain.trainer.contribution_decision import pseudo_gradient_due
from p2ptrain.trainer.state import TrainerState
from p2ptrain.trainer.options import (PEER_TIMEOUT, check_model_and_optimizer, check_options, listen_address,
                                      local_steps_defaults, own_module, round_config)
from p2ptrain.trainer.prediction import WeightPredictor
from p2ptrain.trainer.step_checks import StepGuard, Trainable, sample_count
from p2ptrain.cluster.rings import KEEP_RESULTS
from p2ptrain.cluster.rounds import SyncPoint
from p2ptrain.cluster.settings import shared
from p2ptrain.cluster.fingerprint import model_fingerprint, param_checksum

if TYPE_CHECKING:
    from typing_extensions import Self

log = logging.getLogger("p2ptrain.trainer.peer")

RECONCILE_EVERY = 10  # updates between two comparisons of the parameters with the leader's (``drift``)


class AsyncPeer:
    """One member of a training cluster, for asyncio programs. See the module docstring.

    Keywords are the ``join`` flags: ``cluster``, ``secret``, ``peers``, ``listen``,
    ``discovery``, ``compression``, ``staleness``, ``min_peers``, ``device`` (None: where the
    model is; else the model is moved there). ``clip_grad_norm`` clips each averaged gradient;
    ``scheduler`` steps once per applied update. ``reconcile_every``: compare a sketch of the
    parameters with the leader's after every that many updates (0: never; ``cluster.drift``);
    a member whose drift passes ``drift.TOLERANCE`` (device kinds round differently, and more
    than rounding made them differ) loads the leader's parameters. ``target_batch_size`` (with
    staleness >= 1): the most samples one update averages (default: members x this peer's
    batch, and a faster member's batches that end before a slower member's is due: ``pacing``);
    each member contributes at most its share (that over members, whole batches).
    ``weight_prediction`` (with staleness >= 1): batches are computed on the parameters moved
    on by the last update, where they will nearly be when applied (``prediction``); the model
    holds those between steps, ``state_dict`` the true ones. ``seed``: the seed the model and
    data come from, compared with the other peers' (None: not compared). ``compression``,
    ``staleness``, ``target_batch_size`` and ``seed`` must be the same on every peer: a peer
    that differs is refused, and one that has trained nothing with nobody else raises
    ``SettingsError`` from ``step`` (``cluster.settings``). ``max_rounds``, ``duration``: the
    cluster's run ends at its version ``max_rounds`` after the one this peer starts from, or
    ``duration`` seconds after its leader started (on the leader's clock), for every member at
    once; ``finished`` says so. ``peer_timeout``: a member silent a quarter of this (at least
    2.5 s: a lid closed, a cable pulled) is left out of rounds, all of it dropped (default 10,
    >= 5). ``tls_cert``, ``tls_key``, ``tls_ca``: PEM files (``tls-init`` makes them): mutual TLS
    on every link (``net.tls``)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, cluster: str = "default",
                 secret: str | bytes | None = None, peers: Sequence[str] = (), listen: str = "0.0.0.0:0",
                 discovery: bool = True, interface: str | None = None, compression: str = "none",
                 staleness: int = 0, target_batch_size: int | None = None, min_peers: int = 1,
                 device: str | torch.device | None = None, clip_grad_norm: float | None = None,
                 scheduler: Any = None, step_timeout: float = 300.0, reconcile_every: int = RECONCILE_EVERY,
                 weight_prediction: bool = False, seed: int | None = None, max_rounds: int | None = None,
                 duration: float | None = None, sync_every: int | str | None = None, outer_lr: float | None = None,
                 outer_momentum: float | None = None, overlap: bool = False, peer_timeout: float = PEER_TIMEOUT,
                 tls_cert: str | None = None, tls_key: str | None = None, tls_ca: str | None = None):
        check_options(staleness=staleness, target_batch_size=target_batch_size, min_peers=min_peers,
                      clip_grad_norm=clip_grad_norm, reconcile_every=reconcile_every,
                      step_timeout=step_timeout, weight_prediction=weight_prediction, max_rounds=max_rounds,
                      duration=duration, cluster=cluster, sync_every=sync_every, outer_lr=outer_lr,
                      outer_momentum=outer_momentum, overlap=overlap, peer_timeout=peer_timeout)
        self._tls = tls.load(tls_cert, tls_key, tls_ca)  # (None: no TLS; a ConfigError for a bad file)
        check_model_and_optimizer(model, optimizer)
        check_numpy_bridge()
        outer_lr, outer_momentum = local_steps_defaults(outer_lr, outer_momentum, sync_every)
        if seed is not None and (type(seed) is not int or seed < 0):
            raise ConfigError(f"seed must be an int >= 0 (or None: not compared), got {seed!r}")
        # What every peer must share: refused at the handshake where it differs (``cluster.settings``).
        self._settings = shared(compression=parse_codec(compression).spec, staleness=staleness,
                                target_batch_size=target_batch_size, seed=seed, sync_every=sync_every,
                                outer_lr=outer_lr, outer_momentum=outer_momentum, outer_whole=outer_whole(sync_every))
        if device is not None:
            model.to(pick_device(device))
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.module = own_module(model)  # (names and states: the model's own, compiled or not)
        self._trainable = Trainable(self.module)  # (what step refuses: ``step_checks``)
        self.params = self._trainable.params
        if not self.params:
            raise ConfigError("the model has no parameters that require gradients")
        self.device = self.params[0].device
        if any(p.device != self.device for p in self.params):
            raise ConfigError("the model's parameters are on several devices: p2ptrain trains a model on one device")
        if sync_every is not None and any(p.dtype != torch.float32 for p in self.params):
            raise ConfigError("local-steps mode (sync_every) needs float32 trainable parameters (use autocast for "
                              "lower precision)")
        self.peer_id = new_peer_id()
        self.staleness, self.min_peers = staleness, min_peers
        self.clip_grad_norm, self.step_timeout = clip_grad_norm, step_timeout
        self.reconcile_every = reconcile_every
        self.target_batch_size = target_batch_size
        self.max_rounds, self.duration, self.peer_timeout = max_rounds, duration, peer_timeout
        self._peers = peer_list(peers)
        self._cluster_name, self._secret, self._compression = cluster, auth.secret_from(secret), compression
        self._discovery_on, self._interface = discovery, interface
        self._host, self._port = listen_address(listen)
        self.cluster: Cluster | None = None  # built on entering (after a checkpoint may have been loaded)
        self.discovery: Discovery | None = None
        self._tasks = TaskSet()  # on the cluster's loop: the proposer (the cluster and discovery own theirs)

        # What the caller's thread (step) and the cluster's share, in one owner (``state``: who calls
        # what, under which lock); the parts below change it through its operations.
        self._state = st = TrainerState(
            self.params, self.device, staleness=staleness, min_peers=min_peers, target_batch_size=target_batch_size,
            members=lambda: self.members, predicted=weight_prediction,
            local=local_steps(self.params, sync_every, outer_lr, outer_momentum, optimizer),
            predictor=WeightPredictor(self.params) if weight_prediction else None)
        self.unapplied = 0  # samples stepped that no round took before this peer left (set on closing)
        self._steps_past_end = 0  # steps begun once finished (the caller's thread only)
        self._checksum = b""
        # The parts; each owns its own state (the module docstring).
        self._lifetime = Lifetime(self.peer_id[:8], Work(  # the loop thread, open or closed
            prepare=self._prepare, open=self._open, leave=self._leave, begin_step=self._begin_step,
            wait_step=lambda: self._contributor.wait_step(), end_step=self._end_step,
            flush=lambda: self._contributor.flush()))
        # Overlap: the hooks that write each gradient into the round's buffer as backward makes it.
        self._feed = BackwardFeed(st, self._lifetime, self._notify) if overlap else None
        self._updater = Updater(self, st, self._lifetime, self.device, look=lambda: self._contributor.look())
        self._contributor = Contributor(self, st, self._lifetime, self._updater, self._feed, self._notify,
                                        step_timeout)  # the cluster's trainer, on its thread

    @property
    def members(self) -> int:
        """Live synced peers, this one included (updated as the cluster hears of them; any thread may read it)."""
        return self.cluster.members if self.cluster is not None else 0

    @property
    def finished(self) -> bool:
        """The cluster's run is over (its ``max_rounds`` version, or its leader's ``duration``)
        and this peer has applied its last update: leave the loop (``while not peer.finished``).
        Every member finishes at the same version, with the same parameters; the version is
        ``cluster.finished.version``. Not while a state load waits for the next step (a joiner
        that loaded the cluster's state just before the end: it would end with its own
        parameters at the cluster's version)."""
        st = self._state
        with st.lock:
            return st.finished and not st.queue and st.restore is None

    @property
    def version(self) -> int:
        """Updates applied to the parameters here."""
        return self._state.version

    @property
    def dropped(self) -> int:
        """Samples dropped: staler than the bound, void after a state load, or left out as not finite."""
        return self._state.dropped

    @property
    def staleness_max(self) -> int:
        """The largest staleness of a gradient of ours applied so far."""
        return self._state.staleness_max

    @property
    def metrics(self) -> RoundMetrics | None:
        """The last update applied here."""
        return self._updater.metrics

    @property
    def history(self) -> collections.deque[RoundMetrics]:
        """The last updates applied here (``RoundMetrics``, newest last)."""
        return self._updater.history

    @property
    def corrected(self) -> int:
        """The leader's parameters loaded here because ours drifted past the tolerance."""
        return self._updater.corrected

    def param_checksum(self) -> str:
        """``tasks.param_checksum`` of the parameters every replica holds alike: the model's, the
        true ones where it holds predicted ones (``weight_prediction``), the outer ones in
        local-steps mode. Equal on peers that applied the same updates. Call it between steps."""
        return self._updater.parameters_checksum()

    def state_dict(self) -> dict:
        """Everything a resumed loop needs: model, optimizer, ``scheduler`` (None without one),
        version, and the cluster's point at the last applied update. Save it as you save
        anything (``torch.save``). Call it between steps."""
        return self._updater.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Load a ``state_dict()`` before entering: the peer continues that lineage, so peers
        restarted from the same checkpoint form one cluster again, and the ``scheduler`` (if
        both the state and this peer have one) continues at the saved update's learning rate."""
        self._updater.load_state_dict(state)

    # -- lifetime (the async front end over ``_lifetime``; sync_peer.Peer blocks on the same) ---
    async def __aenter__(self) -> Self:
        with self._lifetime.opening() as opened:
            await asyncio.wrap_future(opened)
        return self

    async def __aexit__(self, exc_type=None, exc=None, tb=None) -> None:
        """Leave politely. On a normal exit (staleness >= 1) first wait, a bounded while, for
        this peer's last samples to be applied, so its last steps are not lost."""
        with self._lifetime.closing(flush=exc_type is None) as left:
            if left is not None:
                await asyncio.wrap_future(left)

    async def close(self) -> None:
        await self.__aexit__()

    def _prepare(self) -> None:
        """(``Lifetime.opening``, the caller's thread) The point the parameters start from."""
        checksum = hashlib.blake2b(param_checksum(self.module).encode(), digest_size=16).digest()
        self._state.params_point = self._updater.start or SyncPoint(0, genesis(checksum), -1, 0)
        self._checksum = checksum

    async def _open(self) -> None:
        st = self._state
        config = round_config(self.min_peers, st.params_point, self.max_rounds, self.duration,
                              asyncio.get_running_loop().time(), discovery=bool(self._discovery_on),
                              peer_timeout=self.peer_timeout)
        self.cluster = Cluster(peer_id=self.peer_id, trainer=self._contributor, checksum=self._checksum,
                               cluster=self._cluster_name, secret=self._secret, host=self._host, port=self._port,
                               compression=self._compression, config=config,
                               start=st.params_point, fingerprint=model_fingerprint(self.module),
                               settings=self._settings, tls=self._tls)
        entered = False
        try:  # (cancelled midway, by an interrupted waiter: what was opened is closed again)
            await self.cluster.__aenter__()  # (failing, it opened nothing; cancelled, its mesh may have)
            entered = True
            for array in st.acc.result_buffers(KEEP_RESULTS):  # (pinned on CUDA: the sum returns at full speed)
                self.cluster.recycle(array)
            # Beacons announce the mesh's port; discovery (or just --peers) proposes addresses.
            self.discovery = Discovery(self._cluster_name, self.peer_id, self.cluster.port, self._secret,
                                       device=device_kind(self.device), static_peers=self._peers,
                                       interface=self._interface, enabled=self._discovery_on)
            await self.discovery.__aenter__()
        except BaseException:
            await (self.cluster.close() if entered else self.cluster.mesh.close())
            raise
        self._tasks.spawn(self._propose())
        st.step_end = st.window_began = time.perf_counter()  # (no step runs yet: the caller waits for the opening)
        st.pacing.step_began(None)
        self._step_guard = StepGuard(self.optimizer)  # (last: nothing after it can fail the opening)

    async def _leave(self) -> None:
        """(``Lifetime.closing``, the loop thread) After the flush, if any, and ``closed`` is set."""
        self._step_guard.close()  # (the optimizer is the caller's own again)
        self._contributor.cancel_linger()
        if self._feed is not None:
            self._feed.close()
        await self._tasks.close()
        await self.cluster.close()
        st = self._state
        with st.params_lock:  # a state handed over after the loop's last step (the cluster's, at the
            self._updater.load_restore()  # end), and rounds committed until we left: our records say so
            self._updater.apply_queue()
        # (a round in flight as we left put its share back; inner steps never contributed)
        self.unapplied = st.unapplied()
        if self.unapplied:
            log.info("left with %d samples that no round took (unapplied)", self.unapplied)
        await self.discovery.__aexit__(None, None, None)
        if st.predictor is not None:  # the model ends on the true parameters
            with st.params_lock:
                st.predictor.restore()
        if st.local is not None:  # ... on the outer ones, identical on every replica
            with st.params_lock:
                st.local.finish()
        self._contributor.wake()

    async def _propose(self) -> None:
        """Keep offering every address heard or given to the mesh (it skips those linked)."""
        while True:
            for host, port in self.discovery.addresses():
                self.cluster.propose(host, port)
            await asyncio.sleep(0.5)

    # -- the training loop's side -------------------------------------------------------------
    async def step(self, batch_size: int) -> int:
        """Contribute this batch's gradients (call it after ``loss.backward()``) and apply the
        updates committed since the last call. Returns how many were applied."""
        waiting = self._lifetime.begin_step(batch_size)
        if waiting is not None:
            await asyncio.wrap_future(waiting)
        else:  # yield even so: a loop whose step never waits (staleness >= 1) would starve the
            await asyncio.sleep(0)  # caller's other tasks, and its signal handlers (Ctrl-C) with them
        return self._lifetime.end_step()

    def _begin_step(self, batch_size: int, scaled: ScaledStep | None = None) -> bool:
        """(``Lifetime.begin_step``) Accumulate this batch, apply what is queued. True: step must wait.
        ``scaled``: the gradients carry GradScaler's loss scale (``overlap.ScaledStep``)."""
        if self._lifetime.closed:
            raise ClosedError("this peer is closed: create a new one to train again")
        if self.cluster is None:
            raise ClosedError("this peer is not open yet: enter it first (with peer: / async with peer:)")
        batch_size = sample_count(batch_size)
        self._trainable.check()
        self.cluster.check()
        # A loop that counts its own steps spins here once the run is over: say so, at its second
        # step (``while not peer.finished`` may begin one: the end can come while its batch computes).
        self._steps_past_end += self.finished
        if self._steps_past_end == 2:
            log.warning("the cluster's run is over: step() applies nothing more; leave the loop "
                        "(while not peer.finished)")
        began, st, feed = time.perf_counter(), self._state, self._feed
        with st.params_lock:
            self._contributor.check_diverged()  # (after a batch left out as NaN or inf only)
            void = self._updater.load_restore()
            with st.lock:
                measured = bool(self.staleness) and st.local is None and self.members > 1  # (a batch's period)
                st.batch_finished(batch_size, began, measured)
                skip, scale = (False, None) if scaled is None else (scaled.skip, scaled.scale)
                alone = st.solo.on and not void and not skip
                filling = feed.confirm(batch_size, scaled) if feed is not None else None
                if void or skip:  # computed on parameters just replaced; or GradScaler skips it
                    if filling is not None:
                        feed.withdraw(filling, "the parameters were replaced (a state load)" if void else
                                      "GradScaler found inf or NaN in its gradients")
                    for p in self.params:
                        p.grad = None
                    if void:  # (GradScaler's skipped batch is no sample of any round)
                        st.dropped += batch_size
                elif filling is not None and not alone and feed.filled(filling, batch_size, scale):
                    pass  # (backward wrote it into the round's buffer: ``overlap``)
                else:
                    if filling is not None and alone:  # (solo began while backward ran: it applies as it is)
                        feed.withdraw(filling, "this peer is alone now")
                    if scale is not None:  # (the gradients as GradScaler would have unscaled them)
                        unscale(self.params, scale)
                    if st.local is None and not alone:  # (kept as it is until a round needs a vector:
                        #  ``Accumulator``; not while a next batch computes beside it, but alone, or where
                        #  step waits for the round as at staleness 0: ``lockstep``)
                        st.add_batch(batch_size, began, keep=self.staleness == 0 or self.members <= 1
                                     or st.lockstep())
                # An inner step tells the cluster nothing: it hears when the pseudo-gradient is ready
                # (``_inner_step``), and a round waiting for it keeps ``want_step`` for its linger.
                # (Asked at each step, the loop thread woke for nothing: 0.9 ms a step, 4 peers on 2 cores.)
                notify = st.take_want_step() if st.local is None or void else False
            if alone:
                self._updater.apply_queue()  # (what was committed before we went solo)
                notify = self._updater.apply_alone(batch_size)
            elif st.local is not None:
                notify = self._inner_step(batch_size, void) or notify
            else:
                self._updater.apply_queue()
        if notify:
            self._notify()
        if alone and not notify:  # (applied: nothing to wait for)
            return False
        with st.lock:
            return st.must_wait()

    def _end_step(self) -> int:  # (``Lifetime.end_step``)
        with self._state.params_lock:
            self._updater.load_restore()
            applied = self._updater.apply_queue()
            return applied + self._state.step_ended()

    def _inner_step(self, batch_size: int, void: bool) -> bool:
        """Local-steps mode (``params_lock`` held): the user's optimizer steps on this batch,
        the outer updates committed since land, and once ``sync_every`` inner steps are owed (or
        its window has passed since the last contribution: rounds by time)
        and the last contribution is applied, the pseudo-gradient goes to the accumulator.
        True: a contribution is ready (the cluster must hear of it)."""
        st = self._state
        if not void:
            optimizer_step(self.params, self.optimizer, self.scheduler, self.clip_grad_norm)
            st.local.stepped(batch_size)
        self._updater.apply_queue()
        with st.lock:
            local = st.local
            if not pseudo_gradient_due(steps=local.steps, every=local.every, accumulated=st.acc.samples,
                                       out=st.out is not None, window_s=local.window_s, since=st.window_began,
                                       now=time.perf_counter(), step_s=st.pacing.compute_mean):
                return False
            return st.add_pseudo_gradient()

    def _notify(self, tell: Callable[[], None] | None = None) -> None:
        """Tell the cluster this peer has something now (or call ``tell`` there), from whichever
        thread we are on."""
        self._lifetime.call_soon(tell or self.cluster.contribution_available)


def lifetime_of(peer: AsyncPeer) -> Lifetime:
    """The part both front ends drive (``lifetime``): ``sync_peer.Peer``'s way to the peer's loop
    thread, as ``AsyncPeer``'s own ``__aenter__``, ``__aexit__`` and ``step`` use it."""
    return peer._lifetime
