"""``Cluster``: the asyncio host of the round machine. Thin: events in, actions carried out.

One actor task owns the ``RoundMachine``. Everything that happens (a message from a peer, a
tick, a peer admitted or lost by the ``Mesh``, a contribution taken, a ring finished) becomes
an event on its queue; the actor hands it to the machine and carries out the actions it
returns, in order:

    Send / Broadcast  -> mesh.post (never waits: a peer that stopped reading holds up no one)
    Contribute(r)     -> trainer.take(): this round's gradient sum and sample count
    StartRing(r, view)-> a ring-allreduce over the mesh's chunk channels, in view order (``rings``)
    Apply(r, total)   -> trainer.apply(summed, total, used)
    PutBack(r)        -> cancel the ring if it runs; trainer.put_back(contribution) (left out: not finite)
    Resync(donor)     -> fetch a snapshot from it (``statesync``), ``trainer.restore`` it, then
                         ``on_synced`` with its SyncPoint; another synced member if that fails;
                         ``on_load_failed`` once no linked peer is left to ask, or MAX_FETCH_TRIES failed
    Stall / Waiting / Log -> logging
    Finish(version)   -> ``finished``; trainer.finish(): the cluster's run is over (``ending``)

What one round holds here (our contribution, when its ring began, the ring, its sum) is a
``rings.Round``, one per round in flight in ``_rounds``, from Contribute to Apply or PutBack.

``reconcile`` compares parameter sketches with the leader's and corrects a drift past the
tolerance; ``records`` keeps the applied rounds; ``rings`` the rings, their sums and error
feedback's residual (a lossy codec's dropped part, owed to the next round).

The ``trainer`` is what trains: it owns the accumulator and the optimizer (``Contributions``).
Every peer starts as a founder of its own state (``start``: genesis, or a checkpoint's point);
meeting a cluster that is ahead, or a bigger side after a split, makes the machine ask for a
``Resync``. Snapshots are served by the actor itself, between events, so the parameters it
captures are exactly those of the machine's ``sync_point()``. A peer of another model or other
shared settings is never handed to the machine, and a peer that nobody takes stops
(``vetting``).

A peer alone (``SoloTrainer``; the machine's solo, ``leader``). With no link and nobody else
known, a round would carry our batch from the trainer's thread to this loop and back for
nothing, and that round trip was most of what a short step cost (a 0.7 ms step took 1.1). So
between events the trainer applies each batch at once and lists it; before every event the
actor commits what is listed, and any event but a tick (a peer linked, a message, a state
asked for, leaving) ends solo first, once no batch is being applied: whatever follows sees the
chain and the trainer at the same version. After each event the actor goes solo again if it may.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
import logging

import numpy as np

from p2ptrain.net import auth
from p2ptrain.cluster import roundmsg as msg
from p2ptrain.codecs import parse_codec
from p2ptrain.errors import FingerprintError, P2PTrainError, RemoteProtocolError
from p2ptrain.cluster.faultlog import FaultLog
from p2ptrain.cluster.membership import DEAD, SYNCED, WINDOW, genesis
from p2ptrain.net.mesh import IDLE_TIMEOUT, Mesh
from p2ptrain.net.tls import TLS
from p2ptrain.cluster.rings import Round, Rings
from p2ptrain.cluster.rounds import RoundConfig, RoundMachine, SyncPoint
from p2ptrain.cluster.silence import silence, silent, stillness
from p2ptrain.cluster.sleepwatch import SleepWatch
from p2ptrain.cluster.records import Loaded, RoundLog, RoundRecord
from p2ptrain.cluster.reconcile import PARAMS, Reconciler
from p2ptrain.cluster.statesync import LINEAGE, StateTransfer
from p2ptrain.cluster.trainer_api import Contributions, SoloTrainer
from p2ptrain.cluster.vetting import Vetting
from p2ptrain.taskset import TaskSet
from p2ptrain.trace import NO_TRACE

log = logging.getLogger("p2ptrain.cluster.cluster")
TICK = 0.1
RETRY_FETCH = 1.0  # seconds before a failed state download is tried again (from another member)
MAX_FETCH_TRIES = 3  # failed downloads in a row before the round machine decides again (``_fetch_state``)
SNAPSHOT_WAIT = 10.0  # seconds a member waits for its trainer to reach a round boundary before refusing


def _brief(header: dict) -> dict:
    """A round message for a debug line: without its long lists (a STATUS's log and window)."""
    return {k: v for k, v in header.items() if k not in ("log", "window")}


class Cluster:
    """Rounds over a mesh of peers. ``async with Cluster(...) as c:``; ``c.propose(host, port)``."""

    def __init__(self, *, peer_id: str, trainer: Contributions, checksum: bytes, cluster: str = "default",
                 secret: bytes | None = None, host: str = "127.0.0.1", port: int = 0, compression: str = "none",
                 config: RoundConfig | None = None, ring_timeout: float = 30.0, fingerprint: list | None = None,
                 start: SyncPoint | None = None, settings: dict | None = None, tls: TLS | None = None):
        self.peer_id = peer_id
        self.trainer = trainer
        self._secret = secret
        self.codec = parse_codec(compression)
        self.machine = RoundMachine(peer_id, config)
        self._sleep = SleepWatch(stillness(self.machine.config))  # (a lid closed: ``on_woken``)
        self.mesh = Mesh(cluster=cluster, peer_id=peer_id, secret=secret, host=host, port=port, tls=tls,
                         on_message=self._on_message, on_lost=self._lost,
                         on_admitted=lambda p, info: self.vetting.admitted(p, info),
                         on_state=lambda p, f: self.transfer.on_frame(p, f),
                         idle_timeout=max(IDLE_TIMEOUT, 3 * self.machine.config.peer_timeout))
        self.transfer = StateTransfer(self.mesh, fingerprint or [], on_ask=lambda p, i, only: self._post("ask", p, i, 0.0, only),
                                      on_foreign=lambda p, diff: self._post("foreign", p, diff))
        if fingerprint is not None:
            self.mesh.info["model"] = self.transfer.digest
        self.vetting = Vetting(peer_id, self.mesh, self.transfer, self.machine, settings, self._post)
        self._start = start or SyncPoint(0, genesis(checksum), -1, 0)
        self._faults = FaultLog()  # the lines about refused messages, a peer's at most once a minute
        self._tasks = TaskSet()  # every task of this cluster: actor, ticker, rings, state downloads
        self._fetcher: asyncio.Task | None = None  # (of those: the state download in progress)
        self.rounds = RoundLog()  # applied here, newest last
        self.wire_bytes = self.raw_bytes = 0  # sent by this peer's rings, compressed / uncompressed
        self.trace = NO_TRACE  # or a p2ptrain.trace.Tracer: rounds, rings and applies as spans
        self.loads: list[Loaded] = []  # the states loaded from members (joining, or healing a split)
        self.rings = Rings(peer_id, self.mesh, self.codec, ring_timeout, self._tasks,
                           on_done=lambda *done: self._post("ring_done", *done))  # (r, ok, checksum, void)
        self.applied = 0  # rounds applied here
        self.members = 1  # live synced peers, us included, as of the last event (safe to read from any thread)
        self.reconciler = Reconciler(peer_id, self.machine, self.transfer, trainer, self._tasks)
        self._checksum = checksum
        self._events: asyncio.Queue = asyncio.Queue()
        self._rounds: dict[int, Round] = {}  # the rounds in flight here (contributed, ringing, or waiting to)
        self.failure: BaseException | None = None  # what stopped the actor (a bug, the trainer's error)
        self._solo_trainer = trainer if isinstance(trainer, SoloTrainer) else None
        self.finished: msg.Finish | None = None  # the cluster's run is over: its last version and round here

    async def __aenter__(self) -> "Cluster":
        auth.warn_if_open(self._secret)
        await self.mesh.start()
        self._tasks.spawn(self._actor())
        self._tasks.spawn(self._ticker())
        self._post("synced", self._start)
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        """Leave politely (the machine's goodbye, then the mesh's), then stop every task."""
        done = asyncio.get_running_loop().create_future()
        self._post("leave", done)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(done, 2.0)
        await self._tasks.close()
        await self.transfer.close()
        await self.mesh.close()

    def contribution_available(self) -> None:
        """The trainer has something now: rounds waiting for a contribution take it."""
        self._post("take")

    def parameters_at(self, point: SyncPoint, sketch: bytes) -> None:
        """The trainer's parameter sketch (``drift.param_sketch``) once the update ending at
        ``point`` is applied (call on the cluster's loop): the leader tells the members, a
        member compares (``reconcile``)."""
        self._post("params", self.peer_id, {"version": point.version, "digest": point.digest, "sketch": sketch})

    def ring_timing(self, r: int) -> tuple[float | None, float | None]:
        """For the trainer's ``apply`` of round r: seconds since its ring began to move here (the wire's
        share, without waiting for members; None: none started), and ``others_after`` (``Pacing``)."""
        rnd, loop = self._rounds.get(r) or Round(r), asyncio.get_running_loop()
        return None if rnd.ring_began is None else loop.time() - rnd.ring_began, rnd.others_after

    def propose(self, host: str, port: int) -> None:
        """An address to try (from discovery or --peers)."""
        self.mesh.propose(host, port)

    @property
    def reconciled(self) -> int:
        """The leader's parameters downloaded because ours drifted past the tolerance."""
        return self.reconciler.reconciled

    @property
    def port(self) -> int:
        return self.mesh.port

    # -- the mesh's side ------------------------------------------------------------------
    def _on_message(self, peer: str, header: dict) -> None:
        if peer not in self.vetting.foreign:
            self._post("params" if header.get("t") == PARAMS else "message", peer, header)

    def _lost(self, peer: str, why: str) -> None:
        self.transfer.lost(peer, why)  # (a download from it fails now: ``_fetch_state`` asks another)
        self._post("lost", peer, why)

    # -- the actor ------------------------------------------------------------------------
    def _post(self, kind: str, *args) -> None:
        self._events.put_nowait((kind, args))

    async def _ticker(self) -> None:
        while True:
            await asyncio.sleep(TICK)
            self._post("tick")

    def check(self) -> None:
        """Raise what stopped the cluster, if anything did (call from the owner's loop)."""
        if self.failure is not None:
            raise self.failure

    def _stop(self, error: P2PTrainError | None) -> None:
        """The cluster stops for ``error`` (None: it goes on), unless it stopped already."""
        self.failure = self.failure or error

    async def _actor(self) -> None:
        try:
            await self._serve_events()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # latched for the owner: the cluster stops, loudly
            self.failure = exc
            log.error("cluster stopped: %s: %s", type(exc).__name__, exc)

    async def _serve_events(self) -> None:
        loop, machine = asyncio.get_running_loop(), self.machine
        while True:
            await asyncio.sleep(0)  # (the last event's posts reach the socket first: ``Mesh.post`` sends from tasks)
            self._go_solo(loop.time())
            kind, args = await self._events.get()
            now = loop.time()
            slept = self._sleep.slept(now, time.time())
            if slept:  # before this event, which may be a message from before we slept
                await self._carry_out(machine.on_woken(now, slept))
            if machine.solo:
                await self._solo_commit(now, end=kind not in ("tick", "solo_commit")
                                        or not machine.solo_may_go_on(now))
            try:
                if kind == "solo_commit":  # (committed above; its waiter may have stopped waiting, cancelling it)
                    args[0].done() or args[0].set_result(None)
                    continue
                if kind == "tick":
                    for peer, heard in self.mesh.heard(now).items():  # any byte (pings too) is a sign of life
                        machine.table.message(peer, heard)
                    moved = {r: rnd.moved_at for r, rnd in self._rounds.items() if rnd.moved_at is not None}
                    actions = machine.on_tick(now, moved)
                    self.transfer.silent(silent(machine, self.transfer.donors(), now), silence(machine.config))
                    for peer in self.mesh.peers:
                        if machine.table.state(peer) == DEAD:
                            self.mesh.disconnect(peer, "silent too long")
                    self._stop(self.vetting.give_up(now, self.members, self.failure is not None))
                    self._stop(self.vetting.judge_foreign(now, self.failure is not None))
                elif kind == "message":
                    self._mark("<", args[0], args[1])
                    if log.isEnabledFor(logging.DEBUG):
                        log.debug("from %s: %s", args[0], _brief(args[1]))
                    actions = machine.on_message(args[0], args[1], now)
                elif kind == "connected":
                    actions = machine.on_connected(args[0], now)
                elif kind == "lost":
                    actions = machine.on_peer_lost(args[0], now)
                elif kind == "ring_done":  # (its DONE says which of our parameters had a gradient: ``used``)
                    rnd = self._rounds.get(args[0]) if args[1] else None
                    actions = machine.on_ring_done(*args[:2], now, *args[2:], rnd and self.trainer.used(rnd.taken[0]))
                elif kind == "synced":
                    actions = machine.on_synced(args[0], now)
                elif kind == "take":
                    waiting = [rnd for rnd in self._rounds.values() if rnd.waiting]
                    for rnd in waiting:
                        rnd.waiting = False
                    actions = [msg.Contribute(rnd.r) for rnd in waiting]
                elif kind == "params":
                    actions = self.reconciler.on_params(args[0], args[1])
                elif kind == "ask":
                    actions = self._serve(*args)
                elif kind == "sent":  # our snapshot is on its way to a joiner: hold a while more
                    if args[1] is not None:  # (how fast it went: a ring with that peer is no faster)
                        machine.learn_rate(args[0], args[1])
                    actions = machine.hold_for(args[0], now)
                elif kind == "foreign":
                    self.vetting.met_foreign(args[0], args[1], now)
                    self._stop(self.vetting.judge_foreign(now, self.failure is not None))
                    continue
                elif kind == "other_settings":
                    self._stop(self.vetting.other_settings(*args, self.applied))
                    continue
                elif kind == "restored":
                    window = tuple(args[0].pop(LINEAGE, None) or ())
                    self.trainer.restore(args[0])
                    self.rings.forget_residual()  # (owed for gradients that were voided with the accumulator)
                    self.loads.append(Loaded(args[1], self.rounds.total))
                    self.reconciler.forget()
                    log.info("loaded the cluster's state from %s: version %d, round %d",
                             args[2], args[1].version, args[1].round)
                    actions = machine.on_synced(dataclasses.replace(args[1], window=window), now, args[2])
                elif kind == "unloaded":  # (``_fetch_state`` gave up: the rounds held here are void, as at
                    for r in list(self._rounds):  # a Resync, and nothing replaces the accumulator: put back)
                        self._put_back(r)
                    actions = machine.on_load_failed(args[0], args[1], now)
                elif kind == "leave":
                    await self._carry_out(machine.leave(now))
                    args[0].done() or args[0].set_result(None)  # (``close`` stops waiting after 2 s)
                    continue
                else:  # pragma: no cover - our own bug
                    raise RuntimeError(f"unknown cluster event {kind}")
            except RemoteProtocolError as exc:  # (the message is dropped; a flood of them is a line a minute)
                more = self._faults.refused(args[0] if args else "?", now)
                if more is not None:
                    log.warning("peer %s broke the round protocol: %s%s", args[0] if args else "?", exc,
                                f" (and {more} more messages of it since the last line)" if more else "")
                continue
            await self._carry_out(actions)
            self.members = machine.members()  # (at once, not at the next tick: join's loop starts on it)

    def _collecting(self, r: int) -> bool:
        """Round r still waits for its members' batches here (no START heard): our ring, begun
        as we contributed, waits for theirs without its chunk timeout (``member``)."""
        pending = self.machine.pending
        return pending is not None and pending.r == r and not pending.told

    def _mark(self, way: str, peer: str, header: dict) -> None:
        """A round message in the trace: ``way`` is ">" (sent) or "<" (received)."""
        if self.trace.enabled:
            now = self.trace.now()
            self.trace.span(f"{way} {header.get('t')}", "messages", now, now, round=header.get("r"), peer=peer)

    async def _carry_out(self, actions: list) -> None:
        loop = asyncio.get_running_loop()
        for action in actions:
            if isinstance(action, msg.Send):
                if log.isEnabledFor(logging.DEBUG):
                    log.debug("to %s: %s", action.to, _brief(action.msg))
                self._mark(">", action.to, action.msg)
                self.mesh.post(action.to, action.msg)
            elif isinstance(action, msg.Broadcast):
                if log.isEnabledFor(logging.DEBUG):
                    log.debug("to %s: %s", ",".join(action.to), _brief(action.msg))
                self._mark(">", ",".join(action.to), action.msg)
                for peer in action.to:
                    self.mesh.post(peer, action.msg)
            elif isinstance(action, msg.Contribute):
                rnd = self._rounds.setdefault(action.r, Round(action.r))
                pending = self.machine.pending
                view = pending.view if pending is not None else (self.peer_id,)
                taken = self.trainer.take(len(view), alone=pending is not None and self.rings.sums_to_own(view))
                if taken is None:  # the round waits for this peer (its next batch, or a moment)
                    rnd.waiting = True
                    continue
                vector, samples = rnd.taken = taken[:2]
                rnd.ready = taken[2] if len(taken) > 2 else None  # (still being written: overlap, or as the ring reads it)
                log.debug("round %d: contributing %d samples", action.r, samples)
                await self._carry_out(self.machine.on_contribution_ready(action.r, samples, loop.time(),
                                                                         vector.nbytes))
            elif isinstance(action, msg.StartRing):
                rnd = self._rounds[action.r]  # (READY: taken)
                rnd.began = loop.time()
                self.rings.start(rnd, action.view, self.trace, patient=lambda r=action.r: self._collecting(r))
            elif isinstance(action, msg.Apply):
                rnd = self._rounds.get(action.r) or Round(action.r)  # (none: we had no part in it)
                rnd.others_after = msg.others_after(action.view, action.ready, self.peer_id)
                with self.trace("apply", "apply", round=action.r, samples=action.total_samples):
                    self._apply(rnd, action.total_samples, action.used, action.spread)
                self._record(rnd, action.total_samples, action.view)
                if not rnd.waiting:  # (one still waiting is answered at the next take, late: the machine asked)
                    self._rounds.pop(action.r, None)
            elif isinstance(action, msg.PutBack):
                self._put_back(action.r, action.not_finite)
            elif isinstance(action, msg.Resync):
                if self._fetcher is None or self._fetcher.done():
                    self._fetcher = self._tasks.spawn(self._fetch_state(action.donor))
            elif isinstance(action, msg.Stall):
                log.warning("round %d waits %.0f s for %s (%s)", action.r, action.seconds,
                            ", ".join(action.waiting_for), action.phase)
            elif isinstance(action, msg.Waiting):
                log.warning("%s, for %.0f s now; %s", action.why, action.seconds, self.mesh.reach_hint())
            elif isinstance(action, msg.Log):
                log.log(logging.getLevelName(action.level.upper()), "%s", action.text)
            elif isinstance(action, msg.Finish):
                self.finished = action
                log.info("the run is over at the cluster's round %d (version %d): %s", action.r, action.version,
                         action.reason)
                self.trainer.finish()

    # -- a peer alone (``SoloTrainer``) -------------------------------------------------------
    async def commit_solo(self) -> None:
        """Commit the rounds of the batches the trainer applied alone so far (for a checkpoint)."""
        done = asyncio.get_running_loop().create_future()
        self._post("solo_commit", done)
        await done

    def _go_solo(self, now: float) -> None:
        machine, trainer = self.machine, self._solo_trainer
        if (trainer is None or self.failure is not None or self.mesh.peers or self.vetting.foreign
                or self.rings.residual is not None or (self._fetcher is not None and not self._fetcher.done())):
            return  # (error feedback owed from rounds with others: the next round alone carries it)
        r = machine.solo_round()
        if r is None or not trainer.solo_begin(r, machine.version, machine.last_version):
            return
        machine.begin_solo(now)
        self._rounds.pop(r, None)  # (it waited for our batch: none comes)
        log.debug("alone: batches are applied at once from round %d on", r)

    async def _solo_commit(self, now: float, end: bool) -> None:
        """The rounds of the batches applied alone since; with ``end``, back to rounds."""
        trainer, machine = self._solo_trainer, self.machine
        commits = trainer.solo_end() if end else trainer.solo_take()
        actions = machine.commit_solo([(r, samples) for r, samples, _ in commits], now)
        for r, samples, when in commits:
            self.rounds.append(RoundRecord(r, 1, samples, samples, 0, 0, 0.0, when))
        self.applied += len(commits)
        if commits:
            trainer.solo_committed(machine.sync_point(), len(commits))
        if end:
            log.debug("not alone any more: rounds again from round %d on", machine.lead.r)
            actions += machine.end_solo(now)
        await self._carry_out(actions)

    # -- rounds ---------------------------------------------------------------------------
    def recycle(self, summed: np.ndarray) -> None:
        """The trainer is done with an applied sum (any thread): a later ring writes into it."""
        self.rings.recycle(summed)

    def _apply(self, rnd: Round, total: int, used: bytes | None = None, spread: tuple | None = None) -> None:
        summed = self.rings.commit(rnd, total)  # (what this round dropped is owed now)
        if summed is not None:  # (total 0: nobody had anything; the trainer still hears of the round)
            self.rings.keep_owed(self.trainer.apply(summed, total, used, spread))  # (error feedback: not applied there)
        self.applied += 1

    def _put_back(self, r: int, not_finite: bool = False) -> None:
        rnd = self._rounds.pop(r, None) or Round(r)
        log.debug("round %d: putting back %s", r, "our contribution" if rnd.taken is not None else "nothing")
        self.rings.cancel(rnd)  # (and its residual: the one owed before it is still owed)
        if rnd.taken is not None:
            self.trainer.put_back(*rnd.taken, not_finite=not_finite)

    # -- state transfer -------------------------------------------------------------------
    def _serve(self, peer: str, ask_id: int, waited: float, parameters_only: bool = False) -> list:
        """A peer asks for our state: capture it at a round boundary, or try again soon. For a
        joiner we hold the next round from its ask on (as leader), and let one in flight end
        first: a snapshot taken during a round is one update behind once that round commits.
        A member correcting its drift asks for our parameters only (``parameters_only``)."""
        machine, now = self.machine, asyncio.get_running_loop().time()
        if not machine.synced:
            self.transfer.refuse(peer, ask_id, "not synced itself; ask another member")
            return []
        joiner = not parameters_only and machine.table.state(peer) != SYNCED
        actions = machine.hold_for(peer, now, sending=True) if joiner else []
        state = (None if joiner and machine.is_leader and machine.pending is not None
                 else self.trainer.snapshot(parameters_only=True) if parameters_only else self.trainer.snapshot())
        if state is None and waited < SNAPSHOT_WAIT:
            asyncio.get_running_loop().call_later(TICK / 2, self._post, "ask", peer, ask_id, waited + TICK / 2,
                                                  parameters_only)
        elif state is None:
            self.transfer.refuse(peer, ask_id, "its trainer did not reach a round boundary in time")
            actions += machine.hold_for(peer, now)
        elif not joiner:
            self.transfer.serve(peer, ask_id, state, machine.sync_point())
        else:  # with our History: it can then tell a split from lagging, as we can
            lineage = [[v, d] for v, d in machine.history.recent(WINDOW)]
            self.transfer.serve(peer, ask_id, {**state, LINEAGE: lineage}, machine.sync_point(),
                                on_sent=lambda rate: self._post("sent", peer, rate))
        return actions

    async def _fetch_state(self, donor: str) -> None:
        """Download a snapshot, from ``donor`` first, then from another linked member, until one
        loads; once no linked peer is left to ask (the donor killed mid-download) or MAX_FETCH_TRIES
        failed (the peers linked refuse: they load too), the machine decides again from the cluster
        as it is now (``on_load_failed``): asking on went on for whole runs (bench/soak.py)."""
        loop, asked = asyncio.get_running_loop(), []
        for tries in range(1, MAX_FETCH_TRIES + 1):
            asked += [donor] if donor not in asked else []
            try:
                state, point = await self.transfer.fetch(donor)
                self._post("restored", state, point, donor)
                return
            except FingerprintError as exc:
                self.failure = exc
                log.error("%s", exc)
                return
            except P2PTrainError as exc:
                failed, after = exc, None
            if tries < MAX_FETCH_TRIES:
                log.warning("loading state from %s failed: %s; trying again", donor, failed)
                await asyncio.sleep(RETRY_FETCH)
                after = self._next_donor(donor, loop.time())
            if after is None:
                return self._post("unloaded", ", ".join(asked), f"{failed} ({tries} of {MAX_FETCH_TRIES} tries)")
            donor = after

    def _next_donor(self, donor: str, now: float) -> str | None:
        """Whom to ask after ``donor`` failed: another synced member (the one that failed may be
        right that it is not synced itself: our table lags); with the donor gone (no link), any linked
        peer, which serves or refuses in one frame; else the donor while linked. None: nobody linked."""
        members = [p for p in self.machine.table.live_synced() if p != self.peer_id and p in self.mesh.peers]
        others = [p for p in members if p != donor]
        if not others and donor not in self.mesh.peers:
            others = [p for p in self.mesh.peers if p != self.peer_id]
        if others:
            return others[int(now) % len(others)]
        return donor if donor in self.mesh.peers else None

    def _record(self, rnd: Round, total: int, view: tuple) -> None:
        stats, r, began = rnd.stats, rnd.r, rnd.ring_began
        wire, raw = (stats.wire_bytes, stats.raw_bytes) if stats is not None else (0, 0)
        self.wire_bytes, self.raw_bytes = self.wire_bytes + wire, self.raw_bytes + raw
        seconds = asyncio.get_running_loop().time() - began if began is not None else 0.0
        self.rounds.append(RoundRecord(r, len(view), total, rnd.samples, wire, raw, seconds, time.time()))
        if began is not None:
            now = self.trace.now()
            self.trace.span(f"round {r}", "round", now - seconds, now, members=len(view), samples=total,
                            wire_bytes=wire)
