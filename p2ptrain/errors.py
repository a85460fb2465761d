"""The exceptions p2ptrain raises, all under one root.

    P2PTrainError
    ├── ConfigError            a bad option or argument from our own caller (also a ValueError)
    │   └── NotFiniteError     values a lossy codec cannot carry (NaN, inf, past 2**127)
    ├── RemoteProtocolError    a peer sent something we refuse; the peer's fault, not ours
    │   ├── FrameError         bytes that are not a valid frame (magic, version, lengths, header);
    │   │                      ``peer_version`` set when the frame is of another protocol version
    │   ├── CodecError         a compressed payload that fails validation
    │   └── HandshakeError     a peer not admitted (cluster, version, secret), or one that refused us;
    │                          ``reason`` is the fixed reason, ``by_peer`` says who refused
    ├── LinkError              a connection that failed, closed or timed out
    ├── GroupError             a group that cannot form, or a collective that cannot complete
    ├── WithdrawnError         (internal) a contribution withdrawn while its ring ran (overlap)
    ├── DivergedError          the model's parameters hold NaN or inf: training cannot go on from them
    ├── FingerprintError       this model is not the cluster's (names the first difference)
    ├── SettingsError          this peer's shared settings (compression, staleness, ...) are not the cluster's
    ├── CheckpointError        a checkpoint file that cannot be written or read
    └── ClosedError            an object used after it was closed

Messages are one line and say what to do. Nothing internal is ever echoed to a peer:
the reasons sent over the wire are the fixed strings in ``p2ptrain.net.auth``. Code that
must tell causes apart reads an attribute (``peer_version``, ``reason``, ``by_peer``), never
the message.
"""

from __future__ import annotations


class P2PTrainError(Exception):
    """Root of every error p2ptrain raises on purpose."""


class ConfigError(P2PTrainError, ValueError):
    """An option or argument given to p2ptrain is invalid."""


class NotFiniteError(ConfigError):
    """Values a lossy codec cannot carry: NaN, inf, or past 2**127 in magnitude (a gradient that
    overflowed). In a cluster the round aborts at once and the contribution holding them is left out."""


class RemoteProtocolError(P2PTrainError):
    """A peer broke the protocol. Parsers of network input raise this type and nothing else."""


class FrameError(RemoteProtocolError):
    """Bytes that are not a valid frame: wrong magic or version, a length over its limit, a bad header.
    ``peer_version`` is the protocol version the peer speaks when that is what is wrong, else None."""

    def __init__(self, message: str, *, peer_version: int | None = None):
        super().__init__(message)
        self.peer_version = peer_version


class CodecError(RemoteProtocolError):
    """A compressed payload that fails validation (sizes, indices, scales, decompressed length)."""


class HandshakeError(RemoteProtocolError):
    """A connection that did not pass the handshake. ``reason`` is one line, safe to log: one of
    ``p2ptrain.net.auth``'s fixed reasons, or, with ``by_peer``, the words of a peer that refused
    us (sanitised; a peer of this version sends one of those fixed reasons too)."""

    def __init__(self, reason: str, *, by_peer: bool = False):
        super().__init__(f"refused by peer: {reason}" if by_peer else reason)
        self.reason = reason
        self.by_peer = by_peer


class LinkError(P2PTrainError):
    """A connection to a peer failed, closed or timed out."""


class GroupError(P2PTrainError):
    """A group could not form (names who is missing) or a collective could not complete."""


class WithdrawnError(P2PTrainError):
    """This peer withdrew a contribution its round already held: backward was still writing it
    and the batch turned out otherwise (another size, a second backward). Its round aborts and
    the batch goes in the next one; nobody need act."""


class DivergedError(P2PTrainError):
    """This peer's parameters hold NaN or inf (a learning rate too high, an overflow): no gradient
    computed from them can be carried (a lossy codec) or mean anything, and every member holds
    the same parameters. Training stops; resume from a checkpoint with a lower learning rate."""


class FingerprintError(P2PTrainError):
    """This peer's model (parameter names, shapes, dtypes) differs from the cluster's."""


class SettingsError(P2PTrainError):
    """A setting every peer must share (``p2ptrain.cluster.settings``) differs from the cluster's."""


class CheckpointError(P2PTrainError):
    """A checkpoint that cannot be written, or a file that is not a readable checkpoint."""


class ClosedError(P2PTrainError):
    """An object was used after it was closed."""
