"""p2ptrain: train one PyTorch model on several machines of different kinds at once.

Public API (everything else is private by name):

- ``Group``: a static group of peers and its ``allreduce`` (ring-allreduce over TCP).
- the exceptions of ``p2ptrain.errors``.
"""

from __future__ import annotations

from p2ptrain.errors import (
    ClosedError,
    CodecError,
    ConfigError,
    FrameError,
    GroupError,
    HandshakeError,
    LinkError,
    P2PTrainError,
    RemoteProtocolError,
)

__version__ = "0.1.0"

from p2ptrain.group import Group  # noqa: E402  (after __version__: the CLI imports it)

__all__ = [
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
    "ClosedError",
]
