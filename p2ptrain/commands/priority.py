"""``join`` runs its training thread below its network threads (Linux): a ring waits on them.

A round's ring is a chain of hops, each waiting for the previous peer's thread to receive,
reduce and send; training is throughput. On a peer whose cores the compute keeps busy (a CPU
peer; several peers on one machine) every hop also waited for a core: 4 peers on 2 cores at
1 Gbit/s, local steps, a 1 M-parameter ring took 65-85 ms beside 38-45 ms with the training
thread at nice 10 (three interleaved pairs). So ``join`` gives the thread that trains (the one that enters
``training_below_network``, after the cluster's threads have started: threads inherit the
value, and only they send) a nice value ``TRAINING_NICE`` above its own. Where Linux groups processes by session
(autogroup, the desktop default) or by cgroup, nice weighs threads against others of that
group only, so the user's other programs see no change; a process that shares its group with
other busy ones gives them more of the CPU. ``P2PTRAIN_NETWORK_FIRST=0`` leaves it as it is.
Only ``join`` does it (it owns its process); a library user's threads are theirs.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading

from p2ptrain.switches import env_switch

log = logging.getLogger("p2ptrain.join")

ENV = "P2PTRAIN_NETWORK_FIRST"
TRAINING_NICE = 10  # (weight 110 against nice 0's 1,024: a waking network thread gets a core at once)


def network_first_enabled() -> bool:
    """``P2PTRAIN_NETWORK_FIRST``: 1 (default) or 0; anything else is a ConfigError."""
    return env_switch(ENV, default=True)


@contextlib.contextmanager
def training_below_network():
    """Within: this thread's nice value raised by ``TRAINING_NICE`` (Linux: nice is per thread
    there). After: put back where the OS lets us (root, or RLIMIT_NICE; a ``join`` run in a
    thread or a test's process must not leave it low), else it stays (the process is ending)."""
    before = _lower() if sys.platform.startswith("linux") and network_first_enabled() else None
    try:
        yield
    finally:
        if before is not None:
            try:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), before)
            except OSError:
                pass


def _lower() -> int | None:
    """The nice value before (None: not changed, e.g. a sandbox that forbids it)."""
    tid = threading.get_native_id()
    try:
        before = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, min(19, before + TRAINING_NICE))
    except OSError as exc:
        log.debug("training thread's priority left as it is: %s", exc)
        return None
    log.debug("training thread at nice %d, below the network threads (P2PTRAIN_NETWORK_FIRST=0: off)",
              os.getpriority(os.PRIO_PROCESS, tid))
    return before
