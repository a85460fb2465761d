"""``P2PTrainer``: a Hugging Face ``Trainer`` script on p2ptrain, by changing two lines.

    from p2ptrain.integrations.transformers import P2PTrainer      # was: from transformers import Trainer
    trainer = P2PTrainer(model=model, args=args, train_dataset=train,  # was: Trainer(...)
                         peer=dict(peers=["10.0.0.2:7100"], listen="0.0.0.0:7100", min_peers=2),
                         data_rank=0, data_shares=2)              # this machine's share of the data
    trainer.train()                                                # (resume_from_checkpoint=True resumes)

What it changes in ``Trainer``, each where DDP would differ from one process:

- **The optimizer** the Trainer builds (or is given) is wrapped in a ``DistributedOptimizer``
  (keywords: ``peer=dict(...)``, ``Peer``'s) over the model: each ``optimizer.step()`` contributes
  the batch, and the cluster's averaged gradient is what the optimizer applies. The peer opens
  when training begins (after ``Trainer`` loaded a checkpoint into it) and leaves when
  ``train`` returns or raises.
- **Data**: each peer reads its share. The sampler's order (a random one seeded by
  ``args.seed`` and the epoch, the same on every peer) is cut into batches, and batch ``i`` is
  this peer's when ``i % data_shares == data_rank``: the batches accelerate deals to ranks
  under DDP. The last round is filled from the start, so every share has as many batches.
  ``train_sampling_strategy="sequential"`` keeps the dataset's order; ``"group_by_length"``
  its sampler's, the same on every peer that runs the same script with the same seed.
- **Clipping** (``args.max_grad_norm``) applies to the averaged gradient, as DDP's does: the
  Trainer's own clipping (of this peer's gradient alone) is turned off in a copy of ``args``.
- **Batch sizes** come from the batches: each micro-batch's first dimension is counted, and the
  update weighs each peer by the samples behind its gradient.
- **Checkpoints and logs**: every peer saves its own checkpoints (``args.output_dir`` gets a
  ``peer-<data_rank>`` folder), so each resumes from its own with ``train(resume_from_checkpoint=
  True)``: the optimizer's file holds the peer's state (model, optimizer, the cluster's
  lineage), and peers resumed from the same step meet again. Only data rank 0 reports to
  loggers (``report_to``) and prints, as process zero does under DDP.
- **fp16** is refused: a GradScaler overflow on one peer would skip a step the others take.
  bf16 (``args.bf16``) and fp32 need no scaler.
- ``sync_buffers=True``: BatchNorm statistics and other float buffers averaged each round
  (``p2ptrain.integrations.buffers``): the replicas alike, buffers included, so an evaluation
  on the same data gives the same number on every peer. Off by default.

At staleness 0 (the default) every ``step`` applies one update, so the Trainer's scheduler and
``max_steps`` count updates, as under DDP. Loss normalised by tokens (``num_items_in_batch``,
causal LMs) is normalised by this peer's tokens, and peers are weighed by samples, not tokens.
"""

from __future__ import annotations

import copy
import math
import os

import torch

try:
    import transformers
except ImportError as exc:  # (p2ptrain itself never imports this module)
    raise ImportError("p2ptrain.integrations.transformers needs transformers and accelerate: "
                      "pip install \"p2ptrain[transformers]\"") from exc

from p2ptrain.errors import ConfigError
from p2ptrain.integrations._common import CountingOptimizer, batch_samples, check_share, clip_on_step
from p2ptrain.integrations.buffers import AveragedBuffers
from p2ptrain.trainer.distributed_optimizer import DistributedOptimizer

# Set by P2PTrainer from TrainingArguments: passing them in peer=dict(...) would say two things.
_OWNED_OPTIONS = ("clip_grad_norm", "scheduler", "overlap")


class PeerShardSampler(torch.utils.data.Sampler):
    """This peer's share of ``sampler``'s batches (see the module docstring): batch ``i`` of
    ``batch_size`` indices is ours when ``i % shares == rank``. ``shuffle``: the order is a
    permutation seeded by ``seed + epoch`` (``set_epoch``), the same on every peer, in place of
    ``sampler``'s own (a ``RandomSampler`` drawing from each process's global generator)."""

    def __init__(self, sampler, batch_size: int, rank: int, shares: int, *, shuffle: bool, seed: int = 0):
        self.sampler, self.batch_size, self.rank, self.shares = sampler, batch_size, rank, shares
        self.shuffle, self.seed, self.epoch = shuffle, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _rounds(self) -> int:
        return math.ceil(len(self.sampler) / (self.batch_size * self.shares))

    def __len__(self) -> int:
        return self._rounds() * self.batch_size

    def __iter__(self):
        if self.shuffle:
            order = torch.randperm(len(self.sampler), generator=torch.Generator().manual_seed(self.seed + self.epoch))
            order = order.tolist()
        else:
            order = list(self.sampler)
        per_round = self.batch_size * self.shares
        need = self._rounds() * per_round
        order = (order * math.ceil(need / len(order)))[:need] if order else order  # (the last round filled)
        for start in range(self.rank * self.batch_size, len(order), per_round):
            yield from order[start:start + self.batch_size]


class P2PTrainer(transformers.Trainer):
    """``transformers.Trainer`` whose optimizer steps through a p2ptrain peer (module docstring).

    ``peer``: ``Peer``'s keywords (``peers``, ``listen``, ``min_peers``, ``cluster``, ``secret``,
    ``compression``, ``staleness``, ...); clipping comes from ``args.max_grad_norm``.
    ``data_rank`` of ``data_shares``: which share of the training data this peer reads (0-based;
    give every peer a different rank, as ``RANK`` under DDP). ``sync_buffers``: average float
    buffers each round. Raises ``ConfigError`` for fp16 and for a bad rank."""

    def __init__(self, *args, peer: dict | None = None, data_rank: int = 0, data_shares: int = 1,
                 sync_buffers: bool = False, **kwargs):
        check_share("P2PTrainer", peer, _OWNED_OPTIONS, "clipping from args.max_grad_norm, the Trainer's scheduler",
                    data_rank, data_shares)
        self.data_rank, self.data_shares = data_rank, data_shares  # (Trainer.__init__ asks is_world_process_zero)
        super().__init__(*args, **kwargs)
        if self.args.fp16:
            raise ConfigError("fp16 is refused on p2ptrain's Trainer: a GradScaler overflow on one peer skips a step "
                              "the others take; use bf16=True (no scaler) or fp32")
        self._peer_options = dict(peer or {})
        self._clip = self.args.max_grad_norm if self.args.max_grad_norm and self.args.max_grad_norm > 0 else None
        self.args = copy.copy(self.args)  # (the caller's TrainingArguments stay as given)
        self.args.max_grad_norm = 0.0  # clipped after averaging instead (clip_on_step)
        self.args.output_dir = os.path.join(self.args.output_dir, f"peer-{data_rank}")
        self._buffers = AveragedBuffers(self.model) if sync_buffers else None
        self._distributed: CountingOptimizer | None = None
        self._hooks: list = []

    # -- the optimizer ----------------------------------------------------------------------
    def create_optimizer(self, model=None):
        optimizer = super().create_optimizer(model)
        if isinstance(optimizer, DistributedOptimizer) and optimizer is not self._distributed:
            raise ConfigError("give P2PTrainer a plain torch optimizer (optimizers=(opt, sched)) and its options as "
                              "peer=dict(...): it makes the DistributedOptimizer itself")
        if self._distributed is None:
            module = self._buffers.wrap() if self._buffers is not None else self.model
            self._distributed = CountingOptimizer(optimizer, module, **self._peer_options)
            self._distributed.buffers = self._buffers
        self.optimizer = self._distributed
        return self.optimizer

    @property
    def peer(self):
        """The ``p2ptrain.Peer`` (once the optimizer is made): ``version``, ``members``, ``param_checksum()``."""
        return self._distributed.peer if self._distributed is not None else None

    def training_step(self, model, inputs, *args, **kwargs):
        if self._distributed is not None:
            self._distributed.samples += batch_samples(inputs)
        return super().training_step(model, inputs, *args, **kwargs)

    def train(self, *args, **kwargs):
        """``Trainer.train``; the peer opens when training begins and leaves when this returns or raises."""
        self.add_callback(_OpenPeer(self))
        try:
            return super().train(*args, **kwargs)
        finally:
            self.remove_callback(_OpenPeer)
            self._close_peer()

    def _open_peer(self) -> None:
        if self._distributed.peer.cluster is not None:
            raise ConfigError("this P2PTrainer's peer has left its cluster; make a new P2PTrainer to train again "
                              "(train(resume_from_checkpoint=True) continues from its last checkpoint)")
        self._distributed.__enter__()
        inner = self._distributed.optimizer
        if self._buffers is not None:
            self._hooks.append(self._buffers.install(inner))  # (before clipping: it must not count the buffers)
        if self._clip is not None:
            self._hooks.append(clip_on_step(inner, self.model.parameters(), self._clip))

    def _close_peer(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        if self._distributed is not None and self._distributed.peer.cluster is not None:
            self._distributed.close()

    # -- data ---------------------------------------------------------------------------------
    def _get_train_sampler(self, train_dataset=None):
        dataset = train_dataset if train_dataset is not None else self.train_dataset
        if self.args.train_sampling_strategy == "batch_rebalance":
            raise ConfigError("train_sampling_strategy='batch_rebalance' makes batches per rank itself; use 'random', "
                              "'sequential' or 'group_by_length' with P2PTrainer")
        inner = super()._get_train_sampler(dataset)
        if inner is None:
            raise ConfigError("P2PTrainer shares a dataset with a length among the peers; an IterableDataset cannot "
                              "be split here: give each peer its own stream (its own files or seed)")
        return PeerShardSampler(inner, self._train_batch_size, self.data_rank, self.data_shares,
                                shuffle=isinstance(inner, torch.utils.data.RandomSampler), seed=self.args.seed)

    # -- who logs -----------------------------------------------------------------------------
    def is_world_process_zero(self) -> bool:
        return self.data_rank == 0 and super().is_world_process_zero()

    def is_local_process_zero(self) -> bool:
        return self.data_rank == 0 and super().is_local_process_zero()


class _OpenPeer(transformers.TrainerCallback):
    """Opens the peer when training begins: after ``Trainer`` prepared the optimizer (accelerate
    reloads its state) and loaded a checkpoint into it, before the first step."""

    def __init__(self, trainer: P2PTrainer):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        self.trainer._open_peer()
