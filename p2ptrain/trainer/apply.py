"""Applying one committed update to the model, on the caller's thread: the averaged gradient
set into ``p.grad``, clipped, then the user's optimizer and scheduler step once (in
local-steps mode they step on each batch's own gradient instead: ``optimizer_step``)."""

from __future__ import annotations

from typing import Any

import torch

from p2ptrain.trainer.accumulator import CommittedUpdate


def device_mean(update: CommittedUpdate, device: torch.device) -> torch.Tensor:
    """``update.summed / update.total`` on ``device``, flat (the ring's sum: ours to use in place)."""
    mean = torch.from_numpy(update.summed)
    mean = mean.to(device) if device.type != "cpu" else mean
    return mean.div_(float(update.total))


def optimizer_step(params: list[torch.Tensor], optimizer: torch.optim.Optimizer, scheduler: Any,
                   clip_grad_norm: float | None) -> None:
    """The gradients in ``p.grad`` clipped, the optimizer and scheduler step; ``p.grad`` is None after."""
    if clip_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(params, clip_grad_norm)
    optimizer.step()
    if scheduler is not None:
        scheduler.step()
    for p in params:
        p.grad = None


def apply_gradients(grads: list[torch.Tensor | None], params: list[torch.Tensor], optimizer: torch.optim.Optimizer,
                    scheduler: Any, clip_grad_norm: float | None) -> None:
    """``params`` step by one batch's own gradients (a peer alone: they are the mean), zeros
    where a parameter has none, as ``apply_update`` gives it."""
    for p, g in zip(params, grads):
        p.grad = g if g is not None else torch.zeros_like(p)
    optimizer_step(params, optimizer, scheduler, clip_grad_norm)


def apply_update(update: CommittedUpdate, params: list[torch.Tensor], device: torch.device,
                 optimizer: torch.optim.Optimizer, scheduler: Any, clip_grad_norm: float | None) -> None:
    """``params`` step by ``update.summed / update.total`` (the ring's sum, handed over by the
    cluster: ours to use in place). ``p.grad`` is None again afterwards."""
    grad = device_mean(update, device)
    offset = 0
    for p in params:
        g = grad[offset: offset + p.numel()].view_as(p)
        p.grad = g if g.dtype == p.dtype else g.to(p.dtype)
        offset += p.numel()
    optimizer_step(params, optimizer, scheduler, clip_grad_norm)
