"""``python -m p2ptrain COMMAND``: the command line.

Each command lives in its own module ``p2ptrain.commands.<name>`` (``-`` as ``_``) exposing ``HELP`` (one line),
``add_arguments(parser)`` and ``run(args) -> int``; this file only dispatches, importing a
command's module (and torch) only when that command runs.

Exit codes: 0 done, 2 usage (a bad flag or input, with a one-line error), 3 a cluster failure.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from p2ptrain import __version__

from p2ptrain.commands.options import Parser
from p2ptrain.net import auth
from p2ptrain.errors import ConfigError, P2PTrainError

EXIT_OK = 0
EXIT_USAGE = 2
EXIT_CLUSTER = 3

COMMANDS = ("join", "peers", "doctor", "tls-init")


def secret_option(secret: str | None, secret_file: str | None) -> bytes | None:
    """The shared secret of ``--secret`` / ``--secret-file`` (else $P2PTRAIN_SECRET); an empty
    one is an error, never a silently open cluster."""
    if secret is not None and secret_file:
        raise ConfigError("give --secret or --secret-file, not both")
    if secret_file:
        try:
            with open(secret_file, "rb") as f:
                return auth.secret_from(f.read().rstrip(b"\r\n"))
        except OSError as exc:
            raise ConfigError(f"cannot read --secret-file {secret_file!r}: {exc.strerror}") from None
    return auth.secret_from(secret)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="python -m p2ptrain",
        description="Train one PyTorch model on several machines of a LAN at once (MPS, CUDA, CPU), "
        "peer to peer: run the same command on every machine.",
    )
    parser.add_argument("--version", action="version", version=f"p2ptrain {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    parser.commands = {}  # name -> its parser (it reports its own usage errors)
    for name in COMMANDS:
        module = importlib.import_module(f"p2ptrain.commands.{name.replace('-', '_')}")
        p = sub.add_parser(name, help=module.HELP, description=module.HELP)
        p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"], metavar="L",
                       help="debug, info (default), warning, error")
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
        parser.commands[name] = p
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # (the command's own usage, not the top level's)
        parser.commands.get(args.command, parser).unknown(unknown)
    if args.command is None:
        parser.print_help()
        return EXIT_USAGE
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    prog = parser.commands[args.command].prog  # (as a usage error names it: one name for every line)
    try:
        return args._run(args)
    except ConfigError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except P2PTrainError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return EXIT_CLUSTER
    except KeyboardInterrupt:  # (``join`` leaves politely on Ctrl-C once it runs: this is before, or a second one)
        print(f"\n{prog}: interrupted", file=sys.stderr)
        return 130
