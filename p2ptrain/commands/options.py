"""Option values for the commands: each flag (or its ``P2PTRAIN_*`` variable) is checked while
the command line is parsed, before anything starts, and a bad one is one line that names the
flag (or the variable) and what is allowed, exit 2.

    p.add_argument("--lr", type=number(above=0), default=env("lr"))

``env(name)`` reads ``P2PTRAIN_<NAME>`` as the option's default. argparse converts a string
default with the option's ``type`` only when the command runs and the flag was not given, so
a bad variable never breaks ``--help``, ``--version`` or another command; it is marked
(``EnvValue``) so that the error names the variable rather than the flag. On/off variables
(``env_flag``) are checked by ``check_env_flags`` when the command runs.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

from p2ptrain.errors import ConfigError

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")


class EnvValue(str):
    """A default read from ``P2PTRAIN_<NAME>``: it knows its variable's name."""

    variable: str

    def __new__(cls, value: str, variable: str):
        self = super().__new__(cls, value)
        self.variable = variable
        return self


def variable(name: str) -> str:
    return f"P2PTRAIN_{name.upper().replace('-', '_')}"


def env(name: str, default: str | None = None):
    """``P2PTRAIN_<NAME>`` as an option's default (converted and checked by its ``type``)."""
    value = os.environ.get(variable(name))
    return EnvValue(value, variable(name)) if value is not None else default


class EnvFlag:
    """An on/off variable's value, until ``check_env_flags`` says whether it is on."""

    def __init__(self, name: str, value: str):
        self.name, self.value = variable(name), value

    def __bool__(self) -> bool:
        return self.value.strip().lower() in _TRUE


def env_flag(name: str):
    """The default of a ``store_true`` option from ``P2PTRAIN_<NAME>`` (1/0, true/false, yes/no, on/off)."""
    value = os.environ.get(variable(name))
    return False if value is None else EnvFlag(name, value)


def check_env_flags(args: argparse.Namespace) -> None:
    """Turn on/off variables into booleans; a value that is neither raises ``ConfigError`` (exit 2)."""
    for key, value in vars(args).items():
        if isinstance(value, EnvFlag):
            if value.value.strip().lower() not in _TRUE + _FALSE:
                raise ConfigError(f"{value.name}={value.value!r}: expected 1 or 0 (true/false, yes/no, on/off)")
            setattr(args, key, bool(value))


def _checked(kind, what: str, ok):
    """An argparse ``type``: ``kind(text)``, then ``ok(value)``, else an error saying ``what``."""
    def convert(text: str):
        try:
            value = kind(text)
        except (TypeError, ValueError):
            value = None
        if value is None or not ok(value):
            shown = text if len(str(text)) <= 40 else str(text)[:40] + "..."
            where = f"{text.variable}={shown!r}" if isinstance(text, EnvValue) else repr(shown)
            raise argparse.ArgumentTypeError(f"{where}: expected {what}")
        return value
    convert.__name__ = what  # (argparse names the type in some messages)
    return convert


def integer(low: int | None = None, high: int | None = None, note: str = ""):
    """An int in [low, high]."""
    what = ("an integer" + (f", at least {low}" if low is not None and high is None else "")
            + (f" {low}..{high}" if low is not None and high is not None else "") + note)
    return _checked(int, what, lambda v: (low is None or v >= low) and (high is None or v <= high))


def number(above: float | None = None, at_least: float | None = None, note: str = ""):
    """A finite float, > ``above`` or >= ``at_least``."""
    what = ("a number" + (f" above {above:g}" if above is not None else "")
            + (f", at least {at_least:g}" if at_least is not None else "") + note)
    return _checked(float, what, lambda v: math.isfinite(v) and (above is None or v > above)
                    and (at_least is None or v >= at_least))


def name(max_len: int):
    """A name of 1..max_len printable characters."""
    return _checked(str, f"a name of 1..{max_len} printable characters",
                    lambda v: 1 <= len(v) <= max_len and v.isprintable())


def sync_every():
    """``--sync-every``: a count of inner steps (an int, as the library takes it), or a window of
    time or ``auto`` (their canonical text: ``2s``, ``500ms``, ``auto``; ``cluster.sync_every``)."""
    from p2ptrain.cluster.sync_every import MAX_WINDOW_S, MIN_WINDOW_S, parse_sync_every

    def kind(text: str):
        every = parse_sync_every(text)  # (a ConfigError is a ValueError: the one line below)
        return every.steps if every.steps is not None else str(every)
    return _checked(kind, f"a count of inner steps >= 1 (e.g. 16), a window of time {MIN_WINDOW_S * 1e3:g}ms.."
                          f"{MAX_WINDOW_S:g}s (e.g. 2s, 500ms) or auto", lambda v: True)


def port(low: int = 0):
    return integer(low, 65535, " (0: any free port)" if low == 0 else "")


class Parser(argparse.ArgumentParser):
    """One line on a usage error, naming the command (a subcommand's own parser reports its own
    errors, unknown flags included), and exit 2. No abbreviations (``allow_abbrev=False``):
    ``--min-peer 2`` is refused, naming the flag meant, rather than taken for ``--min-peers``
    (an abbreviation that works today breaks when an option is added that shares its start)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        usage_error(f"{message} ({self.prog} --help lists the options)", self.prog)

    def unknown(self, flags: list[str]):
        """Arguments no option takes: one line, naming the flag each was most likely meant to be."""
        import difflib

        known = [s for a in self._actions for s in a.option_strings]
        meant = [f"{x} (did you mean {close[0]}?)" if (close := difflib.get_close_matches(x.split("=")[0], known, 1, 0.8))
                 else x for x in flags if x.startswith("-")]
        self.error(f"unrecognized arguments: {' '.join(meant or flags)}")


def usage_error(message: str, prog: str | None = None):
    print(f"{prog or 'python -m p2ptrain'}: error: {message}", file=sys.stderr)
    raise SystemExit(2)
