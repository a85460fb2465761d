"""p2ptrain: train one PyTorch model on several machines of different kinds at once.

Public API (everything else is private by name):

- ``Group``: a static group of peers and its ``allreduce`` (ring-allreduce over TCP).
- ``Peer``: a training loop's member of a cluster (``with peer: ... peer.step(batch_size=n)``).
- ``AsyncPeer``: the same for asyncio programs (``async with``, ``await peer.step(...)``).
- ``DistributedOptimizer``: a ``Peer`` in Horovod's shape (wrap the optimizer; ``optimizer.step()``).
- the exceptions of ``p2ptrain.errors``.

Layout, by layer; a layer imports only those above it in this list (``tests/test_layout.py``):

- base modules: ``errors``, ``identity``, ``trace``, ``device``, ``taskset``, ``waiting``, ``switches``, ``jit``
- ``codecs``: gradient codecs and error feedback (sans-I/O)
- ``net``: frames, handshake, links, discovery
- ``collective``: the ring-allreduce and ``Group``
- ``cluster``: rounds, views, leaders, state for joiners
- ``trainer``: ``AsyncPeer``, ``Peer``, ``DistributedOptimizer``, checkpoints
- ``integrations``: Hugging Face ``Trainer``, Lightning, a DDP hook (each imported only when asked for)
- ``tasks``: what ``join`` trains
- ``commands``: ``python -m p2ptrain ...``
"""

from __future__ import annotations

from p2ptrain.errors import (
    CheckpointError,
    ClosedError,
    CodecError,
    ConfigError,
    DivergedError,
    FingerprintError,
    FrameError,
    GroupError,
    HandshakeError,
    LinkError,
    NotFiniteError,
    P2PTrainError,
    RemoteProtocolError,
    SettingsError,
)

__version__ = "0.1.0"



def __getattr__(name: str):
    # Lazy: importing p2ptrain (and so the CLI) must not import torch until it is used.
    if name == "Group":
        from p2ptrain.collective.group import Group

        return Group
    if name == "AsyncPeer":
        from p2ptrain.trainer.peer import AsyncPeer

        return AsyncPeer
    if name == "Peer":
        from p2ptrain.trainer.sync_peer import Peer

        return Peer
    if name == "DistributedOptimizer":
        from p2ptrain.trainer.distributed_optimizer import DistributedOptimizer

        return DistributedOptimizer
    raise AttributeError(f"module 'p2ptrain' has no attribute {name!r}")

__all__ = [
    "AsyncPeer",
    "CheckpointError",
    "ClosedError",
    "CodecError",
    "ConfigError",
    "DistributedOptimizer",
    "DivergedError",
    "FingerprintError",
    "FrameError",
    "Group",
    "GroupError",
    "HandshakeError",
    "LinkError",
    "NotFiniteError",
    "P2PTrainError",
    "Peer",
    "RemoteProtocolError",
    "SettingsError",
    "__version__",
]
