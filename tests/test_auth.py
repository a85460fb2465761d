"""The handshake, two ends joined by a fake link (no sockets)."""

import pytest

from p2ptrain.net import auth, wire
from p2ptrain.errors import ConfigError, HandshakeError


def hs(pid, secret=None, cluster="lab", **kw):
    return auth.Handshake(cluster=cluster, peer_id=pid, secret=secret, info={"who": pid}, **kw)


def run(a, b):
    """``a`` dials ``b``: deliver messages until quiet; returns (error_a, error_b)."""
    to_b, to_a = list(a.start(dialer=True)), list(b.start(dialer=False))
    errors = {"a": None, "b": None}
    for _ in range(10):
        for side, me, inbox, outbox in (("a", a, to_a, to_b), ("b", b, to_b, to_a)):
            while inbox and errors[side] is None:
                h = wire.unpack_header(wire.pack_header(inbox.pop(0))[wire.PREFIX_SIZE:])  # through msgpack
                try:
                    outbox.extend(me.receive(h))
                except HandshakeError as exc:
                    errors[side] = exc
                    if not exc.by_peer:
                        outbox.append(me.reject(exc.reason))
    return errors["a"], errors["b"]


def test_no_secret_admits_both_ways():
    a, b = hs("a"), hs("b")
    assert run(a, b) == (None, None)
    assert a.done and b.done
    assert a.peer.peer_id == "b" and a.peer.info == {"who": "b"} and b.peer.peer_id == "a"


def test_same_secret_admits():
    a, b = hs("a", b"s3cret"), hs("b", b"s3cret")
    assert run(a, b) == (None, None) and a.done and b.done


def test_wrong_secret_refused_with_reason_on_both_sides():
    a, b = hs("a", b"right"), hs("b", b"wrong")
    ea, eb = run(a, b)
    assert not a.done and not b.done
    assert ea.reason == auth.REASON_SECRET and eb.reason == auth.REASON_SECRET


@pytest.mark.parametrize("kw_a, kw_b, reason", [
    ({"cluster": "lab"}, {"cluster": "home"}, auth.REASON_CLUSTER),
    ({"secret": b"x"}, {}, auth.REASON_SECRET_MODE),
])
def test_mismatches_are_refused(kw_a, kw_b, reason):
    ea, eb = run(hs("a", **kw_a), hs("b", **kw_b))
    assert ea.reason == reason and eb.reason == reason


def test_connected_to_itself():
    ea, _ = run(hs("a"), hs("a"))
    assert ea.reason == auth.REASON_SELF


def hello(pid="m", nonce=b"\2" * 32, auth=True):
    return {"t": "hello", "v": wire.PROTOCOL_VERSION, "cluster": "lab", "id": pid, "nonce": nonce, "auth": auth,
            "info": {}}


@pytest.mark.parametrize("nonce", [b"\2" * 32, b"\1" * 32], ids=["fresh nonce", "our own nonce"])
def test_a_dialers_proof_reflected_back_at_it_fails(nonce):
    # An attacker without the secret, dialed by us, sends our own proof back as its own.
    a = hs("a", b"k", nonce=b"\1" * 32)
    a.start(dialer=True)
    (proof,) = a.receive(hello(nonce=nonce))
    with pytest.raises(HandshakeError, match="wrong secret"):
        a.receive(proof)


def test_a_listener_proves_nothing_until_the_dialer_has():
    """A listener that proved itself on any hello signed a stranger's nonce: relayed to the
    peer whose hello the stranger copied, that proof admitted the stranger as this listener."""
    b = hs("b", b"k")
    b.start(dialer=False)
    assert b.receive(hello("a")) == []
    with pytest.raises(HandshakeError, match="wrong secret"):
        b.receive({"t": "proof", "mac": b"\0" * 32})
    assert not b.done


def test_the_relay_of_a_proof_between_two_listeners_fails():
    """A third party dials A and B, and forwards everything one says to the other: each sees
    the other's hello, neither proves, so there is nothing to forward (old code: both admitted)."""
    a, b = hs("a", b"k"), hs("b", b"k")
    to_b, to_a = a.start(dialer=False), b.start(dialer=False)
    assert a.receive(to_a[0]) == [] and b.receive(to_b[0]) == []
    assert not a.done and not b.done


def test_proofs_name_role_ids_nonces_cluster_and_version(monkeypatch):
    """Each field changes the MAC: a proof made for anything else is refused."""
    def dialer_proof(**kw):
        d = hs(kw.get("me", "a"), b"k", cluster=kw.get("cluster", "lab"), nonce=kw.get("mine", b"\1" * 32))
        d.start(dialer=kw.get("dialer", True))
        their = hello(kw.get("them", "b"), kw.get("theirs", b"\2" * 32))
        their["cluster"] = kw.get("cluster", "lab")
        d.receive(their)
        return d._mac(auth.DIALER)
    base = dialer_proof()
    assert len(base) == 32
    for change in [{"me": "c"}, {"them": "c"}, {"mine": b"\3" * 32}, {"theirs": b"\3" * 32}, {"cluster": "x"},
                   {"dialer": False}]:
        assert dialer_proof(**change) != base, change
    monkeypatch.setattr(wire, "PROTOCOL_VERSION", wire.PROTOCOL_VERSION + 1)
    assert dialer_proof() != base


def test_without_a_secret_ids_and_nonces_are_exchanged_in_the_same_order():
    a, b = hs("a"), hs("b")
    to_b, to_a = a.start(dialer=True), b.start(dialer=False)
    assert b.receive(to_b[0]) == []
    (proof,) = a.receive(to_a[0])
    assert proof == {"t": "proof", "mac": b""}
    (back,) = b.receive(proof)
    assert back == {"t": "proof", "mac": b""} and not b.done
    assert a.receive(back) == [{"t": "welcome"}] and a.done
    assert b.receive({"t": "welcome"}) == [] and b.done


def test_a_dialer_takes_no_welcome_and_a_listener_no_early_one():
    a = hs("a")
    a.start(dialer=True)
    a.receive(hello(auth=False))
    with pytest.raises(HandshakeError, match="malformed"):
        a.receive({"t": "welcome"})
    b = hs("b")
    b.start(dialer=False)
    b.receive(hello(auth=False))
    with pytest.raises(HandshakeError, match="malformed"):
        b.receive({"t": "welcome"})


@pytest.mark.parametrize("hello", [
    {"t": "hello"},
    {"t": "hello", "v": wire.PROTOCOL_VERSION, "cluster": "lab", "id": "b", "nonce": b"short", "auth": False},
    {"t": "hello", "v": wire.PROTOCOL_VERSION, "cluster": "lab", "id": 5, "nonce": b"\0" * 32, "auth": False},
    {"t": "hello", "v": wire.PROTOCOL_VERSION, "cluster": "lab", "id": "b" * 100, "nonce": b"\0" * 32, "auth": False},
    {"t": "proof", "mac": b""},
    {"t": "welcome"},
    {"t": "chunk"},
])
def test_malformed_or_out_of_order(hello):
    a = hs("a")
    a.start(dialer=False)
    with pytest.raises(HandshakeError):
        a.receive(hello)


def test_other_version_in_hello():
    a = hs("a")
    a.start(dialer=True)
    with pytest.raises(HandshakeError, match="version") as err:
        a.receive({"t": "hello", "v": 99, "cluster": "lab", "id": "b", "nonce": b"\0" * 32,
                   "auth": False, "info": {}})
    assert err.value.reason == auth.REASON_VERSION and not err.value.by_peer


def test_reject_reason_is_sanitised():
    a = hs("a")
    a.start(dialer=True)
    with pytest.raises(HandshakeError) as err:
        a.receive({"t": "reject", "reason": "evil\x1b[2J" + "x" * 500})
    assert "\x1b" not in str(err.value) and len(str(err.value)) < 260
    assert err.value.by_peer and err.value.reason.startswith("evil?[2J")
    assert str(err.value) == f"refused by peer: {err.value.reason}"


def test_secret_from_env_and_empty():
    assert auth.secret_from(None, env={"P2PTRAIN_SECRET": "abc"}) == b"abc"
    assert auth.secret_from(None, env={}) is None
    assert auth.secret_from("x") == b"x"
    with pytest.raises(ConfigError):
        auth.secret_from(b"")
    assert auth.secret_from(bytearray(b"k")) == b"k"
    for bad in (123, ["a"]):  # (123 became 123 zero bytes: a secret nobody chose)
        with pytest.raises(ConfigError, match="must be a str or bytes"):
            auth.secret_from(bad)


def test_beacon_tags_differ_from_handshake_keys():
    tag = auth.beacon_tag(b"k", b"body")
    assert auth.beacon_tag_ok(b"k", b"body", tag)
    assert not auth.beacon_tag_ok(b"other", b"body", tag)
    assert auth.derive_key(b"k", "beacon") != auth.derive_key(b"k", "handshake")
