"""``python -m p2ptrain join``: train a task with whoever else runs it on the LAN.

    python -m p2ptrain join                                   # the default task; peers found by beacons
    python -m p2ptrain join --peers 10.0.0.2:7000 --compression int8 --min-peers 2

Every peer runs the same command. Peers find each other by UDP beacons (and ``--peers``),
form one ring, and train in rounds: each round applies ``sum(G_i) / sum(n_i)`` through every
peer's own optimizer, so replicas stay identical (the metrics file records a parameter
checksum with each round to show it). A peer that arrives later loads the cluster's state first;
one that leaves or dies is dropped and the others go on. Ctrl-C leaves politely.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import time

from p2ptrain.cluster.records import Loaded, in_order
from p2ptrain.commands.cli import secret_option
from p2ptrain.commands.counters import RunCounters
from p2ptrain.commands.join_output import JoinOutput, MetricsFile
from p2ptrain.commands.neighbours import CoreShare
from p2ptrain.commands.options import (check_env_flags, env as _env, env_flag as _flag, integer, name, number, port,
                                       sync_every)
from p2ptrain.errors import CheckpointError, ConfigError
from p2ptrain.taskset import TaskSet
from p2ptrain.trainer.options import MIN_PEER_TIMEOUT, PEER_TIMEOUT
from p2ptrain.trace import NO_TRACE

HELP = "train a model together with the peers on the LAN (the default task with no options)"
log = logging.getLogger("p2ptrain.join")
# How often --connect-timeout's wait looks at the members: every peer's first batch waits for it,
# and the first round for the last peer's (0.1 s spread the peers' starts by up to that much).
MEMBERS_POLL_S = 0.01


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.epilog = ("Every option can also be set as an environment variable P2PTRAIN_<OPTION>, e.g. "
                "P2PTRAIN_MIN_PEERS=2 (flags win). Exit codes: 0 done, 2 a bad option or task, 3 a cluster failure.")
    g = p.add_argument_group("what to train")
    g.add_argument("--task", default=_env("task"), help="built-in task (charlm, synthetic), a task file "
                   "path/to/task.py, or module:function (default: charlm)")
    g.add_argument("--data", default=_env("data"), help="text file or folder for charlm (default: the stdlib's source)")
    g.add_argument("--model-size", default=_env("model_size"), help="model size, e.g. 100k, 1m, 10m (task-dependent)")
    g.add_argument("--device", default=_env("device", "auto"), help="auto|cpu|cuda[:i]|mps|xpu (default: auto)")
    g.add_argument("--batch-size", type=integer(1), default=_env("batch_size"), help="samples per step on this peer")
    g.add_argument("--lr", type=number(above=0), default=_env("lr"), help="learning rate (default: the task's)")
    g.add_argument("--seed", type=integer(0), default=_env("seed", "0"), help="seed of the model and data (default 0; the "
                   "same on every peer)")
    g.add_argument("--data-rank", type=integer(0), default=_env("data_rank"), metavar="N",
                   help="train on the task's batch stream N, the one DDP's rank N reads (default: one drawn from "
                   "this peer's id, another on every peer); give each peer its own N")
    g = p.add_argument_group("the cluster")
    g.add_argument("--cluster", type=name(64), default=_env("cluster", "default"), help="cluster name (default: default)")
    g.add_argument("--secret", default=_env("secret"), help="shared secret (or $P2PTRAIN_SECRET)")
    g.add_argument("--secret-file", default=_env("secret_file"), help="read the shared secret from this file")
    g.add_argument("--peers", default=_env("peers"), help="addresses of other peers, host:port,... (DNS names "
                   "allowed); works with or without discovery")
    g.add_argument("--no-discovery", action="store_true", default=_flag("no_discovery"),
                   help="send no UDP beacons; find peers through --peers only")
    g.add_argument("--interface", default=_env("interface"), help="network interface NAME or ADDR for beacons "
                   "(default: every usable one)")
    g.add_argument("--host", default=_env("host", "0.0.0.0"), help="address to listen on (default 0.0.0.0)")
    g.add_argument("--port", type=port(), default=_env("port", "7000"), help="TCP port to listen on (default 7000; "
                   "0 = any free port)")
    g.add_argument("--min-peers", type=integer(1), default=_env("min_peers", "1"), help="train only while at least K peers "
                   "are members; below that, wait and say so (default 1)")
    g.add_argument("--peer-timeout", type=number(at_least=MIN_PEER_TIMEOUT), default=_env("peer_timeout", str(PEER_TIMEOUT)),
                   help="a peer silent this many seconds (a lid closed, a cable pulled) is dropped and the others "
                   f"go on without it; it rejoins when it is heard again (default {PEER_TIMEOUT:g}, at least "
                   f"{MIN_PEER_TIMEOUT:g})")
    g.add_argument("--connect-timeout", type=number(above=0), default=_env("connect_timeout"),
                   help="give up (exit 3) if --min-peers members have not formed after this many seconds "
                   "(default: wait)")
    g = p.add_argument_group("rounds")
    g.add_argument("--compression", default=_env("compression", "none"),
                   help="none, fp16, bf16, int8, topk:RATIO, optionally +zstd[:LEVEL] or +nozstd (default none)")
    g.add_argument("--staleness", type=integer(0), default=_env("staleness", "0"), help="0: synchronous rounds; "
                   "N >= 1: rounds run at the network's pace, no gradient applied more than N rounds stale")
    g.add_argument("--target-batch-size", type=integer(1), default=_env("target_batch_size"),
                   help="with --staleness >= 1: the most samples one update averages, each peer contributing at "
                   "most its share (default: members x --batch-size, DDP's global batch)")
    g.add_argument("--sync-every", type=sync_every(), default=_env("sync_every"), metavar="H|TIME|auto",
                   help="local-steps mode (DiLoCo): each peer takes H steps with its own optimizer, then a round "
                   "averages the parameter change and every peer applies the same outer step; a faster peer "
                   "steps on while a round waits (default: off, gradient mode). TIME (2s, 500ms) or auto: "
                   "rounds by time, each peer taking the steps that fit")
    g.add_argument("--outer-lr", type=number(above=0), default=_env("outer_lr"),
                   help="with --sync-every: the outer SGD's learning rate (default 0.7; 0.8 with a window or auto)")
    g.add_argument("--outer-momentum", type=number(at_least=0, note=", below 1"), default=_env("outer_momentum"),
                   help="with --sync-every: the outer Nesterov momentum (default 0.9; 0.6 with a window or auto; 0: none)")
    g.add_argument("--weight-prediction", action="store_true", default=_flag("weight_prediction"),
                   help="with --staleness >= 1: compute each batch on the parameters moved on by the last "
                   "update, nearer those it is applied to (fewer updates to a loss; two more parameter copies)")
    g.add_argument("--overlap", action="store_true", default=_flag("overlap"),
                   help="with --staleness 0: start each round's ring on the gradients backward makes first, "
                   "during backward, as DDP does (pays where the cores are free during backward: a GPU; models "
                   "over 4 M parameters)")
    g.add_argument("--reconcile-every", type=integer(0), default=_env("reconcile_every", "10"),
                   help="compare a sketch of the parameters with the coordinator's every N updates; a peer "
                   "whose drift passes the tolerance (1e-5 relative; rounding alone stays far below) loads "
                   "its parameters (default 10; 0: never)")
    g.add_argument("--max-rounds", type=integer(1), default=_env("max_rounds"),
                   help="the cluster's run ends at its round (version) this many after the one this peer "
                   "starts from (0, or a checkpoint's); every member leaves there (default 300 when --duration is "
                   "not given)")
    g.add_argument("--duration", type=number(above=0), default=_env("duration"),
                   help="the run ends this many seconds after the coordinator started, for every member")
    g.add_argument("--step-delay", type=number(at_least=0), default=_env("step_delay", "0"), help=argparse.SUPPRESS)  # benchmarks
    g.add_argument("--step-busy", action="store_true", help=argparse.SUPPRESS)  # benchmarks: the delay computes
    g.add_argument("--start-at", type=number(at_least=0), default=0.0, help=argparse.SUPPRESS)  # benchmarks: the
    # first batch at this Unix time (peers that do not wait for each other, started together)
    g = p.add_argument_group("output")
    g.add_argument("--metrics", default=_env("metrics"), help="append one JSON object per round to this file, "
                   "and a final {\"event\": \"summary\"}")
    g.add_argument("--checksum-every", type=integer(1), default=_env("checksum_every", "10"),
                   help="--metrics: a round's record carries the parameters' checksum at every N-th of the "
                   "cluster's updates (the same ones on every peer; default 10; 1: every round's). A hash of "
                   "every parameter, copied off the device: per round it took 0.4 ms of a 17-22 ms round at "
                   "1 M parameters on a CPU")
    g.add_argument("--eval-every", type=integer(0), default=_env("eval_every", "100"),
                   help="validation loss at every N-th of the cluster's updates (default 100; 0 = only at the end)")
    g.add_argument("--trace", default=_env("trace"), help="write a Chrome-trace timeline (compute, encode, send, "
                   "receive, reduce, apply per round) to this file, for chrome://tracing or ui.perfetto.dev")
    g.add_argument("--checkpoint-dir", default=_env("checkpoint_dir"), help="write checkpoints here, and resume "
                   "from the newest one when the cluster starts from nothing")
    g.add_argument("--checkpoint-every", type=integer(1), default=_env("checkpoint_every", "100"),
                   help="rounds between checkpoints (default 100; one is always written at exit)")


def run(args: argparse.Namespace) -> int:
    from p2ptrain.commands.heap import keep_freed_memory
    from p2ptrain.net.transport import install_uvloop

    check_env_flags(args)
    if args.max_rounds is None and args.duration is None:
        args.max_rounds = 300
    if args.target_batch_size is not None and args.staleness == 0:
        raise ConfigError("--target-batch-size needs --staleness 1 or more (at 0 each round takes one batch "
                          "from every peer)")
    if args.sync_every is None and (args.outer_lr is not None or args.outer_momentum is not None):
        raise ConfigError("--outer-lr and --outer-momentum need --sync-every H (local-steps mode)")
    if args.sync_every is not None:
        from p2ptrain.trainer.options import check_local_steps, local_steps_defaults

        check_local_steps(args.sync_every, *local_steps_defaults(args.outer_lr, args.outer_momentum))
        if args.target_batch_size is not None or args.weight_prediction:
            raise ConfigError("--sync-every does not combine with --target-batch-size or --weight-prediction "
                              "(they are for gradient mode)")
    if args.overlap and (args.staleness or args.sync_every is not None):
        raise ConfigError("--overlap is for --staleness 0 in gradient mode (at --staleness 1 or more and with "
                          "--sync-every the ring already runs beside the next batches): drop --overlap")
    if args.weight_prediction and args.staleness == 0:
        raise ConfigError("--weight-prediction needs --staleness 1 or more (at 0 every gradient is computed on the "
                          "parameters it is applied to)")
    # Cheap checks first: a typo is reported before torch and the task load.
    from p2ptrain.codecs import parse_codec
    from p2ptrain.net.discovery import peer_list

    parse_codec(args.compression)
    peer_list(args.peers or "")
    secret = secret_option(args.secret, args.secret_file)
    _check_where(args)
    install_uvloop()
    keep_freed_memory()  # (before the task's tensors: see heap)
    return asyncio.run(_Join(args, secret).run())


def _check_where(args: argparse.Namespace) -> None:
    """The addresses and files given, checked before anything starts: a --metrics file that
    cannot be written failed at the start with a traceback, a --trace file only at the end."""
    import socket

    from p2ptrain.collective.linkpace import raw_chunks_enabled
    from p2ptrain.collective.pool import default_threads
    from p2ptrain.jit import enabled as numba_enabled
    from p2ptrain.net.interfaces import list_interfaces, pick_address
    from p2ptrain.net.sender import io_threads_default

    default_threads()  # (P2PTRAIN_DATA_THREADS: read at the first ring, mid-run)
    io_threads_default()  # (P2PTRAIN_IO_THREADS: read as each link opens)
    raw_chunks_enabled()  # (P2PTRAIN_RAW_CHUNKS: read at each ring)
    numba_enabled()  # (P2PTRAIN_NUMBA: read as the first int8 codec or local-steps peer is made)

    try:
        socket.getaddrinfo(args.host, None)
    except (OSError, UnicodeError) as exc:
        raise ConfigError(f"--host {args.host!r}: not an address ({getattr(exc, 'strerror', None) or exc}); use "
                          "0.0.0.0 (every interface) or an address of this machine") from None
    if args.interface:
        pick_address(list_interfaces(), args.interface)  # (a ConfigError naming the interfaces there are)
    for flag, path in (("--metrics", args.metrics), ("--trace", args.trace)):
        folder = os.path.dirname(os.path.abspath(path)) if path else None
        if folder is not None and not (os.path.isdir(folder) and os.access(folder, os.W_OK)):
            raise ConfigError(f"{flag} {path}: cannot write there (no such folder, or no permission); give a "
                              "file in a folder that exists")
        if path and os.path.isdir(path):
            raise ConfigError(f"{flag} {path}: a folder, not a file; give a file's path in it (e.g. "
                              f"{os.path.join(path, 'run.jsonl' if flag == '--metrics' else 'trace.json')})")
    if args.checkpoint_dir:
        if os.path.isfile(args.checkpoint_dir):
            raise ConfigError(f"--checkpoint-dir {args.checkpoint_dir}: a file, not a folder; give a folder's path "
                              "(it is created if missing)")
        try:
            os.makedirs(args.checkpoint_dir, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"--checkpoint-dir {args.checkpoint_dir}: cannot create it ({exc.strerror})") from None
        if not os.access(args.checkpoint_dir, os.W_OK):
            raise ConfigError(f"--checkpoint-dir {args.checkpoint_dir}: cannot write there (no permission)")


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
        from p2ptrain.tasks import load_task, validate_task

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
        validate_task(task, device)
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
                         peer_timeout=a.peer_timeout, **kwargs)
        self._resume(peer, task)
        metrics = MetricsFile(a.metrics) if a.metrics else None
        self.output = JoinOutput()
        try:
            await self._run_peer(peer, task, model, device, metrics)
        finally:
            if metrics:
                metrics.close()
        return 0

    async def _run_peer(self, peer, task, model, device, metrics: MetricsFile | None) -> None:
        """Train until the run ends or Ctrl-C; then the last checkpoint, the trace, the summary."""
        from p2ptrain.commands.heap import warm_training_thread

        a = self.args
        if device.type == "cpu":  # (before the peer is reachable: the last to join then does not do it in round 0)
            warm_training_thread(task.num_parameters(), fused=bool(peer.optimizer.defaults.get("fused")))
        try:
            async with peer:
                log.info("peer %s listening on port %d (cluster %r)", peer.peer_id, peer.cluster.port, a.cluster)
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
        if self.trace.enabled:
            try:
                self.trace.write()
                log.info("trace written to %s (open it in chrome://tracing or ui.perfetto.dev)", a.trace)
            except OSError as exc:
                log.error("cannot write --trace %s (%s)", a.trace, exc.strerror or exc)
        self.output.summary(peer, self.count, task, model, device, metrics)

    # -- checkpoints --------------------------------------------------------------------------
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
            raise ConfigError(f"{path} holds another model ({diff}): use another --checkpoint-dir, or the "
                              "--task/--model-size it was written with")
        peer.load_state_dict(state["peer"])
        log.info("resuming from %s: the cluster's update %d, round %d", path, peer.version, state.get("round", -1))
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
        last = latest.round if latest is not None else -1
        state = {"peer": held, "fingerprint": model_fingerprint(peer.module), "round": last,
                 "config": {"task": task.name, "model_size": str(a.model_size), "seed": a.seed}}
        _refuse_diverged(peer, state["peer"]["model"], a.checkpoint_dir)
        try:
            path = save_checkpoint(a.checkpoint_dir, state, round=max(last, 0))
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
                self.output.report(peer, self.count, now)

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
                if metrics:
                    metrics.write({"event": "loaded", "time": time.time(), "round": item.point.round,
                                   "version": item.point.version})
                continue
            record = item
            self.count.applied(record, time.monotonic())
            if metrics:  # (a checksum only where the parameters hold this round's update, and no later one,
                #            at every --checksum-every-th update)
                self.output.write_metrics(metrics, peer, record, current=record is happened[-1]
                                          and peer.metrics is not None and peer.metrics.round == record.round
                                          and peer.version % a.checksum_every == 0)
            if a.checkpoint_dir and record.samples:  # (an idle round is no update: nothing new to save)
                due = due or self.count.rounds % a.checkpoint_every == 0
        if due:
            self._checkpoint(peer, task)
        # At the cluster's updates N, 2N, ... (every peer at the same ones; a joiner or a resumed
        # peer counting its own rounds evaluated wherever it happened to be).
        if a.eval_every and task.evaluate and peer.version // a.eval_every > self._evaluated // a.eval_every:
            self._evaluated = peer.version
            shown = "-" if self.count.round is None else self.count.round
            log.info("round %s  update %d  validation loss %.4f", shown, peer.version,
                     task.evaluate(peer.model, device))

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
