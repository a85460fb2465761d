"""Local-steps mode's compiled passes (``trainer._local_kernels``, where numba is installed) give
the same floats, bit for bit, as its torch passes: the pseudo-gradient written into a sum, the
outer Nesterov step and the local progress rebased onto it, a divergence's restart."""

import pytest
import torch

from p2ptrain import jit
from p2ptrain.trainer import _local_kernels
from p2ptrain.trainer.accumulator import Accumulator
from p2ptrain.trainer.local_steps import LocalSteps

pytestmark = pytest.mark.timeout(60)

HAVE_NUMBA = _local_kernels.load() is not None
needs_numba = pytest.mark.skipif(not HAVE_NUMBA, reason="numba is not installed (or P2PTRAIN_NUMBA=0): "
                                                        "only torch's passes run")


def peer_state(shapes, momentum, compiled: bool, seed=0):
    torch.manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    local = LocalSteps(params, every=2, lr=0.8, momentum=momentum)
    if not compiled:
        local._kernels = None
    return params, local, Accumulator(params, torch.device("cpu"))


def rounds(params, local, acc, n=3, nan_at=None):
    """Inner steps, a contribution into the sum, progress past it, the round's mean applied;
    every state after each round."""
    seen = []
    gen = torch.Generator().manual_seed(1)
    for r in range(n):
        with torch.no_grad():
            for p in params:
                p.sub_(torch.randn(p.shape, generator=gen) * 1e-2)
            if r == nan_at:
                params[-1].view(-1)[0] = float("inf")
        local.stepped(16)
        local.stepped(8)
        delta, samples = local.contribute(into=acc.begin_writing())
        if delta is not None:
            acc.add_weighted(delta, samples, r)
            out = acc.swap(2)
            acc.to_host(out)
            mean = torch.from_numpy(out.array.copy()) / (samples * 2)
            acc.release(out)
        with torch.no_grad():
            for p in params:
                p.add_(torch.randn(p.shape, generator=gen) * 1e-3)  # (progress after the contribution)
        sent = None if delta is None else mean.clone()
        if delta is not None:
            local.apply(mean)  # (its argument is scratch: torch's passes write into it, the kernel not)
        seen.append([t.clone() for t in (*params, local._outer, local._base, local._velocity)] + [sent])
    return seen


@needs_numba
@pytest.mark.parametrize("momentum", [0.9, 0.0])
@pytest.mark.parametrize("shapes", [[(3, 4), (5,)], [(1000,), (7, 33), (1,)]])
def test_compiled_local_steps_give_torch_passes_floats_bit_for_bit(shapes, momentum):
    compiled = rounds(*peer_state(shapes, momentum, compiled=True))
    plain = rounds(*peer_state(shapes, momentum, compiled=False))
    for a, b in zip(compiled, plain):
        for x, y in zip(a, b):
            assert (x is None and y is None) or torch.equal(x, y)


@needs_numba
def test_a_diverged_contribution_restarts_the_same_way_compiled_or_not(caplog):
    compiled = rounds(*peer_state([(4, 6), (6,)], 0.9, compiled=True), n=3, nan_at=1)
    plain = rounds(*peer_state([(4, 6), (6,)], 0.9, compiled=False), n=3, nan_at=1)
    assert compiled[1][-1] is None and plain[1][-1] is None  # (left out)
    for a, b in zip(compiled, plain):
        for x, y in zip(a, b):
            assert (x is None and y is None) or torch.equal(x, y)


def test_the_kernels_are_used_on_the_cpu_where_numba_is_installed_and_not_for_strided_parameters():
    pytest.importorskip("numba")
    if not jit.enabled():
        pytest.skip("P2PTRAIN_NUMBA=0")
    params, local, _ = peer_state([(3, 4)], 0.9, compiled=True)
    assert local._kernels is not None and local._compiled(local._live()) is not None
    strided = torch.nn.Parameter(torch.randn(4, 3).t())  # (a view: not contiguous)
    assert LocalSteps([strided], every=1, lr=0.7, momentum=0.9)._compiled([strided.detach()]) is None
