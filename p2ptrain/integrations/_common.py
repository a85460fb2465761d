"""What the framework integrations share: the optimizer that counts samples, batch sizes read
from batches, and clipping of the averaged gradient."""

from __future__ import annotations

from typing import Any

import torch

from p2ptrain.errors import ConfigError
from p2ptrain.integrations.buffers import AveragedBuffers
from p2ptrain.trainer.distributed_optimizer import DistributedOptimizer


class CountingOptimizer(DistributedOptimizer):
    """``DistributedOptimizer`` whose ``step`` takes the samples the integration counted since the
    last one (frameworks call ``step(closure)`` with no batch size). With a ``closure``
    (Lightning's: forward and backward), it runs first, so its batch is counted; then
    ``buffers`` (if any) give their values, and the peer steps."""

    samples = 0
    buffers: AveragedBuffers | None = None

    def step(self, closure=None, *, batch_size: int | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        n = batch_size if batch_size is not None else self.samples
        self.samples = 0
        if self.buffers is not None:
            self.buffers.contribute()
        super().step(None, batch_size=max(int(n), 1))
        return loss


def batch_samples(batch) -> int:
    """The first dimension of the batch's first tensor (``input_ids``, ``pixel_values``, ``x``...)."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    values = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (list, tuple)) else ()
    for v in values:
        n = batch_samples(v) if isinstance(v, (torch.Tensor, list, tuple, dict)) else 0
        if n:
            return n
    return 1


def clip_on_step(optimizer: torch.optim.Optimizer, params, max_value: float, algorithm: str = "norm"):
    """Clip ``params``' gradients (by norm, or by ``algorithm="value"``) each time ``optimizer``
    steps: when the peer steps it, ``p.grad`` holds the cluster's average, so this is DDP's
    order (average, then clip), over the model's own parameters (not ``AveragedBuffers``'
    stand-ins). Returns the hook's handle."""
    params = [p for p in params if p.requires_grad]
    by_value = str(getattr(algorithm, "value", algorithm)) == "value"

    def clip(opt, args, kwargs) -> None:
        if by_value:
            torch.nn.utils.clip_grad_value_(params, max_value)
        else:
            torch.nn.utils.clip_grad_norm_(params, max_value)

    return optimizer.register_step_pre_hook(clip)


def check_share(name: str, peer: dict | None, owned: tuple, why: str, data_rank, data_shares) -> None:
    """The arguments every integration takes alike: ``data_rank`` of ``data_shares`` (this peer's
    share of the data), and ``peer=`` options that the integration sets itself (``owned``, set
    from ``why``). ConfigError, one line naming the argument, for a bad one."""
    if type(data_shares) is not int or data_shares < 1:
        raise ConfigError(f"data_shares must be an int >= 1 (how many peers split the data), got {data_shares!r}")
    if type(data_rank) is not int or not 0 <= data_rank < data_shares:
        raise ConfigError(f"data_rank must be an int in 0..{data_shares - 1} (this peer's share), got {data_rank!r}")
    taken = sorted(set(peer or {}) & set(owned))
    if taken:
        raise ConfigError(f"peer={{{taken[0]!r}: ...}}: {name} sets it ({why}); leave it out of peer=")
