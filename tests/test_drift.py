"""The parameter sketch and the drift between two replicas (``p2ptrain.cluster.drift``): equal
bits say identical, rounding-level drift stays under TOLERANCE, a real drift passes it."""

import numpy as np
import pytest
import torch

from p2ptrain.cluster import drift
from p2ptrain.cluster.drift import MAX_GROUPS, TOLERANCE, compare, decode, param_sketch

pytestmark = pytest.mark.timeout(60)


def params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(300, 700, generator=g) * 0.05, torch.randn(700, generator=g) * 0.01,
            torch.randn(10, 300, generator=g) * 0.05, torch.zeros(10)]


def moved(ps, i, delta):
    out = [p.clone() for p in ps]
    out[i] += delta
    return out


def test_identical_parameters_have_identical_sketches():
    a, b = params(), params()
    d = compare(param_sketch(a), param_sketch(b))
    assert d.identical and d.relative == 0.0 and not d.beyond


def test_rounding_level_drift_is_seen_and_within_tolerance():
    a = params()
    ulp = [torch.nextafter(p, torch.full_like(p, float("inf"))) for p in a]  # every weight one ulp up
    d = compare(param_sketch(a), param_sketch(ulp))
    assert not d.identical and d.relative < TOLERANCE / 10, d
    one = [p.clone() for p in a]
    one[1][3] = torch.nextafter(one[1][3], torch.tensor(1.0))  # one weight, one ulp
    assert not compare(param_sketch(a), param_sketch(one)).identical


@pytest.mark.parametrize("rel", [1e-4, 1e-3, 1.0])
def test_a_drift_beyond_tolerance_is_beyond(rel):
    a = params()
    noise = torch.randn(a[0].shape, generator=torch.Generator().manual_seed(7))
    b = moved(a, 0, noise * (rel * a[0].norm() / noise.norm()))
    d = compare(param_sketch(a), param_sketch(b))
    assert d.beyond and d.group == 0 and rel / 3 < d.relative < rel * 3, d


def test_a_small_tensor_that_drifts_is_not_hidden_by_a_big_one():
    a = params()
    b = moved(a, 3, torch.full((10,), 1e-3))  # the zero bias moves; the big matrix does not
    d = compare(param_sketch(a), param_sketch(b))
    assert d.beyond, d


def reference_rows(tensors):
    """The sketch's definition, element by element in numpy (another summation order than the
    device's blocked matmul): each element's sign is a product of the three tables."""
    out = []
    for i, t in enumerate(tensors):
        x = t.double().reshape(-1).numpy()
        idx = np.arange(len(x))
        within = idx % drift._CHUNK
        signs = (drift._COLS[within % drift._L] * drift._ROWS[within // drift._L]
                 * drift._CHUNKS[(idx // drift._CHUNK) % drift._MAX_CHUNKS])
        out.append([len(x), x @ x, *((x @ signs) * drift._TENSORS[i])])
    return np.array(out)


def test_the_sketch_is_its_definition_whatever_order_sums_it():
    """A device sums in its own order (blocked, threaded); the sketch is a definition, and any
    order gives it to about 1e-13: a CPU peer and a CUDA peer compare the same numbers. The
    tensor past one chunk checks the chunk and tail signs."""
    a = params() + [torch.randn(drift._CHUNK + 1000) * 0.02]
    got = decode(param_sketch(a))[:, 1:]
    want = reference_rows(a)
    scale = np.sqrt(want[:, 1:2])
    assert np.array_equal(got[:, 0], want[:, 0])
    assert np.all(np.abs(got[:, 1:] - want[:, 1:]) <= 1e-12 * np.maximum(scale, 1.0)), (got, want)


def test_many_tensors_and_half_precision_fit_a_bounded_sketch():
    many = [torch.randn(3, 5) for _ in range(500)]
    assert len(decode(param_sketch(many))) == MAX_GROUPS
    half = [torch.randn(64, 64).bfloat16(), torch.randn(64).half()]
    assert compare(param_sketch(half), param_sketch([t.clone() for t in half])).identical


def test_malformed_or_mismatched_sketches_are_refused():
    a = param_sketch(params())
    with pytest.raises(ValueError):
        decode(b"\0" * 13)
    with pytest.raises(ValueError):
        decode(b"\0" * 8 * (drift.K + 2) * (MAX_GROUPS + 1))
    with pytest.raises(ValueError, match="not the same model"):
        compare(a, param_sketch(params()[:2]))
    nan = param_sketch(moved(params(), 0, float("nan")))
    assert compare(a, nan).beyond


def test_a_sketch_started_is_that_of_the_parameters_at_its_start():
    """``start_sketch`` takes the numbers now and reads them later (on CUDA by a non-blocking
    copy; on a CPU at once): an update after the start does not change what it reads."""
    from p2ptrain.cluster.drift import start_sketch

    params = [torch.randn(300, 40), torch.randn(7).half()]
    before = param_sketch(params)
    read = start_sketch(params)
    with torch.no_grad():
        params[0] += 1.0  # (the next update)
    assert read.ready() and read.result() == before != param_sketch(params)
    assert start_sketch([]).result() == b""
