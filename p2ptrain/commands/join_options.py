"""``join``'s options: their one-line help, and every check that needs no task (``check``).

Apart from ``join`` because it is one job: saying what a user may type and refusing a mistake
before anything loads. ``check`` runs before torch builds the task (2.5-6 s on a laptop): a port
in use, a missing ``--data``, a bad ``--model-size``, a file that cannot be written are each one
line naming the flag, at once, exit 2. The details of each option are in the README ("join's
options"); ``--help`` gives one line each.
"""

from __future__ import annotations

import argparse
import errno
import os

from p2ptrain.commands.cli import secret_option
from p2ptrain.commands.options import (EnvFlag, EnvValue, check_env_flags, env as _env, env_flag as _flag, integer, name,
                                       number, port, sync_every)
from p2ptrain.errors import ConfigError
from p2ptrain.trainer.options import MIN_PEER_TIMEOUT, PEER_TIMEOUT

DEFAULT_MAX_ROUNDS = 300  # without --max-rounds or --duration


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.usage = "python -m p2ptrain join [options]"
    p.formatter_class = lambda prog: argparse.HelpFormatter(prog, max_help_position=30)
    p.epilog = ("Each option is also read from P2PTRAIN_<OPTION> (e.g. P2PTRAIN_MIN_PEERS=2; flags win). "
                "Exit codes: 0 done, 2 a bad option or task, 3 a cluster failure. Details: README, \"join's options\".")
    g = p.add_argument_group("what to train")
    g.add_argument("--task", default=_env("task"), metavar="T", help="charlm, synthetic, a task.py or module:fn")
    g.add_argument("--data", default=_env("data"), metavar="PATH", help="charlm's text file or folder")
    g.add_argument("--model-size", default=_env("model_size"), metavar="S", help="e.g. tiny, small, 100k, 1m, 10m")
    g.add_argument("--device", default=_env("device", "auto"), metavar="D", help="auto, cpu, cuda[:i], mps, xpu")
    g.add_argument("--batch-size", type=integer(1), default=_env("batch_size"), metavar="N",
                   help="samples per step on this peer")
    g.add_argument("--lr", type=number(above=0), default=_env("lr"), metavar="X",
                   help="learning rate (default: the task's)")
    g.add_argument("--seed", type=integer(0), default=_env("seed", "0"), metavar="N",
                   help="model and data seed, the same on every peer (0)")
    g.add_argument("--data-rank", type=integer(0), default=_env("data_rank"), metavar="N",
                   help="train on batch stream N (DDP's rank N)")
    g = p.add_argument_group("the cluster")
    g.add_argument("--cluster", type=name(64), default=_env("cluster", "default"), metavar="NAME",
                   help="cluster name (default)")
    g.add_argument("--secret", default=_env("secret"), metavar="S", help="shared secret (or $P2PTRAIN_SECRET)")
    g.add_argument("--secret-file", default=_env("secret_file"), metavar="PATH", help="read the secret from a file")
    g.add_argument("--peers", default=_env("peers"), metavar="H:P,...", help="other peers' addresses")
    g.add_argument("--tls-cert", default=_env("tls_cert"), metavar="FILE", help="mutual TLS: this machine's cert")
    g.add_argument("--tls-key", default=_env("tls_key"), metavar="FILE", help="mutual TLS: its private key")
    g.add_argument("--tls-ca", default=_env("tls_ca"), metavar="FILE", help="mutual TLS: the cluster's CA certificate")
    g.add_argument("--no-discovery", action="store_true", default=_flag("no_discovery"),
                   help="no UDP beacons: --peers only")
    g.add_argument("--interface", default=_env("interface"), metavar="IF", help="interface for beacons (all)")
    g.add_argument("--host", default=_env("host", "0.0.0.0"), metavar="ADDR", help="address to listen on (0.0.0.0)")
    g.add_argument("--port", type=port(), default=_env("port", "7000"), metavar="N",
                   help="TCP port to listen on (7000; 0: any)")
    g.add_argument("--min-peers", type=integer(1), default=_env("min_peers", "1"), metavar="K",
                   help="train only while K peers are members (1)")
    g.add_argument("--peer-timeout", type=number(at_least=MIN_PEER_TIMEOUT),
                   default=_env("peer_timeout", str(PEER_TIMEOUT)), metavar="S",
                   help=f"drop a peer silent S seconds ({PEER_TIMEOUT:g})")
    g.add_argument("--connect-timeout", type=number(above=0), default=_env("connect_timeout"), metavar="S",
                   help="exit 3 if --min-peers not met in S s")
    g = p.add_argument_group("rounds")
    g.add_argument("--compression", default=_env("compression", "none"), metavar="C",
                   help="none, fp16, bf16, int8, topk:R[+zstd]")
    g.add_argument("--staleness", type=integer(0), default=_env("staleness", "0"), metavar="N",
                   help="0: synchronous; N: updates up to N stale")
    g.add_argument("--target-batch-size", type=integer(1), default=_env("target_batch_size"), metavar="N",
                   help="most samples per update (--staleness >= 1)")
    g.add_argument("--sync-every", type=sync_every(), default=_env("sync_every"), metavar="H|TIME|auto",
                   help="local steps: every H steps, 2s or auto")
    g.add_argument("--outer-lr", type=number(above=0), default=_env("outer_lr"), metavar="X",
                   help="outer learning rate (0.7; 0.8 by time)")
    g.add_argument("--outer-momentum", type=number(at_least=0, note=", below 1"), default=_env("outer_momentum"),
                   metavar="X", help="outer Nesterov momentum (0.9; 0.6 by time)")
    g.add_argument("--weight-prediction", action="store_true", default=_flag("weight_prediction"),
                   help="compute on predicted parameters (--staleness >= 1)")
    g.add_argument("--overlap", action="store_true", default=_flag("overlap"),
                   help="start the ring during backward (--staleness 0)")
    g.add_argument("--reconcile-every", type=integer(0), default=_env("reconcile_every", "10"), metavar="N",
                   help="compare parameters every N updates (10; 0: off)")
    g.add_argument("--max-rounds", type=integer(1), default=_env("max_rounds"), metavar="N",
                   help=f"end after N updates ({DEFAULT_MAX_ROUNDS}; resumed: N more)")
    g.add_argument("--duration", type=number(above=0), default=_env("duration"), metavar="S",
                   help="end S seconds after the coordinator began")
    g.add_argument("--step-delay", type=number(at_least=0), default=_env("step_delay", "0"), help=argparse.SUPPRESS)  # benchmarks
    g.add_argument("--step-busy", action="store_true", help=argparse.SUPPRESS)  # benchmarks: the delay computes
    g.add_argument("--start-at", type=number(at_least=0), default=0.0, help=argparse.SUPPRESS)  # benchmarks: the
    # first batch at this Unix time (peers that do not wait for each other, started together)
    g = p.add_argument_group("output")
    g.add_argument("--save", default=_env("save"), metavar="PATH",
                   help="the trained model's file (.pt or .safetensors)")
    g.add_argument("--no-save", action="store_true", default=_flag("no_save"), help="write no model file at the end")
    g.add_argument("--metrics", default=_env("metrics"), metavar="PATH",
                   help="a record per update: JSON lines, or .csv")
    g.add_argument("--tensorboard", default=_env("tensorboard"), metavar="DIR",
                   help="TensorBoard event files (pip install tensorboard)")
    g.add_argument("--checksum-every", type=integer(1), default=_env("checksum_every", "10"), metavar="N",
                   help="--metrics: parameter checksum every N updates (10)")
    g.add_argument("--eval-every", type=integer(0), default=_env("eval_every", "100"), metavar="N",
                   help="validation loss every N updates (100; 0: end)")
    g.add_argument("--trace", default=_env("trace"), metavar="PATH", help="a Chrome-trace timeline of the rounds")
    g.add_argument("--checkpoint-dir", default=_env("checkpoint_dir"), metavar="DIR",
                   help="checkpoints here; resume from the newest")
    g.add_argument("--checkpoint-every", type=integer(1), default=_env("checkpoint_every", "100"), metavar="N",
                   help="updates between checkpoints (100; and at exit)")


def check(args: argparse.Namespace) -> bytes | None:
    """Every check that needs no task, cheapest first; returns the shared secret. ConfigError
    (one line naming the flag, exit 2) for a mistake."""
    if args.save and isinstance(args.no_save, EnvFlag) and not isinstance(args.save, EnvValue):
        args.no_save = False  # (a flag wins over a variable)
    check_env_flags(args)
    if args.max_rounds is None and args.duration is None:
        args.max_rounds = DEFAULT_MAX_ROUNDS
    _check_combinations(args)
    from p2ptrain.codecs import parse_codec
    from p2ptrain.net.discovery import peer_list

    parse_codec(args.compression)
    peer_list(args.peers or "")
    secret = secret_option(args.secret, args.secret_file)
    from p2ptrain.net import tls

    tls.load(args.tls_cert, args.tls_key, args.tls_ca, names=tls.OPTIONS)  # (all three or none; files that work)
    _check_where(args)
    _check_port_free(args.host, args.port)
    _check_outputs(args)
    from p2ptrain.tasks import check_task_options  # (no torch: said in the first second)

    check_task_options(args.task, args.data, args.model_size)
    return secret


def _check_combinations(args: argparse.Namespace) -> None:
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
    if args.save and args.no_save:
        raise ConfigError("give --save PATH or --no-save, not both")


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
    examples = {"--metrics": "run.jsonl", "--trace": "trace.json", "--save": "model.pt"}
    for flag, path in (("--metrics", args.metrics), ("--trace", args.trace), ("--save", args.save)):
        folder = os.path.dirname(os.path.abspath(path)) if path else None
        if folder is not None and not (os.path.isdir(folder) and os.access(folder, os.W_OK)):
            raise ConfigError(f"{flag} {path}: cannot write there (no such folder, or no permission); give a "
                              "file in a folder that exists")
        if path and os.path.isdir(path):
            raise ConfigError(f"{flag} {path}: a folder, not a file; give a file's path in it (e.g. "
                              f"{os.path.join(path, examples[flag])})")
    for flag, folder in (("--checkpoint-dir", args.checkpoint_dir), ("--tensorboard", args.tensorboard)):
        if not folder:
            continue
        if os.path.isfile(folder):
            raise ConfigError(f"{flag} {folder}: a file, not a folder; give a folder's path (it is created if missing)")
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"{flag} {folder}: cannot create it ({exc.strerror})") from None
        if not os.access(folder, os.W_OK):
            raise ConfigError(f"{flag} {folder}: cannot write there (no permission)")


def _check_port_free(host: str, port_number: int) -> None:
    """A port another program (or another join) listens on: said now, not once the task is built.
    Bound as the listener binds (SO_REUSEADDR: a port in TIME_WAIT is free), then closed again."""
    import socket

    if port_number == 0:
        return
    try:
        infos = socket.getaddrinfo(host, port_number, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError:
        return  # (said by _check_where)
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as s:
        if os.name != "nt":  # (on Windows SO_REUSEADDR would let us bind a port in use)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(address)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise ConfigError(f"--port {port_number}: in use on this machine (another join or program listens "
                                  "there); pick another --port (0: any free one)") from None
            raise ConfigError(f"--host {host}: cannot listen there ({exc.strerror}); give an address of this "
                              "machine, or 0.0.0.0") from None


def _check_outputs(args: argparse.Namespace) -> None:
    """The packages an output needs: --tensorboard needs tensorboard, a .safetensors --save safetensors."""
    import importlib.util

    if args.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError(f"--tensorboard {args.tensorboard}: needs the tensorboard package: pip install "
                          "tensorboard (or drop --tensorboard; --metrics run.csv writes a CSV)")
    if args.save and args.save.endswith(".safetensors") and importlib.util.find_spec("safetensors") is None:
        raise ConfigError(f"--save {args.save}: needs the safetensors package: pip install safetensors (or save "
                          "to a .pt file)")
