"""How long this process's threads ran, and how long they waited runnable for a CPU (Linux's
per-thread schedstat): a share of waiting that stays high says the machine has no core to spare,
so a ring run beside the compute only slows both (``pacing.Pacing.cores_short``)."""

from __future__ import annotations

import os


def cpu_times(pid: int | str = "self") -> tuple[float, float] | None:
    """Seconds the threads of process ``pid`` ran on a CPU, and waited runnable for one (other
    threads or processes had its cores), from ``/proc/PID/task/*/schedstat``; None where there is
    none (not Linux, or no such process). A thread that ended takes its seconds with it."""
    run = queued = 0
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/schedstat", encoding="ascii") as f:
                    fields = f.read().split()
            except FileNotFoundError:  # (the thread ended meanwhile)
                continue
            run, queued = run + int(fields[0]), queued + int(fields[1])
    except (OSError, ValueError, IndexError):
        return None
    return run / 1e9, queued / 1e9
