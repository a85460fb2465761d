"""``AveragedBuffers``: a model's float buffers (BatchNorm's running mean and variance, ...) kept
alike on every peer, so that an evaluation of the same data gives the same number on any peer.

Gradients are averaged every round; buffers are not (they are not parameters), so each peer's
BatchNorm statistics follow its own batches and the replicas' evaluations differ. With this
option each float buffer gets a stand-in parameter (``shadows``) that rides in the round's
gradient buffer: before a step, its "gradient" is the buffer's value; the round averages it,
weighted by samples like every gradient; when the optimizer is about to step (a step pre-hook
on the wrapped optimizer), the average is copied back into the buffer. Every peer then holds
the same buffers after every update, as DDP's ``broadcast_buffers`` does (DDP copies rank 0's
buffers; this takes their sample-weighted mean).

Cost: one float per buffer element in each round (a BatchNorm layer of C channels: 2C), and
nothing else. Exact with ``compression="none"``; with a lossy codec the buffers are averaged
as lossily as the gradients. Integer buffers (``num_batches_tracked``) are left alone: every
peer counts the same steps. Off by default (``sync_buffers=False`` in the integrations).

Call order: ``wrap(model)`` is what the peer is given (the model plus the stand-ins; the peer's
checkpoints name the model's parameters ``model.*``); ``contribute()`` after backward, before the
peer's step; ``install(optimizer)`` once the peer is open, on the optimizer it steps (after the peer's own
check that refuses a step of the loop's). The stand-ins are not in the optimizer: never stepped.
"""

from __future__ import annotations

import torch


class _WithBuffers(torch.nn.Module):
    """The module the peer is given: the user's model and one stand-in parameter per float buffer."""

    def __init__(self, model: torch.nn.Module, shadows: torch.nn.ParameterList):
        super().__init__()
        self.model, self.shadows = model, shadows

    def forward(self, *args, **kwargs):
        return self.model(*args, **kwargs)


class AveragedBuffers:
    """The float buffers of ``model`` (a BatchNorm's running statistics, ...), averaged each round."""

    def __init__(self, model: torch.nn.Module):
        self.buffers = [b for b in model.buffers() if b.is_floating_point()]
        self.shadows = torch.nn.ParameterList(
            torch.nn.Parameter(torch.zeros_like(b, dtype=torch.float32)) for b in self.buffers)
        self.module = _WithBuffers(model, self.shadows)

    def wrap(self) -> torch.nn.Module:
        """What the peer is given in place of the model (same parameters, plus the stand-ins)."""
        return self.module

    def contribute(self) -> None:
        """Before the peer's step: each stand-in's gradient is its buffer's value now."""
        with torch.no_grad():
            for s, b in zip(self.shadows, self.buffers):
                s.grad = b.detach().to(torch.float32).clone()

    def install(self, optimizer: torch.optim.Optimizer):
        """On the optimizer the peer steps: when it steps, the averaged values become the buffers
        (the pre-hook runs before any the caller registers later, such as clipping). Returns the
        hook's handle."""
        return optimizer.register_step_pre_hook(self._adopt)

    def _adopt(self, optimizer, args, kwargs) -> None:
        with torch.no_grad():
            for s, b in zip(self.shadows, self.buffers):
                if s.grad is not None:
                    b.copy_(s.grad.to(b.dtype))
                    s.grad = None

