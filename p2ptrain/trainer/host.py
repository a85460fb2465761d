"""``Host``: what the trainer's parts (``contributions``, ``updates``) read on their peer beside its
``state.TrainerState``: the settings, set once as the peer is made, and the cluster, set once as
it opens. ``peer.AsyncPeer`` is one; the parts never write it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from p2ptrain.cluster.cluster import Cluster


class Host(Protocol):
    cluster: Cluster | None
    module: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    params: list[torch.Tensor]
    clip_grad_norm: float | None
    reconcile_every: int
