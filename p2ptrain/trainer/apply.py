"""Applying one committed update to the model, on the caller's thread: the averaged gradient
set into ``p.grad``, clipped, then the user's optimizer and scheduler step once."""

from __future__ import annotations

from typing import Any

import torch

from p2ptrain.trainer.accumulator import CommittedUpdate


def apply_update(update: CommittedUpdate, params: list[torch.Tensor], device: torch.device,
                 optimizer: torch.optim.Optimizer, scheduler: Any, clip_grad_norm: float | None) -> None:
    """``params`` step by ``update.summed / update.total`` (the ring's sum, handed over by the
    cluster: ours to use in place). ``p.grad`` is None again afterwards."""
    grad = torch.from_numpy(update.summed)  # (ours: the cluster handed its ring result over)
    grad = grad.to(device) if device.type != "cpu" else grad
    grad.div_(float(update.total))
    offset = 0
    for p in params:
        g = grad[offset: offset + p.numel()].view_as(p)
        p.grad = g if g.dtype == p.dtype else g.to(p.dtype)
        offset += p.numel()
    if clip_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(params, clip_grad_norm)
    optimizer.step()
    if scheduler is not None:
        scheduler.step()
    for p in params:
        p.grad = None
