"""``trainer.finite.all_finite``: the exact answer of ``torch.isfinite(t).all()`` over tensors, from
one norm each, also where the norm overflows (finite values above about 1e19)."""

import pytest
import torch

from p2ptrain.trainer.finite import all_finite

pytestmark = pytest.mark.timeout(30)


def tensors(*last):
    return [torch.randn(300, 7), torch.randn(5), torch.tensor(list(last), dtype=torch.float32)]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_nan_or_an_infinity_in_any_tensor_is_found(bad):
    assert all_finite(tensors(1.0, 2.0))
    assert not all_finite(tensors(1.0, bad))
    assert not all_finite([torch.full((4,), bad)] + tensors(1.0))


def test_finite_values_whose_norm_overflows_are_finite():
    huge = tensors(3e38, -3e38, 1e30)
    assert torch.isinf(torch._foreach_norm(huge)[2])  # (the norm cannot tell: the exact look decides)
    assert all_finite(huge)
    assert not all_finite(huge + [torch.tensor([float("nan")])])


def test_no_values_are_all_finite_and_other_float_dtypes_are_answered_exactly():
    assert all_finite([]) and all_finite([torch.empty(0), torch.empty(3, 0)])
    assert all_finite([torch.full((100,), 60000.0, dtype=torch.float16)])  # (its norm overflows float16)
    assert not all_finite([torch.tensor([1.0, float("inf")], dtype=torch.bfloat16)])
    assert all_finite([torch.nn.Parameter(torch.ones(3))])  # (parameters that require grad: no autograd use)
