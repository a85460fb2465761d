"""Small helpers shared by the bench scripts: statistics, units, tables, free ports.

Imported by path like every bench module (``bench/`` on ``sys.path``); stdlib only.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import statistics
import sys
import threading
import time
from typing import Iterable, Sequence

MiB = 1 << 20


def median(xs: Iterable[float]) -> float:
    return statistics.median(list(xs))


def busbw(algbw: float, n: int) -> float:
    """Bus bandwidth of an allreduce: what each link carries, 2(N-1)/N of the buffer."""
    return algbw * 2 * (n - 1) / n if n > 1 else algbw


def fmt_size(nbytes: float) -> str:
    for unit, k in (("GiB", 1 << 30), ("MiB", MiB), ("KiB", 1 << 10)):
        if nbytes >= k:
            return f"{nbytes / k:g} {unit}"
    return f"{nbytes:g} B"


def fmt_rate(bytes_per_s: float) -> str:
    """Bytes per second as MB/s or GB/s (decimal, like link rates)."""
    if bytes_per_s >= 1e9:
        return f"{bytes_per_s / 1e9:.2f} GB/s"
    return f"{bytes_per_s / 1e6:.1f} MB/s"


def table(rows: Sequence[Sequence[object]], header: Sequence[str]) -> str:
    """A Markdown table with columns padded to width."""
    cells = [[str(c) for c in header]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[j]) for r in cells) for j in range(len(header))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in cells]
    lines.insert(1, "| " + " | ".join("-" * w for w in widths) + " |")
    return "\n".join(lines)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free right now on ``host`` (another process may still take it)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def finally_on_sigterm() -> None:
    """Turn SIGTERM into ``SystemExit`` in a benchmark's parent, so that its ``finally`` blocks
    kill the workers it started (some in sessions of their own) when a test or a user stops it;
    by default SIGTERM ends the process at once and leaves them running. Leaves a handler
    someone else installed in place."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _raise_exit)


def _raise_exit(signum, frame):  # noqa: ARG001
    raise SystemExit(128 + signum)


def exit_now(code: int) -> None:
    """End a baseline worker whose results are written: flush and leave without the
    interpreter's teardown, where torch's gloo and store threads can still abort the process
    ("terminate called without an active exception", exit -6; seen in a CI run after the
    group was destroyed and every figure reported)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


@contextlib.contextmanager
def gloo_group(master: str, port: int, rank: int, world: int, timeout_s: float):
    """torch.distributed over gloo for the body, torn down so that no rank aborts at its end.

    Rank 0 hosts the rendezvous store. A rank still tearing its group down when rank 0 has
    exited dies by SIGABRT inside torch (seen once in three loaded test runs, after every
    round had finished). So all ranks meet in a barrier, each destroys its group and checks
    in on the store, and rank 0, the store's host, leaves only once every rank has.
    """
    from datetime import timedelta

    import torch.distributed as dist

    store = dist.TCPStore(master, port, world, is_master=rank == 0, timeout=timedelta(seconds=timeout_s))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s))
    try:
        yield
        dist.barrier()  # no rank tears gloo down while another still talks to it
    finally:
        dist.destroy_process_group()
    store.add("p2ptrain/left", 1)
    deadline = time.monotonic() + min(timeout_s, 30.0)
    while rank == 0 and store.add("p2ptrain/left", 0) < world and time.monotonic() < deadline:
        time.sleep(0.01)
