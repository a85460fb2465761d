"""``DistributedOptimizer``: Horovod's shape for a ``Peer``, for loops written around an optimizer.

    optimizer = p2ptrain.DistributedOptimizer(torch.optim.Adam(model.parameters()), model,
                                              compression="int8", staleness=1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1000)   # as with any optimizer
    with optimizer:                                                # discover, join, sync state
        for x, y in loader:
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step(batch_size=len(x))                      # contribute; apply averaged updates
            scheduler.step()

It is not a second trainer: ``step`` is ``Peer.step`` and every keyword is ``Peer``'s. What
it adds is the optimizer's face, so that code written for ``hvd.DistributedOptimizer`` (an
LR scheduler built on it, ``zero_grad``, ``param_groups``, a checkpoint of
``optimizer.state_dict()``) keeps working. Two differences from Horovod, both on purpose:
the model is passed too (a joiner downloads its parameters, and its fingerprint is
checked), and ``step`` takes the batch's sample count (default 1: every step weighs the
same, as Horovod's averaging does), because peers with different batch sizes are weighted
by samples. There is no ``broadcast_parameters``: a peer that joins downloads the state.

At staleness 0 each ``step`` applies exactly one update, so a scheduler stepped after it
steps once per update. At staleness >= 1 a step applies zero or more updates: pass
``scheduler=`` so that it steps once per applied update instead.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch

from p2ptrain.errors import ConfigError
from p2ptrain.trainer.overlap import ScaledStep
from p2ptrain.trainer.sync_peer import Peer

if TYPE_CHECKING:
    from typing_extensions import Self


class DistributedOptimizer(torch.optim.Optimizer):
    """Wraps ``optimizer`` (over ``model``'s parameters) in a ``Peer``; keywords are ``Peer``'s.

    An ``Optimizer`` by type, so LR schedulers and ``GradScaler`` accept it; its
    ``param_groups``, ``state`` and ``defaults`` are the wrapped optimizer's own objects,
    and the wrapped optimizer does the stepping (its step hooks see every applied update)."""

    def __init__(self, optimizer: torch.optim.Optimizer, model: torch.nn.Module, **peer_options: Any):
        # No super().__init__: the parameters, groups and state belong to ``optimizer``.
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigError(f"DistributedOptimizer wraps a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if not isinstance(model, torch.nn.Module):
            raise ConfigError(f"DistributedOptimizer(optimizer, model, ...): model must be a torch.nn.Module, got "
                              f"{type(model).__name__}")
        self.optimizer = optimizer
        self.peer = Peer(model, optimizer, **peer_options)
        self._overlap = peer_options.get("overlap", False) is True

    @property
    def _step_supports_amp_scaling(self) -> bool:
        """With ``overlap``, torch's ``GradScaler.step`` is told to hand ``step`` its scale
        (``grad_scale``, ``found_inf``) rather than unscale the gradients in place, which the
        overlap's hooks, having read them during backward, would not see: the cluster averaged
        gradients ``scale`` times too large (65536 by default). The hooks divide by the scale
        they guess (the last step's: GradScaler changes it only after an overflow or every
        ``growth_interval`` steps), and ``step`` confirms it (``overlap.ScaledStep``)."""
        return self._overlap

    # -- the optimizer's face: its own objects, so that schedulers change the real learning rate
    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    @property
    def defaults(self) -> dict:
        return self.optimizer.defaults

    def add_param_group(self, param_group: dict) -> None:
        raise ConfigError("a DistributedOptimizer cannot gain parameters: every peer must train the same ones; "
                          "add the group to the optimizer before wrapping it")

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Callable[[], Any] | None = None, *, batch_size: int = 1) -> Any:
        """After ``loss.backward()`` (or with a ``closure`` that does it): contribute this batch
        of ``batch_size`` samples and apply the updates committed since the last call. Returns
        the closure's loss, if any."""
        scaled = None
        found_inf = getattr(self, "found_inf", None)  # (GradScaler.step: ``_step_supports_amp_scaling``)
        if found_inf is not None:
            scale = getattr(self, "grad_scale", None)  # (None: the loop called scaler.unscale_ itself)
            scaled = ScaledStep(None if scale is None else float(scale), bool(float(found_inf)))
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.peer._step(batch_size, scaled)
        return loss

    def register_step_pre_hook(self, hook):
        return self.optimizer.register_step_pre_hook(hook)

    def register_step_post_hook(self, hook):
        return self.optimizer.register_step_post_hook(hook)

    def state_dict(self) -> dict:
        """``Peer.state_dict()``: model, optimizer and the cluster's lineage (so that peers
        resumed from their checkpoints meet again). Call it between steps."""
        return self.peer.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        """Before entering: a ``state_dict()`` of this class, or a plain optimizer's (a
        checkpoint from before the cluster: it continues on a fresh lineage)."""
        if "model" in state_dict and "optimizer" in state_dict:
            self.peer.load_state_dict(state_dict)
        elif self.peer.cluster is not None:
            raise ConfigError("load a checkpoint before entering the DistributedOptimizer (while it is a member, "
                              "its state is the cluster's)")
        else:
            self.optimizer.load_state_dict(state_dict)

    # -- the peer's lifetime
    def __enter__(self) -> Self:
        self.peer.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.peer.__exit__(exc_type, exc, tb)

    def close(self) -> None:
        self.peer.close()

    def __repr__(self) -> str:
        return f"DistributedOptimizer({self.optimizer!r})"

    def __getstate__(self):
        raise TypeError("a DistributedOptimizer holds a live cluster member and cannot be pickled; "
                        "save its state_dict()")
