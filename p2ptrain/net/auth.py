"""Who may talk to us: the connection handshake and beacon tags. Pure code, no I/O.

Theory of operation. Both ends of a new TCP connection run the same ``Handshake``:

    1. each sends HELLO   {cluster, id, nonce, auth, info}        (at once, no waiting)
    2. on the other's HELLO: check cluster, id, auth mode; send PROOF {mac}
    3. on the other's PROOF: check the mac; send WELCOME
    4. on the other's WELCOME: we were accepted

The connection is admitted when we checked their PROOF *and* got their WELCOME. Any failed
check sends REJECT {reason} with one of the fixed reasons below and raises ``HandshakeError``;
a REJECT received raises it too, with the peer's (sanitised) reason and ``by_peer`` set.

With a secret the mac is HMAC-SHA256 over both ids and both fresh nonces, prover first, so
a proof cannot be replayed on another connection or reflected back at its sender. Without
a secret the mac is empty and anyone on the network can join (the caller logs that once).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
from dataclasses import dataclass

from p2ptrain.net import wire
from p2ptrain.errors import ConfigError, HandshakeError

NONCE_BYTES = 32
MAX_ID_LEN = 64
MAX_CLUSTER_LEN = 64
_MAC_LEN = hashlib.sha256().digest_size

# The only reasons ever sent to a peer: fixed strings, nothing internal.
REASON_CLUSTER = "wrong cluster"
REASON_SECRET = "authentication failed: wrong secret"
REASON_SECRET_MODE = "secret mismatch: one side has a secret and the other has none"
REASON_SELF = "connected to itself"
REASON_MALFORMED = "malformed handshake"
REASON_VERSION = "protocol version mismatch"
REASON_UNEXPECTED = "unexpected peer"
REASON_TIMEOUT = "handshake timed out"
REASON_NOT_FINITE = "it left the allreduce: its values held NaN or inf, which a lossy codec cannot carry"  # (Group)
REASON_FAILED = "it left the allreduce after a failure (that peer's own error says which)"  # (Group)

# What to do about a refusal that is a setting, not a fault: said with the refusal, once.
ADVICE = {
    REASON_SECRET: "give every peer the same --secret (secret=)",
    REASON_SECRET_MODE: "give every peer the same --secret (secret=), or none to all",
    REASON_CLUSTER: "give every peer the same --cluster (cluster=)",
    REASON_VERSION: "run the same p2ptrain version on every peer",
}


def advice(reason: str) -> str | None:
    """What to do about a handshake refused for ``reason`` (``HandshakeError.reason``, by either
    end), or None when it is not a setting (a malformed or timed-out handshake: a fault, or a moment)."""
    return ADVICE.get(reason)


def secret_from(secret: str | bytes | None, env: dict | None = None) -> bytes | None:
    """The shared secret as bytes: the argument, else $P2PTRAIN_SECRET, else None."""
    if secret is None:
        secret = (os.environ if env is None else env).get("P2PTRAIN_SECRET") or None
    if secret is None:
        return None
    if not isinstance(secret, (str, bytes, bytearray, memoryview)):  # (bytes(123) is 123 zero bytes)
        raise ConfigError(f"the secret must be a str or bytes, got {type(secret).__name__}: pass it as a string")
    raw = secret.encode() if isinstance(secret, str) else bytes(secret)
    if not raw:
        raise ConfigError("the secret is empty: give a non-empty secret, or none at all")
    return raw


def derive_key(secret: bytes, purpose: str) -> bytes:
    """A key per purpose, so a beacon tag is never a valid handshake proof."""
    return hmac.new(secret, b"p2ptrain/" + purpose.encode(), hashlib.sha256).digest()


def beacon_tag(secret: bytes, body: bytes) -> bytes:
    return hmac.new(derive_key(secret, "beacon"), body, hashlib.sha256).digest()


def beacon_tag_ok(secret: bytes, body: bytes, tag: bytes) -> bool:
    return hmac.compare_digest(beacon_tag(secret, body), tag)


def sanitise(text: object, limit: int = 200) -> str:
    """A peer's words, fit for our log: one printable line of at most ``limit`` characters."""
    s = str(text)[:limit]
    return "".join(c if c.isprintable() else "?" for c in s)


def refusal_reason(header: dict, limit: int = 200) -> str:
    """Why a peer refused or closed a link (a REJECT's ``reason``), fit for our log."""
    return sanitise(header.get("reason", "no reason"), limit)


@dataclass(frozen=True)
class PeerHello:
    """What the other end said about itself, once the handshake is done."""

    peer_id: str
    cluster: str
    info: dict


class Handshake:
    """One end of the handshake. Call ``start()`` once, then ``receive()`` per frame header;
    send every header they return, in order. ``done`` turns True once admitted both ways."""

    def __init__(self, *, cluster: str, peer_id: str, secret: bytes | None, info: dict | None = None,
                 nonce: bytes | None = None):
        if not cluster or len(cluster) > MAX_CLUSTER_LEN:
            raise ConfigError(f"cluster name must be 1..{MAX_CLUSTER_LEN} characters, got {cluster!r}")
        self.cluster = cluster
        self.peer_id = peer_id
        self._key = derive_key(secret, "handshake") if secret else None
        self._nonce = nonce if nonce is not None else os.urandom(NONCE_BYTES)
        self._info = info or {}
        self._their: PeerHello | None = None
        self._their_nonce = b""
        self._verified = False
        self._welcomed = False

    @property
    def done(self) -> bool:
        return self._verified and self._welcomed

    @property
    def peer(self) -> PeerHello:
        if self._their is None:
            raise RuntimeError("handshake has not received the peer's hello")
        return self._their

    def start(self) -> list[dict]:
        return [{"t": wire.HELLO, "v": wire.PROTOCOL_VERSION, "cluster": self.cluster, "id": self.peer_id,
                 "nonce": self._nonce, "auth": self._key is not None, "info": self._info}]

    def receive(self, header: dict) -> list[dict]:
        """Advance on one received header. Raises HandshakeError (after which: send
        ``reject(err.reason)`` unless ``err.by_peer``, then close)."""
        t = header.get("t")
        if t == wire.REJECT:
            raise HandshakeError(refusal_reason(header), by_peer=True)
        if t == wire.HELLO and self._their is None:
            return self._on_hello(header)
        if t == wire.PROOF and self._their is not None and not self._verified:
            return self._on_proof(header)
        if t == wire.WELCOME and self._verified and not self._welcomed:
            self._welcomed = True
            return []
        raise HandshakeError(REASON_MALFORMED)

    def reject(self, reason: str) -> dict:
        return {"t": wire.REJECT, "reason": reason}

    def check_expected(self, ok: bool) -> None:
        """Called by the owner after the hello when it has its own idea of who may connect."""
        if not ok:
            raise HandshakeError(REASON_UNEXPECTED)

    # -- steps ----------------------------------------------------------------------------
    def _on_hello(self, h: dict) -> list[dict]:
        cluster, pid, nonce, auth, info = h.get("cluster"), h.get("id"), h.get("nonce"), h.get("auth"), h.get("info", {})
        if not (isinstance(cluster, str) and isinstance(pid, str) and 0 < len(pid) <= MAX_ID_LEN
                and isinstance(nonce, bytes) and len(nonce) == NONCE_BYTES and isinstance(auth, bool)
                and isinstance(info, dict)):
            raise HandshakeError(REASON_MALFORMED)
        if h.get("v") != wire.PROTOCOL_VERSION:
            raise HandshakeError(REASON_VERSION)
        if cluster != self.cluster:
            raise HandshakeError(REASON_CLUSTER)
        if pid == self.peer_id:
            raise HandshakeError(REASON_SELF)
        if auth != (self._key is not None):
            raise HandshakeError(REASON_SECRET_MODE)
        self._their = PeerHello(pid, cluster, info)
        self._their_nonce = nonce
        return [{"t": wire.PROOF, "mac": self._mac(self.peer_id, pid, self._their_nonce, self._nonce)}]

    def _on_proof(self, h: dict) -> list[dict]:
        mac = h.get("mac")
        if not isinstance(mac, bytes) or len(mac) > _MAC_LEN:
            raise HandshakeError(REASON_MALFORMED)
        expected = self._mac(self._their.peer_id, self.peer_id, self._nonce, self._their_nonce)
        if not hmac.compare_digest(mac, expected):
            raise HandshakeError(REASON_SECRET)
        self._verified = True
        return [{"t": wire.WELCOME}]

    def _mac(self, prover: str, verifier: str, verifier_nonce: bytes, prover_nonce: bytes) -> bytes:
        if self._key is None:
            return b""
        msg = b"\0".join([b"proof", self.cluster.encode(), prover.encode(), verifier.encode(),
                          verifier_nonce, prover_nonce])
        return hmac.new(self._key, msg, hashlib.sha256).digest()


_warned_open = False


def warn_if_open(secret: bytes | None) -> None:
    """Say once per process, plainly, that a peer without a secret admits anyone."""
    global _warned_open
    if secret is None and not _warned_open:
        _warned_open = True
        logging.getLogger("p2ptrain").warning(
            "no secret set: anyone on this network can join and send gradients; set --secret (or secret=, "
            "or P2PTRAIN_SECRET) to the same value on every peer")
