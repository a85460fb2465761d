"""top-k's compiled candidate pass (``codecs._topk_kernels``) selects exactly what numpy's
passes select: the same indices on every kind of chunk, and so the same payloads."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest

from p2ptrain.codecs import _topk_kernels, parse_codec
from p2ptrain.codecs._topk import TopK

pytestmark = pytest.mark.skipif(_topk_kernels.load() is None,
                                reason="numba is not installed (or P2PTRAIN_NUMBA=0): only numpy's passes run")


def numpy_select(t: TopK, x: np.ndarray, monkeypatch) -> np.ndarray:
    with monkeypatch.context() as m:
        m.setattr(_topk_kernels, "load", lambda: None)
        return t.select(x)


def chunk(kind: str, n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(n).astype(np.float32)
    if kind == "ties":  # few distinct magnitudes: the cut falls inside a run of equal values
        x = rng.integers(-3, 4, n).astype(np.float32)
    elif kind == "signed-zeros":
        x[rng.random(n) < 0.9] = 0
        x[::7] = -0.0
    elif kind == "inf":
        x[rng.integers(0, n, 3)] = np.inf
        x[rng.integers(0, n, 2)] = -np.inf
    elif kind == "nan":
        x[rng.integers(0, n, 2)] = np.nan
    elif kind == "sampled-big":  # the sample sees only big values: its bound is too high
        x *= 1e-3
        x[:: max(1, n // 4096)] = rng.uniform(1, 2, x[:: max(1, n // 4096)].size)
    elif kind == "sampled-runs-big":  # the same for a large chunk's sample, runs of 4 neighbours
        x *= 1e-3
        runs = n // 4
        if runs > 4096:
            rows = x[: runs * 4].reshape(runs, 4)[:: runs // 1024]
            rows[:] = rng.uniform(1, 2, rows.shape)
    elif kind == "denormal":
        x *= np.float32(1e-40)
    return x


@pytest.mark.parametrize("kind", ["normal", "ties", "signed-zeros", "inf", "nan", "sampled-big", "sampled-runs-big",
                                  "denormal"])
@pytest.mark.parametrize("n", [1, 1000, 4097, 70_001, 1 << 19])
@pytest.mark.parametrize("ratio", ["1/1000", "1/100", "3/10"])
def test_the_compiled_pass_selects_what_numpy_selects(kind, n, ratio, monkeypatch):
    t = TopK(Fraction(ratio))
    for seed in range(3):
        x = chunk(kind, n, seed)
        got = t.select(x)
        assert got.dtype == np.intp
        assert np.array_equal(got, numpy_select(t, x, monkeypatch)), (kind, n, ratio, seed)


def test_a_chunk_with_nan_is_refused_either_way(monkeypatch):
    codec = parse_codec("topk:0.01")
    x = chunk("nan", 1 << 16, 0)
    with pytest.raises(Exception) as compiled:
        codec.encode(x)
    with monkeypatch.context() as m:
        m.setattr(_topk_kernels, "load", lambda: None)
        with pytest.raises(Exception) as numpy:
            codec.encode(x)
    assert type(compiled.value) is type(numpy.value) and "topk" in str(compiled.value)


def test_the_codec_counts_as_compiled_and_its_ring_stays_on_the_loop_on_small_machines(monkeypatch):
    from p2ptrain.collective import pool

    codec = parse_codec("topk:0.01")
    assert codec.compiled and _topk_kernels.warm()
    monkeypatch.setattr(pool.os, "cpu_count", lambda: 2)
    assert pool.inline_for(codec)


def test_a_bound_that_lets_too_few_through_takes_one_more_pass_not_a_sort_of_all(monkeypatch):
    """Where the sample saw only big values, the first bound passes fewer than k: the compiled
    pass runs once more from a bound 8x as deep in the sample (a sort of every value took ~30 ms
    a 512 K chunk, against ~0.5 ms a pass), and the selection is still exact."""
    t = TopK(Fraction("1/100"))
    x = chunk("sampled-runs-big", 1 << 19, 0)
    kernels = _topk_kernels.load()
    passes = []
    real = kernels.above

    def counted(*args):
        passes.append(args[1])
        return real(*args)

    monkeypatch.setattr(kernels, "above", counted)
    got = t.select(x)
    assert len(passes) == 2 and passes[1] < passes[0]  # (a lower bound the second time)
    assert np.array_equal(got, numpy_select(t, x, monkeypatch))
    expect = np.argsort(-np.abs(x), kind="stable")[: t.k(x.size)]
    assert np.array_equal(got, np.sort(expect))
