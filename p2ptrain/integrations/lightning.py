"""``P2PStrategy``: a Lightning script on p2ptrain, by changing the strategy.

    from p2ptrain.integrations.lightning import P2PStrategy
    strategy = P2PStrategy(peer=dict(peers=["10.0.0.1:7100", "10.0.0.2:7100"], listen="0.0.0.0:7100"),
                           data_rank=0, data_shares=2)   # this machine's share of the data
    trainer = lightning.Trainer(strategy=strategy, accelerator="auto", max_steps=1000)
    trainer.fit(module, datamodule)

One process per machine, on any one device Lightning runs on: CUDA, CPU, and MPS (which
Lightning's DDP strategies refuse, torch.distributed having no MPS backend). What it does,
each where DDP would differ from one process:

- **Optimizer**: each optimizer ``configure_optimizers`` returns is wrapped in a
  ``DistributedOptimizer`` (keywords: ``peer=dict(...)``, ``Peer``'s) over the module.
  Lightning's ``optimizer.step(closure)`` runs the closure (forward, backward) and then
  contributes the batch; the cluster's averaged gradient is what the optimizer applies.
  The peer opens when training starts (after a checkpoint's state was loaded into it) and
  leaves at teardown.
- **Data**: the dataloaders get a ``DistributedSampler`` with ``num_replicas=data_shares``,
  ``rank=data_rank``, as under DDP (``use_distributed_sampler=True``, Lightning's default).
- **Clipping** (``Trainer(gradient_clip_val=...)``, by norm or value) applies to the averaged
  gradient, as under DDP; Lightning's own clipping (of this peer's gradient) is turned off.
- **Batch sizes** come from the batches (the first dimension of each ``training_step`` batch).
- **Checkpoints and logs**: DDP's policy. Data rank 0 is global zero: it alone writes
  checkpoints and reports to loggers. To resume, start every peer with that checkpoint
  (``trainer.fit(..., ckpt_path=...)``, the file copied to each machine): its optimizer state
  is the peer's (model, optimizer, the cluster's lineage), so the peers meet again there.
- ``sync_buffers=True``: BatchNorm statistics and other float buffers averaged each round
  (``p2ptrain.integrations.buffers``): the replicas alike, buffers included. Off by default.
- Manual optimization, several optimizers and 16-bit precision with a GradScaler
  (``precision="16-mixed"``) are refused; ``"bf16-mixed"`` and 32-bit work.
"""

from __future__ import annotations

from typing import Any

import torch

try:
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import ParallelStrategy
except ImportError as exc:  # (p2ptrain itself never imports this module)
    raise ImportError("p2ptrain.integrations.lightning needs lightning: pip install \"p2ptrain[lightning]\"") from exc

from p2ptrain.device import pick_device
from p2ptrain.errors import ConfigError
from p2ptrain.integrations.buffers import AveragedBuffers
from p2ptrain.integrations._common import CountingOptimizer, batch_samples, check_share, clip_on_step

_OWNED_OPTIONS = ("clip_grad_norm", "scheduler", "overlap", "device")


class P2PStrategy(ParallelStrategy):
    """Lightning's strategy for one p2ptrain peer per machine (module docstring).

    ``peer``: ``Peer``'s keywords (``peers``, ``listen``, ``min_peers``, ``discovery``,
    ``compression``, ``staleness``, ...). ``data_rank`` of ``data_shares``: this peer's share of
    the data (give every peer its own rank). ``device``: the one to train on here (default:
    p2ptrain's pick, cuda, then mps, then xpu, then cpu; give Lightning the same accelerator). ``sync_buffers``: average float buffers each round."""

    strategy_name = "p2ptrain"

    def __init__(self, peer: dict | None = None, data_rank: int = 0, data_shares: int = 1, *,
                 device: str | torch.device | None = None, sync_buffers: bool = False, **kwargs: Any):
        check_share("P2PStrategy", peer, _OWNED_OPTIONS, "clipping from the Trainer's gradient_clip_val, "
                    "schedulers and the device from Lightning", data_rank, data_shares)
        super().__init__(**kwargs)
        self._device = pick_device("auto" if device is None else device)
        self.data_rank, self.data_shares = data_rank, data_shares
        self._peer_options = dict(peer or {})
        self._sync_buffers = sync_buffers
        self._buffers: AveragedBuffers | None = None
        self._distributed = None
        self._clip: tuple | None = None
        self._hooks: list = []

    # -- where and how many: one device, one process; the data split by data rank -------------
    @property
    def root_device(self) -> torch.device:
        return self._device

    def model_to_device(self) -> None:
        self.model.to(self.root_device)

    @property
    def global_rank(self) -> int:  # (rank_zero_only: logs and the progress bar from data rank 0 only)
        return self.data_rank

    @property
    def world_size(self) -> int:  # (this process's collectives are its own: reduce, barrier, broadcast)
        return 1

    def reduce(self, tensor, *args: Any, **kwargs: Any):
        return tensor

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        pass

    def broadcast(self, obj, src: int = 0):
        return obj

    def all_gather(self, tensor, group=None, sync_grads: bool = False):
        return tensor

    @property
    def is_distributed(self) -> bool:  # (Lightning then gives the dataloaders a DistributedSampler)
        return self.data_shares > 1

    @property
    def distributed_sampler_kwargs(self) -> dict:
        return {"num_replicas": self.data_shares, "rank": self.data_rank}

    @property
    def is_global_zero(self) -> bool:
        return self.data_rank == 0

    # -- optimizers --------------------------------------------------------------------------
    def setup(self, trainer: pl.Trainer) -> None:
        super().setup(trainer)
        if not self.lightning_module.automatic_optimization:
            raise ConfigError("P2PStrategy steps the optimizer for Lightning's automatic optimization; manual "
                              "optimization is not supported (use p2ptrain.DistributedOptimizer in the module)")
        if trainer.precision in ("16-mixed", "16"):
            raise ConfigError("precision='16-mixed' is refused on P2PStrategy: a GradScaler overflow on one peer skips "
                              "a step the others take; use 'bf16-mixed' (no scaler) or 32")
        if len(self.optimizers) > 1:
            raise ConfigError("P2PStrategy trains with one optimizer (a peer averages one gradient per step); "
                              "put the parameter groups in one optimizer")
        if self.optimizers:
            if trainer.gradient_clip_val:  # (clipped after averaging instead: on_train_start; given back at teardown)
                self._clip = (trainer.gradient_clip_val, trainer.gradient_clip_algorithm or "norm", trainer)
                trainer.gradient_clip_val = None
            self._buffers = AveragedBuffers(self.lightning_module) if self._sync_buffers else None
            module = self._buffers.wrap() if self._buffers is not None else self.lightning_module
            self._distributed = CountingOptimizer(self.optimizers[0], module, **self._peer_options)
            self._distributed.buffers = self._buffers
            self.optimizers = [self._distributed]

    def on_train_start(self) -> None:
        """The peer opens: after a checkpoint's optimizer state (the peer's) was loaded into it."""
        super().on_train_start()
        if self._distributed is None or self._distributed.peer.cluster is not None:
            return
        self._distributed.__enter__()
        inner = self._distributed.optimizer
        if self._buffers is not None:
            self._hooks.append(self._buffers.install(inner))  # (before clipping: it must not count the buffers)
        if self._clip is not None:
            self._hooks.append(clip_on_step(inner, self.lightning_module.parameters(), *self._clip[:2]))

    def training_step(self, *args: Any, **kwargs: Any):
        if self._distributed is not None:
            self._distributed.samples += batch_samples(args[0] if args else kwargs.get("batch"))
        return super().training_step(*args, **kwargs)

    def teardown(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        if self._clip is not None:
            self._clip[2].gradient_clip_val = self._clip[0]
            self._clip = None
        if self._distributed is not None and self._distributed.peer.cluster is not None:
            self._distributed.close()
        super().teardown()

    @property
    def peer(self):
        """The ``p2ptrain.Peer`` (once fitting began): ``version``, ``members``, ``param_checksum()``."""
        return self._distributed.peer if self._distributed is not None else None

    @classmethod
    def register_strategies(cls, strategy_registry) -> None:
        strategy_registry.register(cls.strategy_name, cls, description="one p2ptrain peer per machine")
