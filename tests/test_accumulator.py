"""``Accumulator``: sums of ``batch_size * grad``, and buffers reused without clearing them."""

from __future__ import annotations

import pytest
import torch

from p2ptrain.trainer.accumulator import Accumulator

pytestmark = pytest.mark.timeout(30)


def grads(params, seed, skip=()):
    gen = torch.Generator().manual_seed(seed)
    for i, p in enumerate(params):
        p.grad = None if i in skip else torch.randn(p.shape, generator=gen)


def test_a_reused_buffer_sums_exactly_as_a_fresh_one():
    params = [torch.zeros(3, 4, requires_grad=True), torch.zeros(5, requires_grad=True)]
    acc = Accumulator(params, torch.device("cpu"))
    grads(params, 1)
    acc.add(2, 0)
    first = acc.swap(1)
    acc.to_host(first)
    acc.release(first)  # (not cleared: the next swap hands it out again, dirty)
    grads(params, 2)
    acc.add(3, 0)
    out = acc.swap(1)
    acc.to_host(out)
    assert out.array is not None and len(out.array) == 17
    grads(params, 3)
    acc.add(4, 1)  # into the reused buffer: written, not added to the old sum
    grads(params, 4, skip={1})  # the second parameter has no gradient this time
    acc.add(5, 1)
    reused = acc.swap(1)
    acc.to_host(reused)

    fresh = Accumulator(params, torch.device("cpu"))
    grads(params, 3)
    fresh.add(4, 1)
    grads(params, 4, skip={1})
    fresh.add(5, 1)
    expected = fresh.swap(1)
    fresh.to_host(expected)
    assert torch.equal(torch.from_numpy(reused.array), torch.from_numpy(expected.array))
    assert (reused.samples, reused.batches) == (9, 2)


def test_a_reused_buffer_goes_out_as_zeros_when_nothing_was_added_and_merges_back_exactly():
    params = [torch.zeros(6, requires_grad=True)]
    acc = Accumulator(params, torch.device("cpu"))
    for seed in (1, 2):
        grads(params, seed)
        acc.add(1, 0)
        out = acc.swap(1)
        acc.to_host(out)
        acc.release(out)
    empty = acc.swap(1)  # a reused buffer, nothing added
    acc.to_host(empty)
    assert empty.samples == 0 and not empty.array.any()
    grads(params, 5)
    acc.add(2, 0)
    kept = acc.swap(1)
    acc.to_host(kept)
    values = kept.array.copy()
    acc.merge(kept)  # (the round aborted) into a dirty buffer: it is that contribution, not a sum with garbage
    back = acc.swap(1)
    acc.to_host(back)
    assert torch.equal(torch.from_numpy(back.array), torch.from_numpy(values)) and back.samples == 2


def sum_of(params, batches):
    """What a fresh accumulator sends for (seed, batch_size[, skip]) batches added the ordinary way."""
    fresh = Accumulator(params, torch.device("cpu"))
    for seed, size, *skip in batches:
        grads(params, seed, *skip)
        fresh.add(size, 0)
    out = fresh.swap(2)
    fresh.to_host(out)
    return torch.from_numpy(out.array)


def test_a_kept_batch_goes_to_a_round_alone_untouched_and_to_a_ring_written():
    params = [torch.zeros(3, 4, requires_grad=True), torch.zeros(5, requires_grad=True)]
    acc = Accumulator(params, torch.device("cpu"))
    grads(params, 1)
    made = [p.grad for p in params]
    acc.add(3, 0, keep=True)
    assert all(p.grad is None for p in params)  # (the next backward makes fresh ones)
    alone = acc.swap(1)
    acc.to_host(alone, alone=True)
    assert alone.grads is not None and all(g is m for g, m in zip(alone.grads, made))
    assert alone.samples == 3 and alone.array.size == 0  # (a token: the cluster hands it back)
    acc.release(alone)

    grads(params, 1)
    acc.add(3, 0, keep=True)
    ring = acc.swap(2)
    acc.to_host(ring)  # a round of two: written as the ring reads it, into a reused buffer
    assert ring.grads is not None and ring.writer is not None
    for start, stop in ((12, 17), (2, 12), (0, 3)):  # (the ring's order, end first; a range across both
        ring.writer.write(start, stop)               #  parameters, one read twice in part)
    assert ring.grads is None and torch.equal(torch.from_numpy(ring.array), sum_of(params, [(1, 3)]))

    grads(params, 2)
    acc.add(3, 0, keep=True)
    grads(params, 3, skip={1})
    acc.add(2, 0, keep=True)  # (only a first batch is kept: this one joins it in the buffer)
    both = acc.swap(2)
    acc.to_host(both)
    assert torch.equal(torch.from_numpy(both.array), sum_of(params, [(2, 3), (3, 2, {1})])) and both.samples == 5


def test_a_kept_batch_comes_back_kept_after_an_abort_and_is_voided_by_a_state_load():
    params = [torch.zeros(6, requires_grad=True)]
    acc = Accumulator(params, torch.device("cpu"))
    grads(params, 4)
    acc.add(2, 7, keep=True)
    out = acc.swap(1)
    acc.to_host(out, alone=True)
    acc.merge(out)  # (its round aborted)
    again = acc.swap(2)
    assert again.grads is not None and (again.samples, again.batches, again.oldest) == (2, 1, 7)
    acc.to_host(again)
    again.writer.finish()
    assert torch.equal(torch.from_numpy(again.array), sum_of(params, [(4, 2)]))
    acc.release(again)

    grads(params, 5)
    acc.add(2, 0, keep=True)
    assert acc.void() == 2
    empty = acc.swap(1)
    acc.to_host(empty, alone=True)
    assert empty.grads is None and empty.samples == 0 and not empty.array.any()


def test_a_kept_batch_half_read_by_an_aborted_ring_comes_back_whole():
    params = [torch.zeros(3, 4, requires_grad=True), torch.zeros(5, requires_grad=True)]
    acc = Accumulator(params, torch.device("cpu"))
    grads(params, 6)
    acc.add(4, 3, keep=True)
    out = acc.swap(2)
    acc.to_host(out)
    out.writer.write(10, 17)  # (the ring read the end, then its round aborted)
    acc.merge(out)
    again = acc.swap(2)
    assert again.grads is not None and (again.samples, again.oldest) == (4, 3)
    acc.to_host(again)
    again.writer.finish()
    assert torch.equal(torch.from_numpy(again.array), sum_of(params, [(6, 4)]))


def test_the_views_of_a_buffer_are_made_once_and_dropped_beyond_the_last_few():
    from p2ptrain.trainer.accumulator import ViewCache

    params = [torch.zeros(3, 2), torch.zeros(4)]
    cache = ViewCache(params, keep=2)
    a, b, c = torch.arange(10.0), torch.zeros(10), torch.ones(10)
    views = cache(a)
    assert [v.shape for v in views] == [(3, 2), (4,)] and views[1].tolist() == [6.0, 7.0, 8.0, 9.0]
    assert cache(a) is views  # (made once: a round reuses them)
    cache(b), cache(c)  # (a is the oldest now: its views go, and with them the hold on a)
    assert cache(a) is not views and torch.equal(cache(a)[0], views[0])


def test_the_averaged_gradient_is_the_sum_over_the_samples_in_views_of_the_rings_array():
    """On the CPU the ring's array itself is divided and viewed (no copy), and a reused array's
    views are the same objects round after round."""
    import numpy as np
    from types import SimpleNamespace

    from p2ptrain.trainer.apply import AveragedGradient

    params = [torch.zeros(2, 3), torch.zeros(4)]
    mean = AveragedGradient(params, torch.device("cpu"))
    summed = np.arange(10, dtype=np.float32) * 3
    flat, views = mean.of(SimpleNamespace(summed=summed, total=3))
    assert np.shares_memory(flat.numpy(), summed) and summed.tolist() == list(range(10))
    assert views[0].tolist() == [[0, 1, 2], [3, 4, 5]] and views[1].tolist() == [6, 7, 8, 9]
    summed *= 2
    again = mean.of(SimpleNamespace(summed=summed, total=2))[1]
    assert all(x is y for x, y in zip(again, views)) and again[1].tolist() == [6, 7, 8, 9]


@pytest.mark.parametrize("voided", [False, True])
def test_a_withdrawn_filling_leaves_nothing_in_the_sum(voided):
    """(overlap) Hooks wrote a batch into the sum; withdrawn before a round took it (also after a
    state load voided the sum while they wrote), the next batch is added as into an empty sum."""
    params = [torch.zeros(3, 4, requires_grad=True), torch.zeros(5, requires_grad=True)]
    acc = Accumulator(params, torch.device("cpu"))
    views, host = acc.begin_filling()
    assert host is None  # (CPU: the ring reads the sum itself)
    if voided:
        acc.void()
    for view in views:
        view.fill_(7.0)  # (what the hooks wrote)
    acc.abandon_filling()
    grads(params, 1)
    acc.add(2, 0)
    out = acc.swap(1)
    acc.to_host(out)
    grads(params, 1)
    assert torch.equal(torch.from_numpy(out.array), torch.cat([2 * p.grad.reshape(-1) for p in params]))


def test_a_pseudo_gradient_written_into_the_sum_is_the_one_added_and_one_left_out_leaves_no_trace():
    """Local-steps mode writes ``base - params`` straight into an empty sum's views (no vector of
    its own a round). The sum is then what ``add_weighted`` of a separate tensor gives, bit for
    bit; and a pseudo-gradient left out (it held NaN) is no sum: the next batch writes over it."""
    from p2ptrain.trainer.local_steps import LocalSteps

    def stepped_peer():
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(3, 4)), torch.nn.Parameter(torch.randn(5))]
        local = LocalSteps(params, every=1, lr=0.7, momentum=0.9)
        with torch.no_grad():
            for p in params:
                p.sub_(torch.randn(p.shape) * 1e-2)
        local.stepped(16)
        return params, local, Accumulator(params, torch.device("cpu"))

    params, local, acc = stepped_peer()
    delta, samples = local.contribute(into=acc.begin_writing())
    acc.add_weighted(delta, samples, 0)
    written = acc.swap(1)
    acc.to_host(written)
    params, local, acc = stepped_peer()
    delta, samples = local.contribute()
    acc.add_weighted(delta, samples, 0)
    added = acc.swap(1)
    acc.to_host(added)
    assert torch.equal(torch.from_numpy(written.array), torch.from_numpy(added.array))

    params, local, acc = stepped_peer()
    with torch.no_grad():
        params[1][0] = float("nan")
    assert acc.begin_writing() is not None and local.contribute(into=acc.begin_writing())[0] is None  # (left out)
    assert acc.begin_writing() is not None  # (still empty)
    grads(params, 5)
    acc.add(2, 0)
    out = acc.swap(1)
    acc.to_host(out)
    grads(params, 5)
    expected = torch.cat([2 * p.grad.reshape(-1) for p in params])
    assert torch.equal(torch.from_numpy(out.array), expected)
