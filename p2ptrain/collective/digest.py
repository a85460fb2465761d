"""The digest of an allreduce's result: 16 bytes, equal on two peers exactly when their
results are bit-identical (up to a 64-bit hash collision per chunk).

Each chunk is hashed (xxh3-64, ``chunk_digest``) where its values become final, while the ring
runs (``RingAllreduce``: by the owner after encoding its sum, by every other peer after
decoding the all-gather's bytes), and ``combine`` puts the chunks' hashes together in buffer
order: no pass over the whole buffer at the ring's end. ``buffer_digest`` is the same from a
whole result at once, for checks and tests.
"""

from __future__ import annotations

import numpy as np
import xxhash

from p2ptrain.collective.ring import RingPlan


def chunk_digest(values: np.ndarray) -> int:
    return xxhash.xxh3_64_intdigest(values)


def combine(digests: dict[int, int]) -> bytes:
    """Chunk digests (start -> ``chunk_digest``) in buffer order, as one 16-byte digest."""
    starts = sorted(digests)
    table = np.array([starts, [digests[s] for s in starts]], np.uint64)
    return xxhash.xxh3_128_digest(table.T.copy())


def buffer_digest(values: np.ndarray, plan: RingPlan) -> bytes:
    """What ``RingAllreduce.sum_digest`` gives for a result ``values`` under ``plan``, from the
    whole buffer at once."""
    return combine({a: chunk_digest(values[a:b]) for a, b in plan.final_chunks})
