"""``python -m p2ptrain join``: train a task, alone or with a fixed group of peers.

    python -m p2ptrain join                                   # the default task, on this machine
    python -m p2ptrain join --peers 10.0.0.1:7000,10.0.0.2:7000 --port 7000 --compression int8

Every peer runs the same command with the same ``--peers`` list (the whole group, this
peer included). Rounds are synchronous: each peer computes one batch, the gradient sums
and sample counts are allreduced, and every peer applies ``sum(G_i) / sum(n_i)`` through
its own optimizer; all start from rank 0's parameters, so replicas stay bit-identical
(the metrics file records a parameter checksum per round to show it).

What this command does not do yet: find peers by discovery, admit peers that arrive
later, survive a peer that leaves, run asynchronous rounds (``--staleness``), or write
checkpoints. Those come with the cluster layer and the trainer.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import time

from p2ptrain.cli import secret_option
from p2ptrain.errors import ConfigError

HELP = "train a model with the peers of a fixed group (the default task with no options)"
log = logging.getLogger("p2ptrain.join")


def _env(name: str, default=None):
    return os.environ.get(f"P2PTRAIN_{name.upper().replace('-', '_')}", default)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.epilog = "Every option can also be set as an environment variable P2PTRAIN_<OPTION> (flags win)."
    p.add_argument("--task", default=_env("task"), help="built-in task (charlm, synthetic), a task file "
                   "path/to/task.py, or module:function (default: charlm)")
    p.add_argument("--data", default=_env("data"), help="text file or folder for charlm (default: the stdlib's source)")
    p.add_argument("--model-size", default=_env("model_size"), help="model size, e.g. 100k, 1m, 10m (task-dependent)")
    p.add_argument("--device", default=_env("device", "auto"), help="auto|cpu|cuda[:i]|mps|xpu (default: auto)")
    p.add_argument("--batch-size", type=int, default=_env("batch_size"), help="samples per step on this peer")
    p.add_argument("--lr", type=float, default=_env("lr"), help="learning rate (default: the task's)")
    p.add_argument("--seed", type=int, default=_env("seed", "0"), help="seed of the model and data (default 0)")
    p.add_argument("--peers", default=_env("peers"), help="the whole group, this peer included: host:port,... "
                   "(same list on every peer; omit to train alone)")
    p.add_argument("--host", default=_env("host"), help="this peer's address as written in --peers")
    p.add_argument("--port", type=int, default=_env("port", "7000"), help="TCP port to listen on (default 7000)")
    p.add_argument("--cluster", default=_env("cluster", "default"), help="cluster name (default: default)")
    p.add_argument("--secret", default=_env("secret"), help="shared secret (or $P2PTRAIN_SECRET)")
    p.add_argument("--secret-file", default=_env("secret_file"), help="read the shared secret from this file")
    p.add_argument("--compression", default=_env("compression", "none"),
                   help="none, fp16, bf16, int8, topk:RATIO, optionally +zstd[:LEVEL] or +nozstd (default none)")
    p.add_argument("--max-rounds", type=int, default=_env("max_rounds"), help="stop after this many rounds (default 300 when --duration is not given)")
    p.add_argument("--duration", type=float, default=_env("duration"), help="stop after this many seconds")
    p.add_argument("--metrics", default=_env("metrics"), help="write one JSON object per round to this file")
    p.add_argument("--eval-every", type=int, default=_env("eval_every", "100"),
                   help="validation loss every N rounds (default 100; 0 = only at the end)")
    p.add_argument("--connect-timeout", type=float, default=_env("connect_timeout", "120"),
                   help="seconds to wait for the group to form (default 120)")


def run(args: argparse.Namespace) -> int:
    from p2ptrain.transport import install_uvloop

    if args.max_rounds is None and args.duration is None:
        args.max_rounds = 300
    for name in ("max_rounds", "batch_size"):
        value = getattr(args, name)
        if value is not None and int(value) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be at least 1")
    # Cheap checks first: a typo is reported before torch and the task load.
    from p2ptrain.codecs import parse_codec
    from p2ptrain.discovery import parse_host_port

    parse_codec(args.compression)
    for entry in (args.peers or "").split(","):
        if entry.strip():
            parse_host_port(entry)
    secret = secret_option(args.secret, args.secret_file)
    install_uvloop()
    return asyncio.run(_Join(args, secret).run())


def _local_hosts() -> set[str]:
    from p2ptrain.interfaces import list_interfaces

    return {"localhost", "127.0.0.1"} | {i.address for i in list_interfaces()}


def _share_cores(peers: list[str]) -> None:
    """Several peers on one machine: split its cores among them. Torch's thread pools
    spin while they wait, and two of them on the same cores stall each other for seconds."""
    import torch

    from p2ptrain.discovery import parse_host_port

    here = sum(parse_host_port(p)[0] in _local_hosts() for p in peers)
    if here > 1:
        threads = max(1, (os.cpu_count() or 1) // here)
        torch.set_num_threads(threads)
        log.info("%d peers of the group run on this machine: %d torch thread(s) each", here, threads)


def _own_entry(peers: list[str], host: str | None, port: int) -> str:
    """The entry of --peers that is this peer: --host:--port, else the one with our port
    whose host is one of this machine's addresses."""
    from p2ptrain.discovery import parse_host_port

    if host is not None:
        entry = f"{host}:{port}"
        if entry not in peers:
            raise ConfigError(f"{entry} (--host:--port) is not in --peers {','.join(peers)}")
        return entry
    local = _local_hosts()
    mine = [p for p in peers if parse_host_port(p) in {(h, port) for h in local}]
    if len(mine) != 1:
        raise ConfigError(f"cannot tell which of --peers {','.join(peers)} is this peer "
                          f"(port {port}; local addresses {', '.join(sorted(local))}): pass --host")
    return mine[0]


class _Join:
    """The command's state: task, device, group, counters. ``run`` returns the exit code."""

    def __init__(self, args, secret: bytes | None):
        self.args = args
        self.secret = secret
        self.rounds = 0
        self.samples = 0
        self.wire = 0
        self.raw = 0
        self.last_loss = float("nan")

    async def run(self) -> int:
        import torch

        from p2ptrain.device import device_kind, pick_device
        from p2ptrain.group import Group
        from p2ptrain.tasks import load_task, validate_task

        a = self.args
        device = pick_device(a.device)
        task = load_task(a.task, {"seed": a.seed, "data": a.data, "model_size": a.model_size,
                                  "batch_size": a.batch_size, "device": str(device)})
        validate_task(task, device)
        model = task.model.to(device)
        optimizer = task.make_optimizer(model.parameters(), a.lr if a.lr is not None else task.default_lr)
        peers = [p.strip() for p in a.peers.split(",") if p.strip()] if a.peers else []
        own = _own_entry(peers, a.host, a.port) if peers else f"127.0.0.1:{a.port}"
        peers = peers or [own]
        _share_cores(peers)
        log.info("task %s (%s), %d parameters, on %s; group of %d, compression %s",
                 task.name, task.info, task.num_parameters(), device_kind(device), len(peers), a.compression)
        async with Group(listen=own, peers=peers, secret=self.secret, cluster=a.cluster,
                         compression=a.compression, connect_timeout=a.connect_timeout) as group:
            params = [p for p in model.parameters() if p.requires_grad]
            # Everyone starts from rank 0's parameters: the others add zeros, bit for bit.
            with torch.no_grad():
                if group.rank:
                    for p in params:
                        p.zero_()
                await group.allreduce(params)
            batches = task.train_batches(group.rank, group.size, a.batch_size or task.batch_size, a.seed)
            metrics = open(a.metrics, "a", encoding="utf-8") if a.metrics else None
            try:
                await self._train(group, task, model, optimizer, params, batches, device, metrics)
            finally:
                if metrics:
                    metrics.close()
        return 0

    async def _train(self, group, task, model, optimizer, params, batches, device, metrics) -> None:
        import torch

        from p2ptrain.tasks import param_checksum

        a = self.args
        start = last_log = time.monotonic()
        count = torch.zeros(1)
        while not self._done(start):
            t0 = time.monotonic()
            batch = next(batches)
            n = task.batch_size_of(batch)
            optimizer.zero_grad(set_to_none=False)
            loss = task.loss(model, batch, device)
            (loss * n).backward()  # a gradient sum: peers with bigger batches count for more
            self.last_loss = float(loss.detach())
            for p in params:  # a parameter this batch did not reach still takes part, with zeros
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            grads = [p.grad for p in params]
            count.fill_(n)
            await group.allreduce(grads, error_feedback=True)
            self._count_bytes(group)
            await group.allreduce(count, compression="none")
            with torch.no_grad():
                for g in grads:
                    g.div_(count.to(g.device))
            optimizer.step()
            self.rounds += 1
            self.samples += int(count.item())
            now = time.monotonic()
            if metrics:
                metrics.write(json.dumps({
                    "time": time.time(), "round": self.rounds, "members": group.size, "samples": int(count.item()),
                    "loss": self.last_loss, "wire_bytes": self.wire, "raw_bytes": self.raw,
                    "round_seconds": now - t0, "staleness_max": 0, "dropped": 0,
                    "param_checksum": param_checksum(model)}) + "\n")
            if now - last_log >= 2.0:
                last_log = now
                rate = self.samples / (now - start)
                ratio = self.raw / self.wire if self.wire else 1.0
                log.info("round %d  members %d  loss %.3f  samples/s %.0f (cluster)  wire %.2f MB/s  ratio %.1fx",
                         self.rounds, group.size, self.last_loss, rate, self.wire / (now - start) / 1e6, ratio)
            if a.eval_every and task.evaluate and self.rounds % a.eval_every == 0:
                log.info("round %d  validation loss %.4f", self.rounds, task.evaluate(model, device))
        self._summary(task, model, device, start)

    def _count_bytes(self, group) -> None:
        self.wire += group.last_stats.wire_bytes
        self.raw += group.last_stats.raw_bytes

    def _done(self, start: float) -> bool:
        a = self.args
        return ((a.max_rounds is not None and self.rounds >= a.max_rounds)
                or (a.duration is not None and time.monotonic() - start >= a.duration))

    def _summary(self, task, model, device, start: float) -> None:
        from p2ptrain.tasks import param_checksum

        wall = time.monotonic() - start
        val = task.evaluate(model, device) if task.evaluate else None
        lines = [f"rounds {self.rounds}", f"samples {self.samples}", f"final train loss {self.last_loss:.4f}",
                 f"validation loss {val:.4f}" if val is not None else "", f"wall time {wall:.1f} s",
                 f"sent {self.wire / 1e6:.1f} MB (ratio {self.raw / self.wire:.1f}x)" if self.wire else "sent 0 MB",
                 f"parameter checksum {param_checksum(model)}"]
        print("\n".join(["", "summary", *[f"  {x}" for x in lines if x]]))
        if task.sample:
            print("\nsample:\n" + task.sample(model, device))
