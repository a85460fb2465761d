"""Small helpers shared by the bench scripts: statistics, units, tables, free ports.

Imported by path like every bench module (``bench/`` on ``sys.path``); stdlib only.
"""

from __future__ import annotations

import socket
import statistics
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
