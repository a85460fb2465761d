"""``join`` keeps the memory a training step frees for the next step (glibc's malloc, Linux).

Why. glibc gives a freed block back to the OS when it is above its mmap threshold (at most
32 MB) or leaves the heap's top free beyond its trim threshold, so the next step's fresh
tensors (gradients, the optimizer's temporaries, a ring's scratch) fault their pages in and
zero them again. A CPU peer alone on the synthetic task at 10 M parameters faulted 30,000
pages a step: 150 steps took 16.5 s, 6.6 s of it in the kernel. With no mmap for large blocks
and the largest trim threshold, the freed memory stays in the heap and is reused: 9.8 s, 0.4 s
in the kernel. PyTorch's tuning guide says the same of CPU training (it suggests jemalloc or
tcmalloc, which keep freed memory too). The price: the process keeps its peak heap, as those
allocators do. A GPU's allocator caches its memory already; this is the host's side.

With the heap kept, ``warm_loop_thread`` also has the peer's loop thread touch the heap its
first rounds take before the peer opens (``LoopThread``'s docstring has the measurement), and
``warm_training_thread`` the training thread the heap of its first steps, before the peer
opens too.

Only ``join`` does it: it owns its process. A program that uses the library decides for itself
(README: ``MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=2147483647`` in its environment). Settings
of the user's own (those variables, or ``GLIBC_TUNABLES``) are left as they are.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import platform

log = logging.getLogger("p2ptrain.join")

M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # (glibc's malloc.h)
LARGEST = 2**31 - 1  # (mallopt takes an int)
_USERS_OWN = ("MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_", "GLIBC_TUNABLES")
# The same two settings for a process started with them (the benchmarks give them to every
# process they compare, DDP's too, so that each runs on the heap ``join`` gives itself).
KEEP_FREED_ENV = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(LARGEST)}
_kept = False  # (keep_freed_memory took)
# The loop thread's first rounds, measured (1 M parameters, int8 with error feedback): 6.5 float32
# vectors of the model's size in fresh heap; warmed in advance, up to a cap.
WARM_VECTORS = 8
WARM_MAX_BYTES = 1 << 30
# The training thread's first step: the gradients and Adam's two moments, 3 vectors of the
# model's size in fresh heap, and the temporaries of torch's default (foreach) Adam, 8 in all;
# a fused optimizer makes none, 4 do (a backward and a step of 1 M parameters faulted 3,213
# pages cold and 169 warmed with fused Adam; 5,197, 1,398 with 4 vectors, 197 with 8 foreach).
TRAIN_WARM_VECTORS, TRAIN_WARM_VECTORS_FUSED = 8, 4


def _users_own(env) -> list[str]:
    """The malloc settings ``env`` makes itself (they win over ours)."""
    return [name for name in _USERS_OWN if name in env]


def with_kept_heap(env: dict) -> dict:
    """``env`` plus ``KEEP_FREED_ENV``, unless it sets malloc itself (then as it is)."""
    return env if _users_own(env) else {**env, **KEEP_FREED_ENV}


def keeps_freed_memory(env=None) -> bool:
    """Whether this process's malloc keeps freed memory: ``keep_freed_memory`` took, or the
    environment set the same (a benchmark's ``with_kept_heap``)."""
    env = os.environ if env is None else env
    return _kept or all(env.get(name) == value for name, value in KEEP_FREED_ENV.items())


def warm_loop_thread(elems: int) -> None:
    """Have the peer's loop thread touch the heap its first rounds take, for a model of ``elems``
    parameters, before the peer opens (``LoopThread.warm_bytes``): where the heap keeps freed
    memory those rounds then reuse warm pages, and the cost lands before the peer is reachable,
    not in round 0. Nothing where the heap hands freed memory back."""
    from p2ptrain.trainer.loopthread import LoopThread

    if keeps_freed_memory():
        LoopThread.warm_bytes = min(WARM_VECTORS * 4 * elems, WARM_MAX_BYTES)


def warm_training_thread(elems: int, fused: bool = False) -> None:
    """Touch, on this thread (the one that will train), the heap its first steps take for a
    model of ``elems`` parameters: the gradients of the first backward and the optimizer's state
    of its first step are then made of warm pages. Call it before the peer opens (join does): on
    this project's 2-core VMs those first steps faulted their pages in at ~40 us each, 56-185 ms
    for one step with four peers starting at once, in round 0 of every run; and a warm-up after
    the peer opens ran, for the last of them to join, in round 0 beside the others' steps (87 ms
    of touching with four peers on 2 cores: that peer's first contribution came last). Nothing
    where the heap hands freed memory back (then the pages would be gone again before the step).
    ``fused``: the optimizer steps in one kernel (no temporaries): half as much."""
    from p2ptrain.trainer.loopthread import touch_heap

    if keeps_freed_memory():
        vectors = TRAIN_WARM_VECTORS_FUSED if fused else TRAIN_WARM_VECTORS
        nbytes = min(vectors * 4 * elems, WARM_MAX_BYTES)
        touch_heap(nbytes)
        log.debug("malloc: %.1f MB of heap touched for the first steps", nbytes / 1e6)


def keep_freed_memory() -> bool:
    """Tell glibc's malloc to keep freed memory for reuse; True if it took both settings. Does
    nothing (False) on another C library or OS, or where the environment sets malloc itself."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    own = _users_own(os.environ)
    if own:
        log.debug("malloc: the environment sets %s; left as it is", ", ".join(own))
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        done = libc.mallopt(M_MMAP_MAX, 0) == 1 and libc.mallopt(M_TRIM_THRESHOLD, LARGEST) == 1
    except (OSError, AttributeError):
        return False
    log.debug("malloc: freed memory is kept for reuse (no mmap, trim threshold 2 GB): %s", done)
    global _kept
    _kept = done
    return done
