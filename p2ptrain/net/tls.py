"""Mutual TLS on peer links (``--tls-cert``, ``--tls-key``, ``--tls-ca``; off unless all three are given).

What it adds to the secret's handshake (``auth``): confidentiality and integrity of every frame
after it, and a second proof of membership, a certificate of the cluster's CA at both ends. The
handshake still runs, inside TLS, and still decides admission.

How a link goes TLS (``upgrade``, right after the TCP connection, before auth's HELLO):

    D -> L  STARTTLS        plaintext frame, no payload
    L -> D  STARTTLS        plaintext; L reads nothing more until the TLS handshake begins
    TLS 1.3 handshake       D the client, L the server; each sends its certificate and checks the other's
    ...                     auth's handshake, then every frame, inside TLS

Why a plaintext STARTTLS first, rather than TLS from the first byte: a mismatch is then said in
frames both ends can read. A listener with TLS that gets a HELLO (a peer without TLS speaks first)
refuses it with ``auth.REASON_TLS_MODE``; one without TLS refuses a STARTTLS with the same reason;
each end logs one line within the handshake's timeout, where TLS bytes meeting a plaintext
decoder would be "malformed" at one end and a bare reset at the other. A STARTTLS cannot be
stripped by someone in between: an end with TLS options goes on with TLS or not at all.

Why no hostname check (``check_hostname`` False, ``verify_mode`` CERT_REQUIRED both ways): peers
reach each other at the addresses beacons and ``--peers`` give, IPs that DHCP hands out and
changes, never names a certificate could hold. The CA is the membership list instead: any
certificate it signed is a member (its name is in the debug log of each link). So the CA's key stays on the
machine that ran ``tls-init``, and a machine that leaves for good means a new CA (there is no
revocation).

Call order: ``load(cert, key, ca)`` once (a ``ConfigError`` naming the file for a missing,
unreadable or mismatched one; it also checks that the certificate verifies against the CA);
``await upgrade(link, tls, dialer=..., timeout=...)`` on each new link before its handshake. A
failure is a ``HandshakeError`` (a mismatch or a refused certificate: ``auth``'s reasons) or a
``LinkError``, and the link is closed.
"""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
from dataclasses import dataclass

from p2ptrain.errors import ConfigError, HandshakeError, LinkError
from p2ptrain.net import auth, wire
from p2ptrain.waiting import wait_set

log = logging.getLogger("p2ptrain.net.tls")

OPTIONS = ("--tls-cert", "--tls-key", "--tls-ca")
KEYWORDS = ("tls_cert", "tls_key", "tls_ca")


@dataclass(frozen=True)
class TLS:
    """The two contexts of one peer: ``server`` for links it accepts, ``client`` for those it dials."""

    server: ssl.SSLContext
    client: ssl.SSLContext
    name: str  # our certificate's subject common name (for log lines)


def load(cert, key, ca, *, names: tuple[str, str, str] = KEYWORDS) -> TLS | None:
    """The contexts for ``cert``/``key``/``ca`` (paths), or None when none of them is given.

    Raises ConfigError (one line, naming the option as ``names`` spells it) when only some are
    given, a file cannot be read or is not PEM, the key is not the certificate's, or the
    certificate does not verify against the CA (another CA's, expired)."""
    given = [x is not None and x != "" for x in (cert, key, ca)]
    if not any(given):
        return None
    if not all(given):
        missing = ", ".join(n for n, g in zip(names, given) if not g)
        raise ConfigError(f"TLS needs {', '.join(names[:2])} and {names[2]} together (missing: {missing}); "
                          "python -m p2ptrain tls-init DIR --hosts a,b makes them; or give none for no TLS")
    paths = [os.fspath(x) for x in (cert, key, ca)]
    for name, path, marker in zip(names, paths, ("CERTIFICATE-----", "PRIVATE KEY-----", "CERTIFICATE-----")):
        try:
            with open(path, "rb") as f:
                text = f.read(1 << 20)
        except OSError as exc:
            raise ConfigError(f"{name} {path}: cannot read it ({exc.strerror}); give the file tls-init made "
                              "for this machine") from None
        if b"-----BEGIN " not in text or marker.encode() not in text:
            what = "private key" if "key" in name else "certificate"
            raise ConfigError(f"{name} {path}: not a PEM {what}; give the file tls-init made for this machine")
        if "key" in name and b"ENCRYPTED" in text:
            raise ConfigError(f"{name} {path}: the key is encrypted (a passphrase); give an unencrypted key "
                              "(readable by this user only), as tls-init makes")
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    client.check_hostname = False  # (the module docstring says why)
    for ctx in (server, client):
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        ctx.verify_mode = ssl.CERT_REQUIRED
        try:
            ctx.load_verify_locations(cafile=paths[2])
        except ssl.SSLError as exc:
            raise ConfigError(f"{names[2]} {paths[2]}: not a CA certificate OpenSSL can load ({exc.reason}); "
                              "give the ca.pem tls-init made") from None
        try:
            ctx.load_cert_chain(paths[0], paths[1])
        except ssl.SSLError as exc:
            if exc.reason == "KEY_VALUES_MISMATCH":
                raise ConfigError(f"{names[1]} {paths[1]} is not the key of {names[0]} {paths[0]}: give the "
                                  "two files tls-init made for this machine together") from None
            raise ConfigError(f"{names[0]} {paths[0]} / {names[1]} {paths[1]}: cannot load them ({exc.reason}); "
                              "give the files tls-init made for this machine") from None
    problem, own = _self_check(server, client)
    if problem is not None:
        raise ConfigError(f"{names[0]} {paths[0]} does not verify against {names[2]} {paths[2]} ({problem}): give "
                          "the CA the certificate was made with, or a new certificate (tls-init)")
    return TLS(server, client, _common_name(own))


def _self_check(server: ssl.SSLContext, client: ssl.SSLContext) -> tuple[str | None, dict | None]:
    """A TLS handshake of our own certificate against our own CA, in memory: what a peer with the
    same CA would say of it (None: it passes), and the certificate as a peer sees it. Costs a few
    milliseconds, once."""
    ends = []
    for ctx, server_side in ((client, False), (server, True)):
        incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        ends.append((ctx.wrap_bio(incoming, outgoing, server_side=server_side), incoming, outgoing))
    done = [False, False]
    for _ in range(10):  # (a TLS 1.3 handshake takes two flights each way)
        for i, (obj, _incoming, _outgoing) in enumerate(ends):
            if done[i]:
                continue
            try:
                obj.do_handshake()
                done[i] = True
            except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
                pass
            except ssl.SSLCertVerificationError as exc:
                return exc.verify_message, None
            except ssl.SSLError as exc:
                return exc.reason or str(exc), None
        for (_, _, a_out), (_, b_in, _) in ((ends[0], ends[1]), (ends[1], ends[0])):
            data = a_out.read()
            if data:
                b_in.write(data)
        if all(done):
            return None, ends[0][0].getpeercert()
    return "the handshake did not finish", None


def _common_name(cert: dict | None) -> str:
    """The subject's commonName of a certificate as ``getpeercert()`` gives it ('' if none)."""
    for rdn in (cert or {}).get("subject", ()):
        for key, value in rdn:
            if key == "commonName":
                return auth.sanitise(value, 64)
    return ""


def failure(exc: BaseException) -> HandshakeError | None:
    """What a TLS error (or a link lost to one: its ``__cause__``) means for admission, or None
    when it is not a TLS error: our check of the peer's certificate failed (REASON_TLS_CERT), the
    peer's alert says it refused ours (REASON_TLS_CERT_REFUSED, by the peer), or else the
    handshake failed (REASON_TLS_FAILED, details at debug)."""
    while exc is not None and not isinstance(exc, ssl.SSLError):
        exc = exc.__cause__
    if exc is None:
        return None
    if isinstance(exc, ssl.SSLCertVerificationError):
        log.debug("TLS: the peer's certificate failed verification: %s", getattr(exc, "verify_message", exc))
        return HandshakeError(auth.REASON_TLS_CERT)
    reason = exc.reason or ""
    log.debug("TLS error: %s", exc)
    if "ALERT" in reason and ("CERTIFICATE" in reason or "UNKNOWN_CA" in reason):  # (the peer's verdict on ours)
        return HandshakeError(auth.REASON_TLS_CERT_REFUSED, by_peer=True)
    return HandshakeError(auth.REASON_TLS_FAILED)


async def upgrade(link, tls: TLS, *, dialer: bool, timeout: float) -> None:
    """Run STARTTLS and the TLS handshake on ``link`` (a ``transport.Link`` just connected), within
    ``timeout`` seconds; the link then carries everything over TLS. Raises HandshakeError or
    LinkError (a FrameError for garbage) and closes the link."""
    try:
        await asyncio.wait_for(_upgrade(link, tls, dialer, timeout), timeout)
    except asyncio.TimeoutError:
        link.close(auth.REASON_TIMEOUT)
        raise LinkError(f"{link.remote}: TLS not set up within {timeout:.0f} s") from None
    except HandshakeError as exc:
        link.close(None if exc.by_peer else exc.reason)  # (after TLS began the transport is closed: nothing sent)
        raise
    except BaseException:
        link.close()
        raise


async def _upgrade(link, tls: TLS, dialer: bool, timeout: float) -> None:
    loop = asyncio.get_running_loop()
    raw = link._transport
    if dialer:
        raw.write(wire.frame_bytes({"t": wire.STARTTLS}))
        auth.check_starttls((await link.recv()).header)
    else:
        auth.check_starttls((await link.recv()).header)
        raw.pause_reading()  # (the ClientHello that follows our answer is for TLS, not for the frame decoder)
        raw.write(wire.frame_bytes({"t": wire.STARTTLS}))
    if link._frames or not link._decoder.idle or raw.get_write_buffer_size():
        raise HandshakeError(auth.REASON_MALFORMED)  # (plaintext after a STARTTLS: injected, or a broken peer)
    protocol = raw.get_protocol()
    # A refusal closes the connection without the TLS alert that would say why (asyncio closes
    # before sending it): the other end sees a bare close, said as REASON_TLS_CLOSED.
    try:
        secure = await loop.start_tls(raw, protocol, tls.server if not dialer else tls.client,
                                      server_side=not dialer, ssl_handshake_timeout=timeout)
    except ssl.SSLError as exc:
        raise failure(exc) from None
    except ConnectionError:
        raise HandshakeError(auth.REASON_TLS_CLOSED, by_peer=True) from None
    _secure(link, secure, raw)
    if dialer:  # TLS 1.3: the listener checks our certificate once our side is done; its HELLO says it did
        try:
            link.put_back(await link.recv())
        except LinkError as exc:
            raise (failure(exc) or HandshakeError(auth.REASON_TLS_CLOSED, by_peer=True)) from None
    peer = secure.get_extra_info("peercert")
    log.debug("TLS with %s: certificate %r", link.remote, _common_name(peer))


def _secure(link, transport: asyncio.Transport, raw: asyncio.Transport) -> None:
    """``link`` sends and receives through the TLS ``transport`` (over the TCP transport ``raw``)
    from now on. The ways a link uses its socket itself would bypass TLS, so they are off: sending
    from the caller's memory with ``sendmsg`` (``sender.DirectSender``), a reading thread, the
    receive low-water mark. TLS copies anyway (it encrypts into its own buffer).

    ``send`` still returns only once the frame is all in the kernel, as on a plain link: first the
    TLS layer's buffer empties (``high=1``: paused while it holds anything), then the TCP
    transport's (``_Drain``). A peer that exits right after its last send loses none of it."""
    link._close_io()
    link._lowat_sock = link._reader_sock = None
    link._transport = transport
    transport.set_write_buffer_limits(high=1, low=0)
    link._can_write.set()
    drain = _Drain(raw.get_protocol(), raw.get_write_buffer_size() == 0)
    raw.set_protocol(drain)
    link._tcp = raw  # (what ``send`` waits for; tests read it)
    plain = link._writable

    async def writable(timeout: float | None) -> None:
        await plain(timeout)
        if not await wait_set(drain.empty, timeout):
            raise LinkError(f"{link.name}: peer stopped reading for {timeout:.0f} s")
        link._raise_if_failed()

    link._writable = writable  # (this link's only: ``Link.send`` awaits it after each frame)


class _Drain(asyncio.BufferedProtocol):
    """Between the TCP transport and the TLS protocol: passes every call on, and keeps whether the
    TCP transport holds bytes the kernel has not taken (it pauses its protocol as soon as it holds
    any, ``transport._FrameProtocol``'s ``high=0``, and resumes it once empty)."""

    def __init__(self, inner: asyncio.BaseProtocol, empty: bool):
        self.inner = inner
        self.empty = asyncio.Event()
        if empty:
            self.empty.set()

    def get_buffer(self, sizehint):
        return self.inner.get_buffer(sizehint)

    def buffer_updated(self, nbytes):
        self.inner.buffer_updated(nbytes)

    def eof_received(self):
        return self.inner.eof_received()

    def connection_lost(self, exc):
        self.empty.set()  # (the link has failed: its waiters see that)
        self.inner.connection_lost(exc)

    def pause_writing(self):
        self.empty.clear()
        self.inner.pause_writing()

    def resume_writing(self):
        self.empty.set()  # (before: the TLS layer may write, and pause us again, in there)
        self.inner.resume_writing()
