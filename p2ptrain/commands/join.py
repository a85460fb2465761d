"""``python -m p2ptrain join``: train a task with whoever else runs it on the LAN.

    python -m p2ptrain join                                   # the default task; peers found by beacons
    python -m p2ptrain join --peers 10.0.0.2:7000 --compression int8 --min-peers 2

Every peer runs the same command. Peers find each other by UDP beacons (and ``--peers``),
form one ring, and train in rounds: each round applies ``sum(G_i) / sum(n_i)`` through every
peer's own optimizer, so replicas stay identical (the metrics file records a parameter
checksum with each round to show it). A peer that arrives later loads the cluster's state first;
one that leaves or dies is dropped and the others go on. Ctrl-C leaves politely. At the end the
trained model is written to a file that loads without p2ptrain (``model_file``), and the summary
says where. The options and their checks are ``join_options``'s; what it shows, ``join_output``'s.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import time

from p2ptrain.cluster.records import Loaded, in_order
from p2ptrain.commands.counters import RunCounters
from p2ptrain.commands.join_output import JoinOutput
from p2ptrain.commands.metrics_out import Metrics, open_metrics
from p2ptrain.commands.neighbours import CoreShare
from p2ptrain.commands.join_options import add_arguments, check  # noqa: F401 (cli calls join.add_arguments)
from p2ptrain.errors import CheckpointError, ConfigError
from p2ptrain.taskset import TaskSet
from p2ptrain.trace import NO_TRACE

HELP = "train a model together with the peers on the LAN (the default task with no options)"
log = logging.getLogger("p2ptrain.join")
# How often --connect-timeout's wait looks at the members: every peer's first batch waits for it,
# and the first round for the last peer's (0.1 s spread the peers' starts by up to that much).
MEMBERS_POLL_S = 0.01


def run(args: argparse.Namespace) -> int:
    from p2ptrain.commands.heap import keep_freed_memory
    from p2ptrain.net.transport import install_uvloop

    secret = check(args)  # (before the task loads: a mistake is said at once)
    install_uvloop()
    keep_freed_memory()  # (before the task's tensors: see heap)
    return asyncio.run(_Join(args, secret).run())


def _local_hosts() -> set[str]:
    from p2ptrain.net.interfaces import list_interfaces

    return {"localhost", "127.0.0.1", "0.0.0.0"} | {i.address for i in list_interfaces()}


def _stream_of(peer_id: str) -> int:
    """The batch stream of a peer not given --data-rank: from its id, so that peers started
    alike (the same --seed) still read different batches."""
    head = peer_id[:8]
    return int(head, 16) if head and all(c in "0123456789abcdef" for c in head) else 0


def burn(seconds: float) -> None:
    """Keep a core busy with torch work for ``seconds`` (``--step-busy``: a slower device that
    computes, releasing the GIL as real compute does, rather than one that sleeps and frees its core)."""
    import torch

    a, end = torch.ones(96, 96), time.perf_counter() + seconds
    while time.perf_counter() < end:
        a @ a


class _Join:
    """The command's state: task, device, peer, counters. ``run`` returns the exit code. What
    it shows (status line, metrics records, summary) is its ``output``'s (``join_output``)."""

    def __init__(self, args, secret: bytes | None):
        self.args, self.secret = args, secret
        self.count = RunCounters(time.monotonic())  # this run's (restarted when training starts)
        self._evaluated = 0  # the cluster's update at the last validation
        self.stopping = False
        self._training = TaskSet()  # the training loop alone: Ctrl-C cancels it, and the peer still leaves politely
        self._records_seen = self._loads_seen = 0
        self._unsaved = False  # the last checkpoint during the run was refused by the disk
        self._version = 0  # the cluster's update count after the last record taken (``_take_records``)
        self._port = 0  # the port this peer listens on (once it does)
        self.output: JoinOutput | None = None  # (made when the run starts: its status line is the terminal's then)
        self.trace = NO_TRACE

    async def run(self) -> int:
        self._cores = CoreShare()  # (the peers of this machine share its cores)
        try:
            return await self._run()
        finally:
            self._cores.close()

    async def _run(self) -> int:
        from p2ptrain.commands.heap import warm_loop_thread
        from p2ptrain.device import device_kind, pick_device
        from p2ptrain.net.discovery import parse_host_port, peer_list
        from p2ptrain.trainer.peer import AsyncPeer
        from p2ptrain.tasks import builtin, load_task, validate_task

        a = self.args
        peers = peer_list(a.peers or "")
        local = _local_hosts()  # (lists the interfaces: once)
        ours = {(h, a.port) for h in local}
        # Before the task is built: torch's thread pools spin while they wait, and several
        # peers of one machine building their tasks with all its cores each take ten times longer.
        self._cores.listed = sum(host in local and (host, port) not in ours
                                 for host, port in map(parse_host_port, peers))
        self._cores.share()
        device = pick_device(a.device)
        task = load_task(a.task, {"seed": a.seed, "data": a.data, "model_size": a.model_size,
                                  "batch_size": a.batch_size, "device": str(device)})
        validate_task(task, device, sample=builtin(a.task) is None)  # (a built-in's sample is tested here)
        model = task.model.to(device)
        warm_loop_thread(task.num_parameters())  # (before the peer's thread starts)
        optimizer = task.make_optimizer(model.parameters(), a.lr if a.lr is not None else task.default_lr)
        log.info("task %s (%s), %d parameters, on %s; compression %s, staleness %d, min peers %d",
                 task.name, task.info, task.num_parameters(), device_kind(device), a.compression, a.staleness,
                 a.min_peers)
        # The start-up so far held the loop; a Ctrl-C during it was asyncio's own (it cancelled
        # this task, which ends here: exit 130). From now on a Ctrl-C is ours: leave politely.
        await asyncio.sleep(0)
        self._install_signals()
        kwargs = {"target_batch_size": a.target_batch_size} if a.target_batch_size else {}
        if a.sync_every is not None:
            kwargs.update(sync_every=a.sync_every, outer_lr=a.outer_lr, outer_momentum=a.outer_momentum)
        peer = AsyncPeer(model, optimizer, cluster=a.cluster, secret=self.secret, peers=peers,
                         listen=f"{a.host}:{a.port}", discovery=not a.no_discovery, interface=a.interface,
                         compression=a.compression, staleness=a.staleness, min_peers=a.min_peers,
                         reconcile_every=a.reconcile_every, weight_prediction=a.weight_prediction, overlap=a.overlap,
                         step_timeout=float("inf"), seed=a.seed, max_rounds=a.max_rounds, duration=a.duration,
                         peer_timeout=a.peer_timeout, tls_cert=a.tls_cert, tls_key=a.tls_key, tls_ca=a.tls_ca,
                         **kwargs)
        self._resume(peer, task)
        self._version = peer.version  # (the checkpoint's, or 0: each record's version counts on from it)
        metrics = open_metrics(a.metrics, a.tensorboard)
        self.output = JoinOutput()
        try:
            await self._run_peer(peer, task, model, device, metrics)
        finally:
            if metrics:
                metrics.close()
        return 0

    async def _run_peer(self, peer, task, model, device, metrics: Metrics | None) -> None:
        """Train until the run ends or Ctrl-C; then the last checkpoint, the model file, the trace,
        the summary."""
        from p2ptrain.commands.heap import warm_training_thread

        a = self.args
        if device.type == "cpu":  # (before the peer is reachable: the last to join then does not do it in round 0)
            warm_training_thread(task.num_parameters(), fused=bool(peer.optimizer.defaults.get("fused")))
        try:
            async with peer:
                log.info("peer %s listening on port %d (cluster %r)", peer.peer_id, peer.cluster.port, a.cluster)
                self._port = peer.cluster.port
                if a.trace:
                    from p2ptrain.trace import Tracer

                    self.trace = peer.cluster.trace = Tracer(a.trace, f"p2ptrain peer {peer.peer_id}")
                try:  # (a Ctrl-C that came while the peer started: the loop never begins)
                    await self._training.spawn(self._train(peer, task, device, metrics))
                except asyncio.CancelledError:
                    if not self.stopping:
                        raise
                    log.info("leaving the cluster")
                finally:
                    await self._training.close()
            # The rounds since the loop's last look, those committed as the peer left too (a peer
            # alone commits the batches it applied at once afterwards, the last on leaving).
            self._take_records(peer, task, device, metrics)
        finally:
            self.output.status.clear()
        self._checkpoint(peer, task, final=True)
        saved = self._save_model(peer, task)
        if self.trace.enabled:
            try:
                self.trace.write()
                log.info("trace written to %s (open it in chrome://tracing or ui.perfetto.dev)", a.trace)
            except OSError as exc:
                log.error("cannot write --trace %s (%s)", a.trace, exc.strerror or exc)
        self.output.summary(peer, self.count, task, model, device, metrics, saved)

    # -- checkpoints and the model file ---------------------------------------------------------
    def _save_model(self, peer, task) -> str | None:
        """The trained model as a file that loads without p2ptrain (``model_file``); its path,
        None with --no-save."""
        from p2ptrain.commands.model_file import default_path, write_model

        a = self.args
        if a.no_save:
            return None
        path = a.save or default_path(task.name, a.checkpoint_dir, self._port, self._cores.listed)
        write_model(path, peer.state_dict()["model"])
        return path

    def _resume(self, peer, task) -> None:
        """With --checkpoint-dir: continue from the newest checkpoint there. A cluster already
        running further along (or a bigger side) hands this peer its state instead."""
        from p2ptrain.trainer.checkpoint import load_latest
        from p2ptrain.tasks import fingerprint_diff, model_fingerprint

        a = self.args
        found = load_latest(a.checkpoint_dir) if a.checkpoint_dir else None
        if found is None:
            return
        path, state = found
        diff = fingerprint_diff(model_fingerprint(peer.module), state.get("fingerprint", []))
        if diff:
            raise ConfigError(f"{path} holds another model ({_written_with(state, task, a.model_size) or diff}): use "
                              "another --checkpoint-dir, or the --task and --model-size it was written with")
        peer.load_state_dict(state["peer"])
        # --max-rounds N: N more updates than the state the cluster starts from (this one, or a
        # newer checkpoint another peer resumes from: the cluster says so as this peer loads it)
        ends = (f": the run ends at the cluster's update {peer.version + a.max_rounds} (--max-rounds {a.max_rounds} "
                "more; more than a newer checkpoint's where another peer resumes from one)" if a.max_rounds else "")
        log.info("resuming from %s at the cluster's update %d%s", path, peer.version, ends)
        if a.lr is not None:  # (the optimizer's state brought the checkpoint's own: the command line wins)
            saved = {group["lr"] for group in peer.optimizer.param_groups}
            for group in peer.optimizer.param_groups:
                group["lr"] = a.lr
            if saved != {a.lr}:
                log.info("learning rate %g from --lr (the checkpoint's was %s)", a.lr,
                         ", ".join(f"{lr:g}" for lr in sorted(saved)))

    def _checkpoint(self, peer, task, final: bool = False) -> None:
        from p2ptrain.trainer.checkpoint import save_checkpoint
        from p2ptrain.tasks import model_fingerprint

        a = self.args
        if not a.checkpoint_dir:
            return
        held = peer.state_dict()  # (first: alone, it commits the rounds of the batches applied so far)
        latest = peer.cluster.rounds.last()
        if latest is None:  # (a SIGTERM before the first round: the state is the start's, or the checkpoint's)
            log.log(logging.INFO if final else logging.DEBUG, "no round ran in this run: no checkpoint to write")
            return
        last = latest.round
        state = {"peer": held, "fingerprint": model_fingerprint(peer.module), "round": last,
                 "config": {"task": task.name, "model_size": str(a.model_size), "seed": a.seed}}
        _refuse_diverged(peer, state["peer"]["model"], a.checkpoint_dir)
        try:
            path = save_checkpoint(a.checkpoint_dir, state, round=last)
        except CheckpointError as exc:
            if final:  # (the run is over: its state is only here now)
                raise
            # A full disk during the run stops no training: the state is in memory (and on the
            # other peers); the next checkpoints try again, and the last one at the end must land.
            log.log(logging.DEBUG if self._unsaved else logging.WARNING, "%s; training goes on, and tries "
                    "again every --checkpoint-every rounds", exc)
            self._unsaved = True
            return
        if self._unsaved and not final:
            log.info("checkpoint written again: %s", path)
        self._unsaved = False
        log.log(logging.INFO if final else logging.DEBUG, "checkpoint written: %s", path)

    def _install_signals(self) -> None:
        """Ctrl-C or SIGTERM: leave politely and exit 0. A second one: exit at once."""
        import signal

        loop = asyncio.get_running_loop()

        def stop() -> None:
            if self.stopping:
                os._exit(130)
            self.stopping = True
            print("\nleaving the cluster (Ctrl-C again to quit at once)", file=sys.stderr, flush=True)
            self._training.cancel()

        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, stop)
            except (NotImplementedError, RuntimeError):  # Windows: the stock handler (KeyboardInterrupt)
                pass

    async def _train(self, peer, task, device, metrics) -> None:
        a = self.args
        rank_seed = a.data_rank if a.data_rank is not None else _stream_of(peer.peer_id)
        batches = task.train_batches(rank_seed, max(1, a.min_peers), a.batch_size or task.batch_size, a.seed)
        await self._wait_for_members(peer)
        if a.start_at:
            await asyncio.sleep(max(0.0, a.start_at - time.time()))
        start = last_log = time.monotonic()
        self.count, self._evaluated = RunCounters(start), peer.version
        if metrics:  # (where the first round's own batches began: its record times only its ring)
            metrics.write({"event": "training", "time": time.time(), "version": peer.version})
        while not (self.stopping or peer.finished):  # (the cluster's end: --max-rounds, --duration)
            with self.trace("compute", "compute"):
                batch = next(batches)
                n = task.batch_size_of(batch)
                loss = task.loss(peer.model, batch, device)
                loss.backward()
                self.output.batch_loss(float(loss.detach()))
                if a.step_delay and a.step_busy:  # a slower device, for benchmarks: one that computes
                    burn(a.step_delay)               # (a core busy) or one that sleeps (a core free)
                elif a.step_delay:
                    await asyncio.sleep(a.step_delay)
            with self.trace("step", "compute"):
                try:
                    await peer.step(batch_size=n)
                finally:  # (stopped in the middle, the batch was handed over all the same: applied, or dropped)
                    self.count.stepped(n, time.monotonic())
            self._take_records(peer, task, device, metrics)
            now = time.monotonic()
            self._cores.share_every(now)
            if now - last_log >= 0.5:
                last_log = now
                last = getattr(getattr(peer.cluster, "machine", None), "last_version", 0)
                self.output.report(peer, self.count, now, last_version=last, elapsed=now - start,
                                   duration=a.duration)

    def _take_records(self, peer, task, device, metrics) -> None:
        """Count the rounds applied since we last looked; metrics, evaluations, checkpoints."""
        a = self.args
        records = self._new_records(peer)  # (first: a load that comes meanwhile is after all of them)
        loads = peer.cluster.loads[self._loads_seen:]
        self._loads_seen += len(loads)
        happened = in_order(records, loads)
        due = False  # (one checkpoint for the rounds seen at once: a peer alone commits a tick's worth)
        for item in happened:
            if isinstance(item, Loaded):
                self._version = item.point.version
                if metrics:
                    metrics.write({"event": "loaded", "time": time.time(), "round": item.point.round,
                                   "version": item.point.version})
                continue
            record = item
            self._version += record.samples > 0  # (an idle round is no update)
            self.count.applied(record, time.monotonic())
            if metrics:  # (a checksum only where the parameters hold this round's update, and no later one,
                #            at every --checksum-every-th update)
                self.output.write_metrics(metrics, peer, record, current=record is happened[-1]
                                          and peer.metrics is not None and peer.metrics.round == record.round
                                          and peer.version % a.checksum_every == 0, version=self._version)
            if a.checkpoint_dir and record.samples:  # (an idle round is no update: nothing new to save)
                due = due or self.count.rounds % a.checkpoint_every == 0
        if due:
            self._checkpoint(peer, task)
        # At the cluster's updates N, 2N, ... (every peer at the same ones; a joiner or a resumed
        # peer counting its own rounds evaluated wherever it happened to be).
        if a.eval_every and task.evaluate and peer.version // a.eval_every > self._evaluated // a.eval_every:
            self._evaluated = peer.version
            value = float(task.evaluate(peer.model, device))
            last = getattr(getattr(peer.cluster, "machine", None), "last_version", 0)
            log.info("update %d%s  validation loss %.4f", peer.version, f"/{last}" if last else "", value)
            if metrics:
                metrics.write({"event": "validation", "time": time.time(), "version": peer.version,
                               "validation_loss": value})

    def _new_records(self, peer) -> list:
        """The rounds applied since we last looked (the cluster keeps the last 1000)."""
        fresh = peer.cluster.rounds.since(self._records_seen)
        if fresh:
            self._records_seen = fresh[-1].index + 1
        return fresh

    async def _wait_for_members(self, peer) -> None:
        """With --connect-timeout: exit 3 if --min-peers members have not formed by then."""
        from p2ptrain.errors import GroupError
        from p2ptrain.net.transport import hostport

        a = self.args
        if a.connect_timeout is None or a.min_peers <= 1:
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + a.connect_timeout
        while peer.members < a.min_peers:
            peer.cluster.check()  # (a peer with other settings, another model: said at once)
            if loop.time() > deadline:
                mesh, listed = peer.cluster.mesh, peer.discovery.static_addresses
                others = [(h, p) for h, p in listed if not mesh.is_own(h, p)]
                missing = [hostport(h, p) for h, p in others if (h, p) not in mesh.addresses]
                if listed and not others and a.no_discovery:
                    fix = "--peers lists only this peer's own address: add the other peers' addresses"
                else:
                    fix = ((f"not reached: {', '.join(missing)}; " if missing else "") + "check that every peer "
                           "runs with the same --cluster and --secret, and that the port is open")
                raise GroupError(f"only {peer.members} of --min-peers {a.min_peers} members after "
                                 f"{a.connect_timeout:.0f} s; {fix}")
            await asyncio.sleep(MEMBERS_POLL_S)


def _written_with(state: dict, task, model_size: str | None) -> str:
    """The two models in the user's words, where the checkpoint says what it was written with:
    ``written with --model-size 100k, this run's is 1m`` ("" where it does not say)."""
    config = state.get("config") if isinstance(state.get("config"), dict) else {}
    if "model_size" not in config:
        return ""
    theirs = {"task": config.get("task"), "size": config.get("model_size")}
    ours = {"task": task.name, "size": str(model_size)}
    shown = {"None": "the default"}
    if theirs["task"] not in (None, ours["task"]):
        return f"written by --task {theirs['task']}, this run's is {ours['task']}"
    return (f"written with --model-size {shown.get(str(theirs['size']), theirs['size'])}, this run's is "
            f"{shown.get(ours['size'], ours['size'])}")


def _refuse_diverged(peer, model_state: dict, directory: str) -> None:
    """A checkpoint of parameters that hold NaN or inf is never written: with ``keep``, it would
    push out the good ones a diverged run has to resume from (a pass over the parameters, a
    checkpoint's worth of work; a lossless codec carries NaN into every replica, as DDP does)."""
    import torch

    from p2ptrain.errors import DivergedError

    for key, _ in peer.module.named_parameters():
        if key in model_state and not bool(torch.isfinite(model_state[key]).all()):
            raise DivergedError(f"the model diverged: {key} holds NaN or inf at update {peer.version}; no checkpoint "
                                f"written over those in {directory} (lower the learning rate and resume from there)")
