"""Accelerators: which one to train on, and host buffers for sending what it computes.

Compute stays on the device; communication works on flat float32 host arrays. This module
is the only place that asks torch which accelerators exist, and every backend-specific
call sits behind an availability check, so a CPU-only build of torch (or a Mac, or a
machine with an XPU) never touches a backend it lacks.

- ``pick_device(spec)``: ``auto`` is cuda, then mps, then xpu, then cpu; an explicit spec
  is checked, and ConfigError says what this machine has instead.
- ``HostStaging``: one reusable host buffer (pinned on CUDA, so copies can be async)
  with ``to_host(tensors)`` / ``from_host(tensors)``; both return only when the copies
  are complete, so the caller may read or overwrite the buffer at once.
- ``synchronize(device)``, ``device_kind(device)``, ``quick_speed(device)``.
- ``check_numpy_bridge()``: that torch hands tensors to numpy (a torch built for numpy 1 beside 2 cannot).
"""

from __future__ import annotations

import functools
import time
from typing import Sequence

import numpy as np
import torch

from p2ptrain.errors import ConfigError

KINDS = ("cuda", "mps", "xpu", "cpu")
"""Device kinds p2ptrain trains on, in the order ``auto`` prefers them."""


def _cuda_available() -> bool:
    return torch.cuda.is_available()  # safe on CPU-only builds: it just says False


def _mps_available() -> bool:
    mps = getattr(torch.backends, "mps", None)
    return bool(mps is not None and mps.is_available())


def _xpu_available() -> bool:
    return hasattr(torch, "xpu") and torch.xpu.is_available()


def available_devices() -> list[str]:
    """The device specs that work on this machine, e.g. ``["cuda:0", "cuda:1", "cpu"]``."""
    found = []
    if _cuda_available():
        found += [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    if _mps_available():
        found.append("mps")
    if _xpu_available():
        found += [f"xpu:{i}" for i in range(torch.xpu.device_count())]
    return found + ["cpu"]


@functools.cache
def check_numpy_bridge() -> None:
    """Raise ConfigError if this torch cannot hand tensors to numpy, which every round's data
    path does: a torch before 2.3 was built against numpy 1 and, beside numpy 2, fails the
    first ``tensor.numpy()`` with "Numpy is not available" (a traceback deep in a round)."""
    try:
        torch.zeros(1).numpy()
    except RuntimeError as exc:
        raise ConfigError(f"this torch {torch.__version__} cannot hand tensors to numpy {np.__version__} ({exc}): "
                          "pip install \"numpy<2\", or a torch of 2.3 or newer") from None


def pick_device(spec: str | torch.device = "auto") -> torch.device:
    """The device to train on: ``auto``, ``cpu``, ``cuda``, ``cuda:N``, ``mps``, ``xpu``, ``xpu:N``.

    Raises ConfigError, listing what is available, for an unknown or absent device (and where
    torch and numpy do not work together: ``check_numpy_bridge``)."""
    check_numpy_bridge()
    text = str(spec).strip().lower() or "auto"
    if text == "auto":
        if _cuda_available():
            return torch.device("cuda", torch.cuda.current_device())
        if _mps_available():
            return torch.device("mps")
        if _xpu_available():
            return torch.device("xpu", torch.xpu.current_device())
        return torch.device("cpu")
    kind, sep, index_text = text.partition(":")
    have = ", ".join(available_devices())
    if kind not in KINDS or (sep and not index_text.isdigit()):
        raise ConfigError(f"--device {spec!r}: not a device; use auto, cpu, cuda, cuda:N, mps or xpu "
                          f"(available here: {have})")
    index = int(index_text) if sep else None
    count = {"cpu": 1, "mps": 1 if _mps_available() else 0,
             "cuda": torch.cuda.device_count() if _cuda_available() else 0,
             "xpu": torch.xpu.device_count() if _xpu_available() else 0}[kind]
    if count == 0:
        raise ConfigError(f"--device {spec!r}: no {kind} device on this machine "
                          f"(or this torch build lacks {kind} support); available here: {have}")
    if index is not None and index >= count:
        raise ConfigError(f"--device {spec!r}: this machine has {count} {kind} device(s), numbered from 0; "
                          f"available here: {have}")
    if kind in ("cpu", "mps"):
        return torch.device(kind)
    if index is None:
        index = torch.cuda.current_device() if kind == "cuda" else torch.xpu.current_device()
    return torch.device(kind, index)


def device_kind(device: str | torch.device) -> str:
    """``"cuda"``, ``"mps"``, ``"xpu"`` or ``"cpu"``: what beacons and logs say a peer runs on."""
    kind = torch.device(device).type
    if kind not in KINDS:
        raise ConfigError(f"device {str(device)!r} is not one p2ptrain trains on; use one of {', '.join(KINDS)}")
    return kind


def synchronize(device: str | torch.device) -> None:
    """Wait for all queued work on ``device`` (a no-op on cpu): timings and host reads need it."""
    device = torch.device(device)
    if device.type == "cuda" and _cuda_available():
        torch.cuda.synchronize(device)
    elif device.type == "mps" and _mps_available():
        torch.mps.synchronize()
    elif device.type == "xpu" and _xpu_available():
        torch.xpu.synchronize(device)


class HostStaging:
    """A flat float32 host buffer of ``numel`` elements for the tensors of one device.

    ``array`` (numpy) and ``tensor`` (torch) share the memory, which is pinned when the
    device is CUDA so that copies run asynchronously and at full PCIe speed. Tensors of any
    floating dtype are staged as float32 and written back in their own dtype, packed in
    list order from offset 0. Both copy methods wait for their copies before returning.
    """

    def __init__(self, numel: int, device: str | torch.device):
        if not isinstance(numel, int) or numel < 0:
            raise ConfigError(f"HostStaging numel must be a non-negative int, got {numel!r}")
        self.device = torch.device(device)
        # Pinned memory needs a CUDA driver; async copies only make sense with it.
        self._async = self.device.type == "cuda" and _cuda_available()
        self.tensor = torch.empty(numel, dtype=torch.float32, pin_memory=self._async)
        self.array: np.ndarray = self.tensor.numpy()

    @property
    def numel(self) -> int:
        return self.tensor.numel()

    def _spans(self, tensors: Sequence[torch.Tensor]) -> list[tuple[torch.Tensor, int, int]]:
        spans, offset = [], 0
        for t in tensors:
            spans.append((t, offset, offset + t.numel()))
            offset += t.numel()
        if offset > self.numel:
            raise ConfigError(f"HostStaging holds {self.numel} elements but the tensors have {offset}: "
                              f"make the staging buffer at least that large")
        return spans

    def _wait(self) -> None:
        # One event on the current stream covers every async copy queued above it.
        if self._async:
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(self.device))
            done.synchronize()
        elif self.device.type != "cpu":
            synchronize(self.device)

    def to_host(self, tensors: Sequence[torch.Tensor]) -> np.ndarray:
        """Copy ``tensors`` into the buffer, packed; returns the filled prefix of ``array``."""
        spans = self._spans(tensors)
        with torch.no_grad():
            for t, start, stop in spans:
                self.tensor[start:stop].copy_(t.detach().reshape(-1), non_blocking=self._async)
        self._wait()
        return self.array[:spans[-1][2] if spans else 0]

    def from_host(self, tensors: Sequence[torch.Tensor]) -> None:
        """Copy the buffer back into ``tensors`` (in place, same packing as ``to_host``)."""
        spans = self._spans(tensors)
        with torch.no_grad():
            for t, start, stop in spans:
                t.copy_(self.tensor[start:stop].view(t.shape), non_blocking=self._async)
        # Wait, so that the caller may overwrite the buffer as soon as we return.
        self._wait()


def quick_speed(device: str | torch.device, seconds: float = 0.2) -> float:
    """Float32 matmul throughput of ``device`` in GFLOP/s, measured for about ``seconds``.

    A rough figure for ``doctor`` and for comparing peers, not a benchmark."""
    device = torch.device(device)
    n = 512 if device.type == "cpu" else 2048
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=gen).to(device)
    b = torch.randn(n, n, generator=gen).to(device)
    a @ b  # warm-up: kernels, allocator, clocks
    synchronize(device)
    count, start = 0, time.perf_counter()
    while True:
        for _ in range(4):
            a @ b
        count += 4
        synchronize(device)  # note: a sync point per batch of matmuls, so the clock sees real work
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return 2.0 * n ** 3 * count / elapsed / 1e9
