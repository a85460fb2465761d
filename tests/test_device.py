"""Device choice and host staging. Runs on CPU; the CUDA test runs where a GPU is present."""

import numpy as np
import pytest
import torch

from p2ptrain.device import (HostStaging, available_devices, device_kind, pick_device, quick_speed,
                             synchronize)
from p2ptrain.errors import ConfigError

HAS_CUDA = torch.cuda.is_available()


def test_auto_picks_the_best_available():
    assert available_devices()[-1] == "cpu"
    expected = available_devices()[0].split(":")[0]
    assert pick_device().type == expected == pick_device("auto").type == pick_device(" AUTO ").type
    if not HAS_CUDA and expected == "cpu":
        assert pick_device() == torch.device("cpu")


@pytest.mark.parametrize("spec", ["cpu", "CPU", "cpu:0", torch.device("cpu")])
def test_explicit_cpu(spec):
    assert pick_device(spec) == torch.device("cpu")


@pytest.mark.parametrize("spec", ["gpu", "tpu", "cuda:x", "cuda:", "cpu:1", "mps:1", "cuda:99", "xpu:99"])
def test_bad_specs_say_what_exists(spec):
    with pytest.raises(ConfigError) as info:
        pick_device(spec)
    message = str(info.value)
    assert "available here: " in message and "cpu" in message and "\n" not in message
    assert repr(spec) in message


@pytest.mark.parametrize("kind, present", [("cuda", HAS_CUDA), ("mps", torch.backends.mps.is_available()),
                                           ("xpu", hasattr(torch, "xpu") and torch.xpu.is_available())])
def test_absent_accelerators_are_refused(kind, present):
    if present:
        assert pick_device(kind).type == kind
    else:
        with pytest.raises(ConfigError, match=f"no {kind} device on this machine.*available here: .*cpu"):
            pick_device(kind)


def test_device_kind():
    assert device_kind("cpu") == "cpu"
    assert device_kind(torch.device("cuda", 1)) == "cuda"  # naming a device needs no driver
    assert device_kind("mps") == "mps" and device_kind("xpu:0") == "xpu"
    with pytest.raises(ConfigError, match="meta"):
        device_kind("meta")


def _mixed_tensors(device):
    gen = torch.Generator().manual_seed(1)
    return [
        torch.randn(3, 4, generator=gen).to(device),
        torch.randn(5, generator=gen).double().to(device),
        torch.randn(2, 3, generator=gen).half().to(device),
        torch.randn(7, generator=gen).bfloat16().to(device),
        torch.tensor(2.5).to(device),                         # 0-dim
        torch.randn(4, 6, generator=gen).to(device).t(),       # not contiguous
        torch.nn.Parameter(torch.randn(2, 2, generator=gen).to(device)),  # requires grad
    ]


def _round_trip(device):
    tensors = _mixed_tensors(device)
    total = sum(t.numel() for t in tensors)
    staging = HostStaging(total + 10, device)
    flat = staging.to_host(tensors)
    assert isinstance(flat, np.ndarray) and flat.dtype == np.float32 and flat.shape == (total,)
    expected = np.concatenate([t.detach().float().cpu().reshape(-1).numpy() for t in tensors])
    np.testing.assert_array_equal(flat, expected)
    assert np.shares_memory(flat, staging.array)

    flat *= 2  # what a collective does: work on the host array, then copy back
    staging.from_host(tensors)
    for t, original in zip(tensors, _mixed_tensors(device)):
        assert t.dtype == original.dtype and t.shape == original.shape and t.device == original.device
        torch.testing.assert_close(t.detach().cpu(), (original.detach() * 2).cpu())
    return staging


def test_host_staging_round_trip_cpu():
    staging = _round_trip("cpu")
    assert not staging.tensor.is_pinned()


def test_host_staging_checks_size():
    staging = HostStaging(5, "cpu")
    assert staging.numel == 5 and staging.to_host([]).shape == (0,)
    with pytest.raises(ConfigError, match="holds 5 elements but the tensors have 6"):
        staging.to_host([torch.zeros(6)])
    with pytest.raises(ConfigError):
        HostStaging(-1, "cpu")


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_host_staging_round_trip_cuda():
    staging = _round_trip("cuda")
    assert staging.tensor.is_pinned()
    # Large enough that an unsynchronized async copy would be caught reading stale memory.
    big = [torch.full((1 << 22,), 3.0, device="cuda"), torch.full((1 << 20,), -1.0, device="cuda")]
    staging = HostStaging((1 << 22) + (1 << 20), "cuda")
    flat = staging.to_host(big)
    assert flat[: 1 << 22].min() == 3.0 and flat[1 << 22:].max() == -1.0
    flat[:] = 7.0
    staging.from_host(big)
    assert bool((big[0] == 7.0).all()) and bool((big[1] == 7.0).all())


def test_synchronize_and_quick_speed():
    synchronize("cpu")  # a no-op, never an error
    synchronize(pick_device())
    speed = quick_speed("cpu", seconds=0.05)
    assert 0.01 < speed < 1e6


def test_a_torch_that_cannot_hand_tensors_to_numpy_is_refused_in_one_line(monkeypatch):
    """torch 2.2 (built against numpy 1) beside numpy 2 fails every ``tensor.numpy()`` with
    "Numpy is not available": `join` ended in that traceback from deep in a checksum. Now
    `join` (``pick_device``), ``Peer`` and ``Group`` refuse it at once, with the pip line."""
    import p2ptrain
    from p2ptrain import device

    def broken(self):
        raise RuntimeError("Numpy is not available")

    device.check_numpy_bridge.cache_clear()
    monkeypatch.setattr(torch.Tensor, "numpy", broken)
    try:
        model = torch.nn.Linear(2, 2)
        for make in (lambda: pick_device("cpu"), lambda: p2ptrain.Peer(model, torch.optim.SGD(model.parameters(), 0.1)),
                     lambda: p2ptrain.Group(listen="127.0.0.1:1", peers=["127.0.0.1:1"])):
            with pytest.raises(ConfigError, match=r'cannot hand tensors to numpy .*pip install "numpy<2"'):
                make()
    finally:
        monkeypatch.undo()
        device.check_numpy_bridge.cache_clear()
    device.check_numpy_bridge()  # (as it was: no error)
