"""Checkpoints on disk: write one so that a crash never leaves a bad one, find the newest, load it safely.

    path = save_checkpoint("ckpt", state, round=42)          # ckpt/ckpt-r00000042.pt
    found = load_latest("ckpt")                              # (path, state) or None

How a save stays atomic: ``torch.save`` writes a temporary file in the same directory
(``.ckpt-r00000042.pt.tmp-<pid>-<random>``), which is flushed and fsynced, then
``os.replace`` gives it its final name and the directory is fsynced (not on Windows, which
cannot). A writer killed at any moment leaves the previous checkpoints intact plus, at
worst, a temporary file: names without the ``ckpt-r<round>.pt`` shape are never read, and
the next save deletes temporary files whose writer is gone (a dead pid, or an hour old).
Then all but the newest ``keep`` checkpoints are deleted. One writer per directory.

How a load stays safe: ``torch.load(..., weights_only=True)`` only, which rebuilds tensors,
containers and plain values and never runs code from the file. Everything a trainer saves
round-trips under it as is (tests check): tensors and parameters, dict/OrderedDict, list,
tuple, set, str, bytes, int, float, complex, bool, None, torch dtypes, devices and sizes,
so model and optimizer state dicts (SGD momentum, Adam) too. Nothing is converted; instead
``save_checkpoint`` refuses (ConfigError, naming the key) a state holding anything else,
such as a numpy scalar, so that a checkpoint that could never be loaded is never written.

The file holds ``state`` plus one key, ``FORMAT_KEY``, that marks it as a p2ptrain
checkpoint and numbers its layout; ``load_checkpoint`` checks and removes it.
Failures: ``CheckpointError`` (one line, naming the file and what to do) for a file that
cannot be written or read; ``ConfigError`` for a bad argument.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import sys
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

from p2ptrain.errors import CheckpointError, ConfigError

log = logging.getLogger(__name__)

FORMAT_KEY = "p2ptrain_checkpoint"
FORMAT = 1  # bump when the layout changes; a newer file is refused with "upgrade p2ptrain"
STALE_TEMP_SECONDS = 3600.0  # a temporary file this old is a dead writer's, whatever its pid says

_NAME = re.compile(r"^ckpt-r(\d+)\.pt$")
_TEMP = re.compile(r"^\.ckpt-r\d+\.pt\.tmp-(\d+)-[0-9a-f]+$")
# What torch.load(weights_only=True) rebuilds (torch/_weights_only_unpickler.py), by exact type:
# a subclass (a namedtuple, a defaultdict, a tensor subclass) is refused there, so here too. The
# types torch 2.2 rebuilds (the last torch for Intel Macs), not only this torch's: a checkpoint
# moves between machines. Measured type by type: 2.2.2 refuses Counter, set, bytes, bytearray,
# complex, torch.device and a torch.bfloat16 value (not a bfloat16 tensor), 2.4.1 the first five
# less Counter; torch 2.13 takes them all. (Dtypes are left out whole: none of ours is saved.)
_MAPPINGS = (dict, OrderedDict)
_SEQUENCES = (list, tuple)
_PLAIN = (str, int, float, bool, type(None), torch.Size, torch.Tensor, torch.nn.Parameter)


def checkpoint_name(round: int) -> str:
    """The file name of the checkpoint of ``round``, e.g. ``ckpt-r00000042.pt``."""
    return f"ckpt-r{round:08d}.pt"


def list_checkpoints(directory: str | os.PathLike) -> list[tuple[int, Path]]:
    """Every checkpoint file in ``directory`` as (round, path), oldest first; [] if it does not exist."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise CheckpointError(f"cannot list checkpoint directory {str(directory)!r} ({exc.strerror}): "
                              "check its permissions") from None
    found = [(int(m.group(1)), Path(directory) / n) for n in names if (m := _NAME.match(n))]
    return sorted(found)


def latest_checkpoint(directory: str | os.PathLike) -> Path | None:
    """The newest checkpoint (by the round in its name), or None. Temporary files are ignored."""
    found = list_checkpoints(directory)
    return found[-1][1] if found else None


def save_checkpoint(directory: str | os.PathLike, state: dict, round: int, keep: int = 3) -> Path:
    """Write ``state`` as the checkpoint of ``round`` in ``directory`` (created if needed),
    atomically, then delete all but the newest ``keep`` checkpoints. Returns its path.

    Call it with the training loop paused (or a copy of the state): the tensors are read
    while they are written. Raises CheckpointError when the disk refuses (full, read-only,
    permissions), leaving no temporary file behind; ConfigError for a bad argument."""
    if type(round) is not int or round < 0:
        raise ConfigError(f"checkpoint round must be a non-negative int, got {round!r}")
    if type(keep) is not int or keep < 1:
        raise ConfigError(f"keep must be an int of at least 1, got {keep!r}")
    if not isinstance(state, dict):
        raise ConfigError(f"a checkpoint state must be a dict, got {type(state).__name__}")
    if "round" in state and state["round"] != round:
        raise ConfigError(f"state['round'] is {state['round']!r} but the checkpoint is for round {round}")
    _check_loadable(state, "state")
    directory = Path(directory)
    path = directory / checkpoint_name(round)
    temp = directory / f".{path.name}.tmp-{os.getpid()}-{os.urandom(4).hex()}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        _remove_stale_temps(directory)
        with open(temp, "wb") as f:
            _torch_save({**state, FORMAT_KEY: FORMAT}, f)
            f.flush()
            _fsync_file(f.fileno())
        os.replace(temp, path)
        _fsync_dir(directory)
    except OSError as exc:
        _unlink_quietly(temp)
        raise CheckpointError(f"cannot write checkpoint {str(path)!r} ({exc.strerror or exc}): free some disk "
                              "space or fix the directory's permissions, or pick another checkpoint directory") from None
    except BaseException:
        _unlink_quietly(temp)
        raise
    newest = list_checkpoints(directory)
    if newest and newest[-1][0] > round:
        log.warning("saved %s, but %s has a later round: resuming will start from that one",
                    path.name, newest[-1][1].name)
    for _, old in [c for c in newest if c[1] != path][:max(0, len(newest) - keep)]:
        _unlink_quietly(old)
    return path


def load_checkpoint(path: str | os.PathLike) -> dict:
    """The state saved in ``path``, its tensors on the CPU. Raises CheckpointError, naming
    the file, when it is missing, unreadable, truncated, corrupt or not a p2ptrain checkpoint."""
    name = str(path)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"no checkpoint file {name!r}: check the path") from None
    except OSError as exc:
        raise CheckpointError(f"cannot read checkpoint {name!r} ({exc.strerror or exc}): "
                              "check its permissions") from None
    except Exception as exc:  # noqa: BLE001 - torch raises many types (zip, pickle, EOF, Runtime) for a bad file
        lines = str(exc).strip().splitlines() or [type(exc).__name__]
        refused = [line[line.index("WeightsUnpickler error"):] for line in lines if "WeightsUnpickler error" in line]
        if refused:  # (readable, but not by this torch's safe loader: a newer torch wrote it)
            raise CheckpointError(f"checkpoint {name!r} cannot be read safely by this torch {torch.__version__} "
                                  f"({refused[0].split(' was not')[0][:120]}): install the torch that wrote it, or a "
                                  "newer one") from None
        why = lines[0][:160]
        raise CheckpointError(f"checkpoint {name!r} is truncated or corrupt ({why}): "
                              "delete it to resume from the one before") from None
    fmt = state.get(FORMAT_KEY) if isinstance(state, dict) else None
    if type(fmt) is not int:
        raise CheckpointError(f"{name!r} is not a p2ptrain checkpoint: point at a file that save_checkpoint wrote")
    if fmt > FORMAT:
        raise CheckpointError(f"checkpoint {name!r} has format {fmt}, newer than this p2ptrain reads "
                              f"({FORMAT}): upgrade p2ptrain")
    del state[FORMAT_KEY]
    return state


def load_latest(directory: str | os.PathLike) -> tuple[Path, dict] | None:
    """(path, state) of the newest checkpoint in ``directory`` that loads, or None where it
    holds none. A newer one that does not load is skipped with a warning (it stays on disk for
    a human to see). Where none loads, ``CheckpointError``: a run that started over there
    would prune them, the work of the run that wrote them (measured: a torch too old to read
    them started over and deleted the oldest)."""
    found = list_checkpoints(directory)
    first: CheckpointError | None = None
    for _, path in reversed(found):
        try:
            return path, load_checkpoint(path)
        except CheckpointError as exc:
            log.warning("skipping a checkpoint: %s", exc)
            first = first or exc
    if first is not None:
        raise CheckpointError(f"none of the {len(found)} checkpoint(s) in {str(directory)!r} loads, the newest "
                              f"because {first}; left as they are: to start over, use another directory")
    return None


# -- helpers ----------------------------------------------------------------------------------

def _check_loadable(value: Any, where: str, depth: int = 0) -> None:
    """Raise ConfigError, naming the key, at the first value ``weights_only`` would refuse."""
    if depth > 64:
        raise ConfigError(f"{where} is nested more than 64 levels deep: is it a cycle?")
    kind = type(value)
    if kind in _MAPPINGS:
        for k, v in value.items():
            _check_loadable(k, f"a key of {where}", depth + 1)
            _check_loadable(v, f"{where}[{k!r}]", depth + 1)
    elif kind in _SEQUENCES:
        for i, v in enumerate(value):
            _check_loadable(v, f"{where}[{i}]", depth + 1)
    elif kind not in _PLAIN:
        raise ConfigError(f"{where} is a {type(value).__module__}.{type(value).__qualname__}, which a safe "
                          "load (weights_only) refuses, in torch 2.2 at least: store it as a tensor, str, int, "
                          "float, bool, list or dict (bytes as hex)")


def _fsync_file(fd: int) -> None:
    # macOS's fsync leaves the data in the drive's cache; F_FULLFSYNC flushes that too.
    if sys.platform == "darwin":
        import fcntl

        try:
            fcntl.fcntl(fd, fcntl.F_FULLFSYNC)
            return
        except OSError:
            pass
    os.fsync(fd)


def _fsync_dir(directory: Path) -> None:
    """Make the rename durable. Windows cannot open a directory; some file systems refuse."""
    if os.name == "nt":
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return False  # our own leftover: this process is not writing it now
    if os.name == "nt":
        return True  # os.kill(pid, 0) would terminate it on Windows: leave it to the age rule
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: another user's live process
        return True
    return True


def _remove_stale_temps(directory: Path) -> None:
    now = time.time()
    for name in os.listdir(directory):
        m = _TEMP.match(name)
        if not m:
            continue
        path = directory / name
        try:
            old = now - path.stat().st_mtime > STALE_TEMP_SECONDS
        except FileNotFoundError:
            continue
        if old or not _pid_alive(int(m.group(1))):
            log.info("removing %s, left by a writer that stopped mid-save", name)
            _unlink_quietly(path)


def _torch_save(state: dict, f) -> None:
    """``torch.save``, with a disk's refusal raised as the ``OSError`` it is: torch's zip writer
    reports a full disk as ``RuntimeError: [enforce fail ...] unexpected pos`` from closing the
    archive, the ``OSError`` only its context."""
    try:
        torch.save(state, f)
    except RuntimeError as exc:
        cause = exc.__cause__ or exc.__context__
        if isinstance(cause, OSError):
            raise cause from None
        raise


def _unlink_quietly(path: Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
