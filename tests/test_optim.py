"""The built-in tasks' optimizers: fused where the device has the kernel, the same update."""

import pytest
import torch

from p2ptrain.tasks import load_task
from p2ptrain.tasks._optim import _fused_steps_on, fused_when_possible

pytestmark = pytest.mark.timeout(120)

OPTIONS = {"seed": 0, "data": None, "model_size": None, "batch_size": None, "device": "cpu"}
CPU_FUSED = _fused_steps_on("cpu")  # (torch >= 2.4 has a CPU kernel; 2.2 and 2.3 do not)


@pytest.mark.parametrize("name", ["synthetic", "charlm"])
def test_built_in_tasks_step_fused_on_a_cpu_that_has_the_kernel(name):
    task = load_task(name, OPTIONS)
    optimizer = task.make_optimizer(task.model.parameters(), task.default_lr)
    assert optimizer.defaults["fused"] is (True if CPU_FUSED else None)


@pytest.mark.skipif(not CPU_FUSED, reason="this torch has no fused Adam for the CPU")
@pytest.mark.parametrize("optimizer_class, options", [(torch.optim.Adam, {}),
                                                      (torch.optim.AdamW, {"weight_decay": 0.01})])
def test_the_fused_step_is_the_default_update(optimizer_class, options):
    torch.manual_seed(0)
    start = [torch.randn(300, 40), torch.randn(40)]
    grads = [[torch.randn_like(p) for p in start] for _ in range(5)]
    results = []
    for make in (lambda ps: optimizer_class(ps, lr=1e-2, **options),
                 lambda ps: fused_when_possible(optimizer_class, ps, lr=1e-2, **options)):
        params = [torch.nn.Parameter(p.clone()) for p in start]
        optimizer = make(params)
        for step in grads:
            for p, g in zip(params, step):
                p.grad = g.clone()
            optimizer.step()
        results.append(params)
    for default, fused, before in zip(*results, start):
        torch.testing.assert_close(fused, default, rtol=1e-5, atol=1e-6)
        assert not torch.equal(fused, before)  # (it moved)


def test_a_parameter_without_the_kernel_gets_the_default():
    params = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(3, dtype=torch.complex64))]
    optimizer = fused_when_possible(torch.optim.Adam, params, lr=1e-3)
    assert not optimizer.defaults["fused"]
    for p in params:
        p.grad = torch.ones_like(p)
    optimizer.step()  # (fused, this step would raise: the check is in the first step)
    assert params[1].abs().sum() > 0


def test_a_device_kind_without_the_kernel_is_not_fused():
    assert not _fused_steps_on("meta")
    optimizer = fused_when_possible(torch.optim.Adam, [torch.nn.Parameter(torch.zeros(2, device="meta"))], lr=1e-3)
    assert not optimizer.defaults["fused"]
