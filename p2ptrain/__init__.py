"""p2ptrain: train one PyTorch model on several machines of different kinds at once.

Public API (everything else is private by name):

- ``Group``: a static group of peers and its ``allreduce`` (ring-allreduce over TCP).
- ``Peer``: a training loop's member of a cluster (``with peer: ... peer.step(batch_size=n)``).
- ``AsyncPeer``: the same for asyncio programs (``async with``, ``await peer.step(...)``).
- ``DistributedOptimizer``: a ``Peer`` in Horovod's shape (wrap the optimizer; ``optimizer.step()``).
- the exceptions of ``p2ptrain.errors``.
"""

from __future__ import annotations

from p2ptrain.errors import (
    CheckpointError,
    ClosedError,
    CodecError,
    ConfigError,
    FingerprintError,
    FrameError,
    GroupError,
    HandshakeError,
    LinkError,
    P2PTrainError,
    RemoteProtocolError,
)

__version__ = "0.1.0"



def __getattr__(name: str):
    # Lazy: importing p2ptrain (and so the CLI) must not import torch until it is used.
    if name == "Group":
        from p2ptrain.group import Group

        return Group
    if name == "AsyncPeer":
        from p2ptrain.peer import AsyncPeer

        return AsyncPeer
    if name == "Peer":
        from p2ptrain.sync_peer import Peer

        return Peer
    if name == "DistributedOptimizer":
        from p2ptrain.distributed_optimizer import DistributedOptimizer

        return DistributedOptimizer
    raise AttributeError(f"module 'p2ptrain' has no attribute {name!r}")

__all__ = [
    "AsyncPeer",
    "CheckpointError",
    "ClosedError",
    "CodecError",
    "ConfigError",
    "DistributedOptimizer",
    "FingerprintError",
    "FrameError",
    "Group",
    "GroupError",
    "HandshakeError",
    "LinkError",
    "P2PTrainError",
    "Peer",
    "RemoteProtocolError",
    "__version__",
]
