"""The data path's threads: codec work, reductions and hashing off the event loop.

numpy, zstd and xxhash release the GIL on large buffers, so with a few threads a ring's
encoding, decoding, adding and hashing run beside the event loop's socket work, and one peer
uses several cores. A process gets ``min(4, max(2, cores // 4))`` threads: 2 on a 2-core
machine, where two threads measured faster than inline even with every core busy (64 MiB on
loopback, load average 6-10: N=2 fp32 0.79 -> 1.05 of gloo's busbw, int8 0.45 -> 0.69; N=4
fp32 0.46 -> 0.60; bench/allreduce.py --threads 0,2), 4 with 16 cores or more.
``P2PTRAIN_DATA_THREADS=N`` overrides (0: inline). One pool per process, shared by its
rings, created on first use.

A compiled codec (``Codec.compiled``: int8 where numba is in use) keeps its chunks on the
event loop where the machine has fewer than ``COMPILED_INLINE_BELOW`` cores: its pass over a
chunk costs about what the hop to a thread and back does, and on 2 cores the threads only
took turns with the other peers'. Measured on 2 cores at 1 Gbit/s, int8, inline against 2
threads: training 9 M parameters, batch 64, N = 2 (``bench/lan.py --local 2 --netns 1gbit
--model-size 9m --batch-size 64 --train-codecs int8``, three interleaved pairs) 882-904 against
754-776 samples/s, time to loss 0.39x DDP's against 0.44x; N = 4 732-743 against 755-760
samples/s, within the machine's spread; ``bench/allreduce.py --netns 1gbit``, 16 and 64 MiB,
N = 2 and 4, as fast or faster, at 15.1-74.7 against 20.8-86.2 ms of CPU a peer. With more
cores the pool stays: the kernels have not been measured there.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

from p2ptrain.errors import ConfigError

ENV = "P2PTRAIN_DATA_THREADS"
MAX_THREADS = 4
COMPILED_INLINE_BELOW = 8  # cores

_pool: ThreadPoolExecutor | None = None
_lock = threading.Lock()


def default_threads() -> int:
    """Threads for the data path on this machine (see the module docstring). A bad
    ``P2PTRAIN_DATA_THREADS`` is a ``ConfigError`` (``join`` checks it before it starts)."""
    value = os.environ.get(ENV, "").strip()
    if value:
        if not value.isdigit():
            raise ConfigError(f"{ENV}={value!r}: expected a number of threads (0: none)")
        return int(value)
    return min(MAX_THREADS, max(2, (os.cpu_count() or 1) // 4))


def shared_pool() -> ThreadPoolExecutor | None:
    """The process's data-path pool, or None when the data path runs inline."""
    global _pool
    threads = default_threads()
    if threads == 0:
        return None
    with _lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(threads, thread_name_prefix="p2ptrain-data")
        return _pool


def inline_for(codec) -> bool:
    """A ring of ``codec`` runs its data work on the event loop, pool or not (the docstring)."""
    return codec.compiled and (os.cpu_count() or 1) < COMPILED_INLINE_BELOW
