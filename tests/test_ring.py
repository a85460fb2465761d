"""The ring schedule, simulated without sockets: it must compute the sum, in 2(N-1) steps."""

import numpy as np
import pytest

from p2ptrain.collective.ring import RingPlan, chunks_of, split


@pytest.mark.parametrize("length, parts", [(0, 1), (0, 3), (1, 3), (10, 3), (12, 4), (7, 7), (5, 8)])
def test_split_covers_and_is_near_equal(length, parts):
    b = split(length, parts)
    assert len(b) == parts and b[0][0] == 0 and b[-1][1] == length
    assert all(x[1] == y[0] for x, y in zip(b, b[1:]))
    sizes = [s - a for a, s in b]
    assert max(sizes) - min(sizes) <= 1


def test_chunks_of():
    assert chunks_of(3, 10, 4) == [(3, 7), (7, 10)]
    assert chunks_of(5, 5, 4) == []


def simulate(vectors, chunk, buckets=None):
    """Run every peer's plan with perfect links (messages in order), pure numpy."""
    n = len(vectors)
    work = [v.copy() for v in vectors]
    plans = [RingPlan(r, n, len(vectors[0]), chunk, buckets) for r in range(n)]
    for r, p in enumerate(plans):  # what r sends is what r+1 expects, in the same order
        nxt = plans[(r + 1) % n]
        assert [(t.g, t.chunk, t.start, t.stop) for t in p.sends] == \
               [(t.g, t.chunk, t.start, t.stop) for t in nxt.recvs]
    for g in range(len(buckets or [None]) * plans[0].steps if n > 1 else 0):
        outgoing = [{t.chunk: work[r][t.start:t.stop].copy() for t in p.sends if t.g == g}
                    for r, p in enumerate(plans)]
        for r, p in enumerate(plans):
            for t in p.recvs:
                if t.g == g:
                    data = outgoing[(r - 1) % n][t.chunk]
                    if t.reduce:
                        work[r][t.start:t.stop] += data
                    else:
                        work[r][t.start:t.stop] = data
    return work


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("length, chunk", [(0, 4), (1, 4), (5, 2), (17, 3), (100, 7), (64, 64)])
def test_schedule_computes_the_sum(n, length, chunk):
    rng = np.random.default_rng(n * 1000 + length)
    vectors = [rng.integers(-100, 100, length).astype(np.float64) for _ in range(n)]
    for w in simulate(vectors, chunk):
        np.testing.assert_array_equal(w, sum(vectors))


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("length, chunk, bucket", [(100, 7, 30), (17, 3, 5), (64, 64, 16), (9, 2, 100)])
def test_a_plan_of_buckets_computes_the_sum(n, length, chunk, bucket):
    from p2ptrain.collective.ring import bucket_bounds
    rng = np.random.default_rng(n * 1000 + length)
    vectors = [rng.integers(-100, 100, length).astype(np.float64) for _ in range(n)]
    for w in simulate(vectors, chunk, bucket_bounds(length, bucket)):
        np.testing.assert_array_equal(w, sum(vectors))


def test_buckets_start_at_the_buffer_end_and_steps_number_on():
    from p2ptrain.collective.ring import bucket_bounds
    assert bucket_bounds(100, 30) == ((75, 100), (50, 75), (25, 50), (0, 25))
    assert bucket_bounds(100, 100) == ((0, 100),) and bucket_bounds(0) == ((0, 0),)
    p = RingPlan(0, 2, 100, 10, bucket_bounds(100, 50))
    assert [(t.g, t.step, t.start) for t in p.sends if t.chunk == 0] == [(0, 0, 50), (1, 1, 75), (2, 0, 0), (3, 1, 25)]
    assert all(t.after is None for t in p.sends if t.step == 0)  # each bucket's ring starts on our own values
    recv = {(t.g, t.chunk): t for t in p.recvs}
    for t in p.sends:
        if t.after is not None:
            assert (recv[t.after].start, recv[t.after].stop) == (t.start, t.stop)
    assert p.final_chunks == sorted(set(p.final_chunks))
    assert [a for a, _ in p.final_chunks][0] == 0 and sum(b - a for a, b in p.final_chunks) == 100


def test_buckets_must_cover_the_buffer_once():
    for buckets in [((0, 50),), ((0, 60), (50, 100)), ((0, 40), (50, 100)), ((50, 100), (0, 50), (0, 0), (10, 5))]:
        with pytest.raises(ValueError):
            RingPlan(0, 2, 100, 10, buckets)


def test_dependencies_point_to_the_previous_step_same_segment():
    p = RingPlan(1, 4, 40, 3)
    recv = {(t.g, t.chunk): t for t in p.recvs}
    for t in p.sends:
        if t.after is not None:
            assert (recv[t.after].start, recv[t.after].stop) == (t.start, t.stop)
    assert p.steps == 6 and p.owned == 2


def test_bad_plans():
    with pytest.raises(ValueError):
        RingPlan(3, 3, 10)
    with pytest.raises(ValueError):
        RingPlan(0, 1, 10, 0)


def test_chunk_size_rule():
    from p2ptrain.collective.ring import CHUNKS_PER_SEGMENT, DEFAULT_CHUNK_ELEMS, MIN_CHUNK_ELEMS, chunk_elems_for
    assert chunk_elems_for(10, 2) == MIN_CHUNK_ELEMS
    assert chunk_elems_for(1 << 30, 2) == DEFAULT_CHUNK_ELEMS
    assert chunk_elems_for(4 << 20, 2) == (2 << 20) // CHUNKS_PER_SEGMENT
    assert chunk_elems_for(16 << 20, 2, max_elems=1024) == 1024


def test_sparse_codecs_get_fewer_larger_chunks():
    from p2ptrain.codecs import parse_codec
    from p2ptrain.collective.allreduce import _SPARSE_CHUNK_ELEMS, _chunk_elems
    from p2ptrain.collective.ring import chunk_elems_for

    n = 16 << 20  # 64 MiB of float32
    for size in (2, 4):
        dense = chunk_elems_for(n, size)
        for spec in ("none", "fp16", "int8", "topk:0.1"):  # payloads above 1/8 of float32
            assert _chunk_elems(parse_codec(spec), dense, n, size) == dense
        assert _chunk_elems(parse_codec("topk:0.01"), dense, n, size) == _SPARSE_CHUNK_ELEMS
    # at least 1/8 of a segment, never smaller than asked
    assert _chunk_elems(parse_codec("topk:0.01"), 1024, 80_000, 2) == 5000
    assert _chunk_elems(parse_codec("topk:0.01"), 9000, 80_000, 2) == 9000
