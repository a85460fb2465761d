"""Who may talk to us: the connection handshake and beacon tags. Pure code, no I/O.

Theory of operation. The end that opened the TCP connection is the *dialer* (D), the end
that accepted it the *listener* (L); each runs a ``Handshake`` started with its role:

    D -> L  HELLO   {v, cluster, id, nonce, auth, info}     (both send at once, no waiting)
    L -> D  HELLO   {v, cluster, id, nonce, auth, info}
    D -> L  PROOF   {mac: MAC("dialer")}                    (D, once it has L's HELLO)
    L -> D  PROOF   {mac: MAC("listener")}                  (L, only once D's PROOF verified)
    D -> L  WELCOME                                         (D, once L's PROOF verified)

    MAC(role) = HMAC-SHA256(key, [protocol version, role, cluster,
                                  dialer id, listener id, dialer nonce, listener nonce])

D is admitted (``done``) when L's PROOF verifies (L sends it only after admitting D); L is
admitted on the WELCOME. Any failed check sends REJECT {reason} with one of the fixed reasons
below and raises ``HandshakeError``; a REJECT received raises it too, with the peer's
(sanitised) reason and ``by_peer`` set.

Why this order and these fields. Each MAC names its role, so a dialer's proof is never a
listener's; both ids and both fresh nonces, so it is good on this connection between these
two peers only; the cluster and the version, so it is good nowhere else. The listener, which
anyone may reach, proves nothing until the dialer has: it is not an oracle that signs
whatever nonce a stranger brings, so a third party that dials two peers and forwards one's
messages to the other gets no proof from either (both wait, and close at their timeout), and
a proof sent back to its maker is refused (it names the other role).

What it does not prove: that the TCP connection is the one the proofs were made on. A third
party that an honest peer dials (it had that peer's address and answered there) can pass the
whole exchange between two peers that know the secret, and then sees and may alter their
traffic: without TLS nothing is encrypted or integrity-checked after admission. With TLS
(``p2ptrain.net.tls``) this handshake runs inside the encrypted channel, whose ends each showed
a certificate of the cluster's CA, so such a relay would need a member's key as well.

Without a secret the MACs are empty (ids and nonces are still exchanged, in the same order)
and anyone on the network can join (the caller logs that once).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
from dataclasses import dataclass

import msgpack

from p2ptrain.net import wire
from p2ptrain.errors import ConfigError, HandshakeError

NONCE_BYTES = 32
MAX_ID_LEN = 64
MAX_CLUSTER_LEN = 64
_MAC_LEN = hashlib.sha256().digest_size
DIALER, LISTENER = "dialer", "listener"  # the roles a MAC names

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
REASON_TLS_MODE = "TLS mismatch: one side has --tls-cert/--tls-key/--tls-ca and the other has none"
# TLS failures are said only to ourselves (the connection is unusable by then): never sent.
REASON_TLS_CERT = "TLS: the peer's certificate is not of this peer's --tls-ca (another CA's, or expired)"
REASON_TLS_CERT_REFUSED = "TLS: the peer refused this peer's certificate (not of its --tls-ca, or expired)"
REASON_TLS_CLOSED = "TLS: the peer closed the connection in the TLS handshake (does it refuse this peer's certificate?)"
REASON_TLS_FAILED = "TLS handshake failed"

# What to do about a refusal that is a setting, not a fault: said with the refusal, once.
ADVICE = {
    REASON_SECRET: "give every peer the same --secret (secret=)",
    REASON_SECRET_MODE: "give every peer the same --secret (secret=), or none to all",
    REASON_CLUSTER: "give every peer the same --cluster (cluster=)",
    REASON_VERSION: "run the same p2ptrain version on every peer",
    REASON_TLS_MODE: "give every peer --tls-cert, --tls-key and --tls-ca (tls_cert=, ...), or none to all",
}
ADVICE[REASON_TLS_CERT] = ADVICE[REASON_TLS_CERT_REFUSED] = ADVICE[REASON_TLS_CLOSED] = (
    "give every machine a certificate of one CA (python -m p2ptrain tls-init) and that CA's ca.pem as --tls-ca")


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
    """One end of the handshake. Call ``start(dialer=...)`` once, then ``receive()`` per frame
    header; send every header they return, in order. ``done`` turns True once admitted both
    ways (see the module docstring for who sends what, when)."""

    def __init__(self, *, cluster: str, peer_id: str, secret: bytes | None, info: dict | None = None,
                 nonce: bytes | None = None):
        if not cluster or len(cluster) > MAX_CLUSTER_LEN:
            raise ConfigError(f"cluster name must be 1..{MAX_CLUSTER_LEN} characters, got {cluster!r}")
        self.cluster = cluster
        self.peer_id = peer_id
        self._key = derive_key(secret, "handshake") if secret else None
        self._nonce = nonce if nonce is not None else os.urandom(NONCE_BYTES)
        self._info = info or {}
        self._dialer: bool | None = None  # our role: set by start()
        self._their: PeerHello | None = None
        self._their_nonce = b""
        self._verified = False  # their PROOF checked
        self._welcomed = False  # they admitted us (the dialer: their PROOF says so)

    @property
    def done(self) -> bool:
        return self._verified and self._welcomed

    @property
    def peer(self) -> PeerHello:
        if self._their is None:
            raise RuntimeError("handshake has not received the peer's hello")
        return self._their

    def start(self, *, dialer: bool) -> list[dict]:
        """Our HELLO. ``dialer``: we opened the connection (the proofs name the role)."""
        if self._dialer is not None:
            raise RuntimeError("handshake started twice")
        self._dialer = dialer
        return [{"t": wire.HELLO, "v": wire.PROTOCOL_VERSION, "cluster": self.cluster, "id": self.peer_id,
                 "nonce": self._nonce, "auth": self._key is not None, "info": self._info}]

    def receive(self, header: dict) -> list[dict]:
        """Advance on one received header. Raises HandshakeError (after which: send
        ``reject(err.reason)`` unless ``err.by_peer``, then close)."""
        if self._dialer is None:
            raise RuntimeError("receive() before start()")
        t = header.get("t")
        if t == wire.REJECT:
            raise HandshakeError(refusal_reason(header), by_peer=True)
        if t == wire.STARTTLS:  # (a peer with TLS options; a link with TLS passed its STARTTLS before: ``tls``)
            raise HandshakeError(REASON_TLS_MODE)
        if t == wire.HELLO and self._their is None:
            return self._on_hello(header)
        if t == wire.PROOF and self._their is not None and not self._verified:
            return self._on_proof(header)
        if t == wire.WELCOME and not self._dialer and self._verified and not self._welcomed:
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
        if h.get("v") != wire.PROTOCOL_VERSION:
            raise HandshakeError(REASON_VERSION)
        if not (isinstance(cluster, str) and isinstance(pid, str) and 0 < len(pid) <= MAX_ID_LEN
                and isinstance(nonce, bytes) and len(nonce) == NONCE_BYTES and isinstance(auth, bool)
                and isinstance(info, dict)):
            raise HandshakeError(REASON_MALFORMED)
        if cluster != self.cluster:
            raise HandshakeError(REASON_CLUSTER)
        if pid == self.peer_id:
            raise HandshakeError(REASON_SELF)
        if auth != (self._key is not None):
            raise HandshakeError(REASON_SECRET_MODE)
        self._their = PeerHello(pid, cluster, info)
        self._their_nonce = nonce
        # The dialer proves first; the listener waits for that proof (it is no oracle).
        return [{"t": wire.PROOF, "mac": self._mac(DIALER)}] if self._dialer else []

    def _on_proof(self, h: dict) -> list[dict]:
        mac = h.get("mac")
        if not isinstance(mac, bytes) or len(mac) > _MAC_LEN:
            raise HandshakeError(REASON_MALFORMED)
        if not hmac.compare_digest(mac, self._mac(LISTENER if self._dialer else DIALER)):
            raise HandshakeError(REASON_SECRET)
        self._verified = True
        if self._dialer:  # (the listener proves only after it verified us: it admitted us)
            self._welcomed = True
            return [{"t": wire.WELCOME}]
        return [{"t": wire.PROOF, "mac": self._mac(LISTENER)}]

    def _mac(self, role: str) -> bytes:
        """The proof that ``role``'s end knows the secret, on this connection only (module docstring)."""
        if self._key is None:
            return b""
        ids = (self.peer_id, self._their.peer_id)
        nonces = (self._nonce, self._their_nonce)
        if not self._dialer:
            ids, nonces = ids[::-1], nonces[::-1]
        msg = msgpack.packb(["p2ptrain/handshake", wire.PROTOCOL_VERSION, role, self.cluster, *ids, *nonces],
                            use_bin_type=True)
        return hmac.new(self._key, msg, hashlib.sha256).digest()


def check_starttls(header: dict) -> None:
    """The first frame either way on a link with TLS must be STARTTLS (``p2ptrain.net.tls``). Raises
    HandshakeError otherwise: the peer's REJECT (``by_peer``), or REASON_TLS_MODE for a HELLO (a
    peer without TLS, which sends its HELLO first), or REASON_MALFORMED for anything else."""
    t = header.get("t")
    if t == wire.STARTTLS:
        return
    if t == wire.REJECT:
        raise HandshakeError(refusal_reason(header), by_peer=True)
    raise HandshakeError(REASON_TLS_MODE if t == wire.HELLO else REASON_MALFORMED)


_warned_open = False


def warn_if_open(secret: bytes | None) -> None:
    """Say once per process, plainly, that a peer without a secret admits anyone."""
    global _warned_open
    if secret is None and not _warned_open:
        _warned_open = True
        logging.getLogger("p2ptrain").warning(
            "no secret set: anyone on this network can join and send gradients; set --secret (or secret=, "
            "or P2PTRAIN_SECRET) to the same value on every peer")
