"""p2ptrain: train one PyTorch model on several machines of different kinds at once.

Public API (everything else is private by name):

- ``Group``: a static group of peers and its ``allreduce`` (ring-allreduce over TCP).
- ``AsyncPeer``: a training loop's member of a cluster (rounds, staleness 0 for now).
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
    raise AttributeError(f"module 'p2ptrain' has no attribute {name!r}")

__all__ = [
    "AsyncPeer",
    "Group",
    "__version__",
    "P2PTrainError",
    "ConfigError",
    "RemoteProtocolError",
    "FrameError",
    "CodecError",
    "HandshakeError",
    "LinkError",
    "GroupError",
    "FingerprintError",
    "CheckpointError",
    "ClosedError",
]
