"""Applying one committed update to the model, on the caller's thread: the averaged gradient
(``AveragedGradient``) set into ``p.grad``, clipped, then the user's optimizer and scheduler
step once (in local-steps mode they step on each batch's own gradient instead:
``optimizer_step``)."""

from __future__ import annotations

from typing import Any

import torch

from p2ptrain.trainer.accumulator import CommittedUpdate, ViewCache
from p2ptrain.trainer.step_checks import peer_steps


class AveragedGradient:
    """A committed round's mean, ``update.summed / update.total``, on the model's device, flat
    and as one view per parameter, made without new tensors each round: on the CPU the ring's
    result arrays (a few, reused) are divided and viewed in place; on another device the sum
    is copied into one buffer of ours there (the copy a round needs anyway). Making the views
    afresh cost a few microseconds of Python per parameter, every round. One caller at a time
    (the trainer state's ``params_lock``)."""

    def __init__(self, params: list[torch.Tensor], device: torch.device):
        self.params, self.device = params, device
        self._views = ViewCache(params, keep=3)  # (the ring keeps two result arrays; one more in flight)
        self._on_device: torch.Tensor | None = None

    def of(self, update: CommittedUpdate, divisor: float | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The mean, flat, and its per-parameter views (the ring's sum: ours to use in place);
        ``divisor``: the sum divided by it instead of ``update.total`` (``LocalSteps.divisor``)."""
        host = torch.from_numpy(update.summed)
        if self.device.type == "cpu":
            flat, views = host, self._views(update.summed, host)
        else:
            if self._on_device is None or self._on_device.numel() != host.numel():
                self._on_device = torch.empty(host.numel(), dtype=torch.float32, device=self.device)
            flat = self._on_device.copy_(host)  # (waits for the copy: the array goes back to the ring)
            views = self._views(flat)
        flat.div_(float(update.total) if divisor is None else divisor)
        return flat, views


def optimizer_step(params: list[torch.Tensor], optimizer: torch.optim.Optimizer, scheduler: Any,
                   clip_grad_norm: float | None) -> None:
    """The gradients in ``p.grad`` clipped, the optimizer and scheduler step; ``p.grad`` is None after."""
    if clip_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(params, clip_grad_norm)
    with peer_steps():
        optimizer.step()
    if scheduler is not None:
        scheduler.step()
    for p in params:
        p.grad = None


def apply_gradients(grads: list[torch.Tensor | None], params: list[torch.Tensor], optimizer: torch.optim.Optimizer,
                    scheduler: Any, clip_grad_norm: float | None) -> None:
    """``params`` step by one batch's own gradients (a peer alone: they are the mean); a
    parameter without one keeps ``grad`` None (the optimizer skips it), as ``apply_update``."""
    for p, g in zip(params, grads):
        p.grad = g
    optimizer_step(params, optimizer, scheduler, clip_grad_norm)


def apply_update(update: CommittedUpdate, mean: AveragedGradient, optimizer: torch.optim.Optimizer,
                 scheduler: Any, clip_grad_norm: float | None) -> None:
    """``mean.params`` step by ``update.summed / update.total`` (the ring's sum, handed over by the
    cluster: ours to use in place). A parameter no member had a gradient for (``update.used``)
    keeps ``grad`` None, as under DDP: the optimizer skips it (no momentum, no weight decay).
    ``p.grad`` is None again afterwards."""
    _, views = mean.of(update)
    used = update.used
    for i, (p, g) in enumerate(zip(mean.params, views)):
        if used is not None and not used[i]:
            continue
        p.grad = g if g.dtype == p.dtype else g.to(p.dtype)
    optimizer_step(mean.params, optimizer, scheduler, clip_grad_norm)
