"""Ways for an existing training script to train on p2ptrain, each a few changed lines.

- ``p2ptrain.integrations.transformers``: ``P2PTrainer``, a Hugging Face ``Trainer`` whose
  optimizer steps through a p2ptrain peer (``pip install "p2ptrain[transformers]"``).
- ``p2ptrain.integrations.lightning``: ``P2PStrategy``, for ``lightning.Trainer(strategy=...)``
  (``pip install "p2ptrain[lightning]"``).
- ``p2ptrain.integrations.ddp``: ``P2PHook``, a ``DistributedDataParallel`` communication hook
  that averages DDP's gradient buckets over a p2ptrain ring between machines.
- ``p2ptrain.integrations.buffers``: ``AveragedBuffers``, BatchNorm statistics and other float
  buffers kept alike on every peer (averaged each round with the gradients).

Nothing here is imported by ``import p2ptrain``; each module imports its framework when it is
imported itself, and says what to install where it is missing.
"""
