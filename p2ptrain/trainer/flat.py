"""A model's trainable parameters as one flat float32 vector: where each begins, views of a flat
buffer shaped as them, and one parameter's ``batch x grad`` written into its range (the same
multiplication wherever a sum is begun, so the same bits: ``Accumulator.add``, overlap's hooks,
``WrittenAsRead``)."""

from __future__ import annotations

import itertools

import torch


def write_scaled(view: torch.Tensor, grad: torch.Tensor | None, batch_size: float) -> None:
    """``view = batch_size * grad`` (zeros for no gradient): one parameter's share of a sum,
    written where nothing was added yet (``Accumulator``; overlap's hooks, ``overlap.Filling``:
    the same multiplication, so the same bits; there also divided by a loss scale)."""
    if grad is None:
        view.zero_()
        return
    grad = grad.to_dense() if grad.is_sparse else grad
    torch.mul(grad if grad.dtype == torch.float32 else grad.float(), float(batch_size), out=view)


def param_starts(params) -> list[int]:
    """Where each parameter begins in a flat buffer of them all, in order, and the end last."""
    return [0, *itertools.accumulate(p.numel() for p in params)]


def param_views(flat: torch.Tensor, params) -> list[torch.Tensor]:
    """Views of a flat buffer, one per parameter, shaped like it, in order."""
    views, offset = [], 0
    for p in params:
        views.append(flat[offset: offset + p.numel()].view(p.shape))
        offset += p.numel()
    return views
