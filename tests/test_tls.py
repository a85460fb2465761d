"""Mutual TLS on peer links (``net.tls``) and ``tls-init``, on loopback: peers with certificates of
one CA train over encrypted links to identical parameters; another CA's certificate, a peer
without TLS and a wrong secret inside TLS are each refused with one line at both ends, in bounded
time, while the others go on; bad option files are one line each."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import ssl
import subprocess
import sys
import time

import pytest
import torch
import torch.nn.functional as F
from helpers import async_peers_on_loopback, finish, ports, reaped, run_cli

from p2ptrain.errors import ConfigError, HandshakeError, LinkError
from p2ptrain.net import auth, tls, transport, wire
from p2ptrain.net.mesh import Mesh
from p2ptrain.trainer.peer import AsyncPeer

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(shutil.which("openssl") is None, reason="tls-init needs the openssl command")]

HOSTS = ("mac", "pc", "box")


def files(folder, host):
    """``(cert, key, ca)`` that tls-init made for ``host`` in ``folder``."""
    return (str(folder / host / f"{host}.pem"), str(folder / host / f"{host}.key"), str(folder / host / "ca.pem"))


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    """Two CAs made by ``python -m p2ptrain tls-init`` as a user runs it: ``home`` for the cluster
    (mac, pc, box), ``other`` for a stranger's machine."""
    root = tmp_path_factory.mktemp("tls")
    for name, hosts in (("home", ",".join(HOSTS)), ("other", "stranger")):
        done = subprocess.run([sys.executable, "-m", "p2ptrain", "tls-init", str(root / name), "--hosts", hosts],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
    return root


def mesh(pid, contexts, secret=b"s", timeout=3.0):
    return Mesh(cluster="lab", peer_id=pid, secret=secret, host="127.0.0.1", tls=contexts, handshake_timeout=timeout)


@contextlib.asynccontextmanager
async def dialed(dialer: Mesh, listener: Mesh, wait=2.0):
    """Both meshes started, ``dialer`` dialing ``listener`` until linked or refused (at most
    ``wait`` s, then the other end's line); yields the seconds that took; both closed on leaving."""
    try:
        await dialer.start()
        await listener.start()
        start = time.monotonic()
        dialer.propose("127.0.0.1", listener.port)
        while time.monotonic() < start + wait and not (dialer.peers and listener.peers) and not dialer.refused:
            await asyncio.sleep(0.02)
        took = time.monotonic() - start
        await asyncio.sleep(0.2)  # (the other end's line)
        yield took
    finally:
        await dialer.close()
        await listener.close()


def lines(caplog, start: float) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and r.created >= start]


# -- the protocol's rule, no I/O ------------------------------------------------------------------------------------

def test_the_first_frame_with_tls_is_starttls_and_a_hello_there_is_a_mismatch():
    auth.check_starttls({"t": wire.STARTTLS})
    with pytest.raises(HandshakeError) as hello:
        auth.check_starttls({"t": wire.HELLO})
    with pytest.raises(HandshakeError) as rejected:
        auth.check_starttls({"t": wire.REJECT, "reason": auth.REASON_TLS_MODE})
    with pytest.raises(HandshakeError) as other:
        auth.check_starttls({"t": wire.CHUNK})
    assert (hello.value.reason, hello.value.by_peer) == (auth.REASON_TLS_MODE, False)
    assert (rejected.value.reason, rejected.value.by_peer) == (auth.REASON_TLS_MODE, True)
    assert other.value.reason == auth.REASON_MALFORMED
    plain = auth.Handshake(cluster="lab", peer_id="b", secret=None)  # (a listener without TLS options)
    plain.start(dialer=False)
    with pytest.raises(HandshakeError) as asked:
        plain.receive({"t": wire.STARTTLS})
    assert asked.value.reason == auth.REASON_TLS_MODE and auth.advice(auth.REASON_TLS_MODE)


def ssl_error(reason: str, kind=ssl.SSLError) -> ssl.SSLError:
    exc = kind(1, f"[SSL: {reason}] ...")
    exc.reason = reason
    return exc


def test_tls_errors_say_whose_check_failed():
    mine = tls.failure(ssl_error("CERTIFICATE_VERIFY_FAILED", ssl.SSLCertVerificationError))
    theirs = tls.failure(ssl_error("TLSV1_ALERT_UNKNOWN_CA"))
    expired = tls.failure(ssl_error("SSLV3_ALERT_CERTIFICATE_EXPIRED"))
    other = tls.failure(ssl_error("WRONG_VERSION_NUMBER"))
    assert (mine.reason, mine.by_peer) == (auth.REASON_TLS_CERT, False)
    assert (theirs.reason, theirs.by_peer) == (expired.reason, expired.by_peer) == (auth.REASON_TLS_CERT_REFUSED, True)
    assert other.reason == auth.REASON_TLS_FAILED
    lost = LinkError("closed by peer")
    lost.__cause__ = ssl_error("TLSV13_ALERT_CERTIFICATE_REQUIRED")  # (a link lost to an alert, as transport keeps it)
    assert tls.failure(lost).reason == auth.REASON_TLS_CERT_REFUSED
    assert tls.failure(LinkError("closed by peer")) is None
    assert all(auth.advice(r) for r in (auth.REASON_TLS_CERT, auth.REASON_TLS_CERT_REFUSED, auth.REASON_TLS_CLOSED))


# -- links ----------------------------------------------------------------------------------------------------------

async def test_links_with_tls_carry_frames_encrypted_and_the_secret_still_decides(certs):
    """A relay between two peers sees two plaintext STARTTLS frames and then nothing it can read:
    not the cluster's name, not the peers' ids, not a frame's header or payload."""
    seen = bytearray()

    async def relay(reader, writer):
        up_r, up_w = await asyncio.open_connection("127.0.0.1", b.port)

        async def pump(src, dst):
            try:
                while data := await src.read(1 << 16):
                    seen.extend(data)
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, asyncio.CancelledError):
                pass
            finally:
                dst.close()
        await asyncio.gather(pump(reader, up_w), pump(up_r, writer))

    a = mesh("peer-a", tls.load(*files(certs / "home", "mac")))
    b = mesh("peer-b", tls.load(*files(certs / "home", "pc")))
    got = []
    b._on_state = lambda p, frame: got.append(bytes(frame.payload))
    server = await asyncio.start_server(relay, "127.0.0.1", 0)
    try:
        await a.start()
        await b.start()
        a.propose("127.0.0.1", server.sockets[0].getsockname()[1])
        while not (a.peers and b.peers):
            await asyncio.sleep(0.02)
        link = a._links["peer-b"]
        assert link._transport.get_extra_info("ssl_object").version() == "TLSv1.3"
        await a.send("peer-b", {"t": wire.STATE, "what": "secret-header"}, [b"secret-payload" * 100])
        while not got:
            await asyncio.sleep(0.02)
        assert got == [b"secret-payload" * 100]
    finally:
        await a.close()
        await b.close()
        server.close()
    assert seen.count(wire.MAGIC) == 2  # the two STARTTLS frames, and no frame after them
    for plain in (b"lab", b"peer-a", b"peer-b", b"secret-header", b"secret-payload", wire.HELLO.encode()):
        assert plain not in seen


async def test_a_tls_links_send_returns_once_its_frame_is_all_in_the_kernel(certs):
    """As on a plain link: a peer that exits right after its last send must lose none of it (its
    TLS layer had passed a frame on while the TCP transport still held part of it, and a neighbour
    read 'closed in the middle of a frame' when the sender's process ended)."""
    got = asyncio.Queue()
    listener = await transport.serve("127.0.0.1", 0, lambda: auth.Handshake(cluster="lab", peer_id="b", secret=b"s"),
                                     got.put, tls=tls.load(*files(certs / "home", "pc")))
    a = await transport.open_link("127.0.0.1", listener.port, auth.Handshake(cluster="lab", peer_id="a", secret=b"s"),
                                  tls=tls.load(*files(certs / "home", "mac")))
    b = await got.get()
    payload = bytes(1 << 20)  # (more than the kernel takes at once: a loopback link's send buffer)
    held = []

    async def read():
        for _ in range(16):
            await b.recv(timeout=10)
    try:
        reader = asyncio.create_task(read())
        for i in range(16):
            await a.send({"t": wire.CHUNK, "i": i}, [payload], timeout=10)
            held.append(a._tcp.get_write_buffer_size())
        await reader
    finally:
        a.close()
        b.close()
        await listener.close()
    assert held == [0] * 16


async def test_a_group_with_tls_sums_over_encrypted_links(certs):
    from p2ptrain.collective.group import Group

    first, second = ports(2)
    addrs = [f"127.0.0.1:{first}", f"127.0.0.1:{second}"]
    groups = [Group(addr, addrs, secret="s", **dict(zip(tls.KEYWORDS, files(certs / "home", host))))
              for addr, host in zip(addrs, HOSTS)]
    tensors = [torch.full((1000,), float(i + 1)) for i in range(2)]
    entered = await asyncio.gather(*(g.__aenter__() for g in groups))
    try:
        assert all(link._transport.get_extra_info("ssl_object") for g in groups for link in g._links.values())
        await asyncio.gather(*(g.allreduce(t) for g, t in zip(entered, tensors)))
    finally:
        for g in groups:
            await g.__aexit__(None, None, None)
    assert all(torch.equal(t, torch.full((1000,), 3.0)) for t in tensors)


async def test_a_wrong_secret_inside_tls_is_still_refused_at_both_ends(certs, caplog):
    a = mesh("a", tls.load(*files(certs / "home", "mac")), secret=b"one")
    b = mesh("b", tls.load(*files(certs / "home", "pc")), secret=b"two")
    start = time.time()
    async with dialed(a, b):
        assert a.peers == b.peers == []
        assert a.refused[("127.0.0.1", b.port)][0] == auth.REASON_SECRET
    said = lines(caplog, start)
    assert len(said) == 2 and all(auth.REASON_SECRET in line for line in said), said


@pytest.mark.parametrize("with_tls", ["dialer", "listener"])
async def test_tls_against_plaintext_is_refused_at_both_ends_in_bounded_time(certs, caplog, with_tls):
    contexts = tls.load(*files(certs / "home", "mac"))
    a = mesh("a", contexts if with_tls == "dialer" else None)
    b = mesh("b", contexts if with_tls == "listener" else None)
    start = time.time()
    async with dialed(a, b) as took:
        assert a.peers == b.peers == []
        assert a.refused[("127.0.0.1", b.port)][0] == auth.REASON_TLS_MODE
    said = lines(caplog, start)
    assert len(said) == 2 and all(auth.REASON_TLS_MODE in line and "--tls-ca" in line for line in said), said
    assert any("refused connection from" in line for line in said)  # (the listener's line, and the dialer's)
    assert took < 2.0  # (well within the handshake's timeout: said, not timed out)


@pytest.mark.parametrize("who", ["dialer", "listener"])
async def test_a_certificate_of_another_ca_is_refused_at_both_ends(certs, caplog, who):
    home, stranger = tls.load(*files(certs / "home", "mac")), tls.load(*files(certs / "other", "stranger"))
    a = mesh("a", stranger if who == "dialer" else home)
    b = mesh("b", stranger if who == "listener" else home)
    start = time.time()
    async with dialed(a, b):
        assert a.peers == b.peers == []
    said = lines(caplog, start)
    assert len(said) == 2, said
    assert any(auth.REASON_TLS_CERT in line for line in said), said  # (the end that checked the certificate)
    assert all("tls-init" in line for line in said), said


async def test_a_peer_with_another_cas_certificate_is_refused_and_the_others_train_on(certs, caplog):
    """Two peers of the home CA train; a stranger (its own CA) dials one of them every few seconds:
    one line there, and the two go on to the same parameters."""
    torch.manual_seed(0)
    made = []
    for _ in range(2):
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 3)
        made.append((model, torch.optim.SGD(model.parameters(), lr=0.1)))
    each = [dict(zip(("tls_cert", "tls_key", "tls_ca"), files(certs / "home", host))) for host in HOSTS[:2]]
    stranger = mesh("stranger", tls.load(*files(certs / "other", "stranger")))
    start = time.time()
    async with async_peers_on_loopback(made, each) as peers:
        try:
            await stranger.start()

            async def train(rank, steps):
                g = torch.Generator().manual_seed(rank)
                for _ in range(steps):
                    x, y = torch.randn(4, 8, generator=g), torch.randint(0, 3, (4,), generator=g)
                    F.cross_entropy(peers[rank].model(x), y).backward()
                    await peers[rank].step(batch_size=4)

            await asyncio.gather(train(0, 3), train(1, 3))
            stranger.propose("127.0.0.1", peers[0].cluster.port)
            await asyncio.gather(train(0, 5), train(1, 5))
            await asyncio.sleep(0.5)
            assert stranger.peers == [] and "stranger" not in peers[0].cluster.mesh.peers
            assert [p.version for p in peers] == [8, 8]
            assert peers[0].param_checksum() == peers[1].param_checksum()
        finally:
            await stranger.close()
    said = [line for line in lines(caplog, start) if "TLS" in line]
    assert len([line for line in said if "refused connection from" in line]) == 1, said  # (one per source a minute)


# -- options --------------------------------------------------------------------------------------------------------

def test_tls_options_are_all_three_or_none_and_each_bad_file_is_one_line(certs, tmp_path):
    cert, key, ca = files(certs / "home", "mac")
    other_cert, other_key, other_ca = files(certs / "other", "stranger")
    assert tls.load(None, None, None) is None
    made = tls.load(cert, key, ca)
    assert made.name == "mac" and made.client.verify_mode == made.server.verify_mode == ssl.CERT_REQUIRED
    assert made.client.minimum_version == ssl.TLSVersion.TLSv1_3 and not made.client.check_hostname
    (tmp_path / "text.pem").write_text("not a certificate\n")
    cases = {
        (cert, None, None): "missing: tls_key, tls_ca",
        (cert, key, str(tmp_path / "nope.pem")): "nope.pem: cannot read it",
        (cert, other_key, ca): "is not the key of tls_cert",
        (other_cert, other_key, ca): "does not verify against tls_ca",
        (str(tmp_path / "text.pem"), key, ca): "not a PEM certificate",
        (cert, cert, ca): "not a PEM private key",
        (cert, key, key): "tls_ca",
    }
    for args, says in cases.items():
        with pytest.raises(ConfigError) as err:
            tls.load(*args)
        assert says in str(err.value) and "\n" not in str(err.value), (args, err.value)
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ConfigError, match="missing: tls_ca"):
        AsyncPeer(model, torch.optim.SGD(model.parameters(), lr=0.1), tls_cert=cert, tls_key=key)


def test_join_refuses_partial_or_bad_tls_options_in_one_line(certs, capsys):
    cert, key, ca = files(certs / "home", "mac")
    for argv, says in ((["--tls-cert", cert], "missing: --tls-key, --tls-ca"),
                       (["--tls-cert", cert, "--tls-key", files(certs / "other", "stranger")[1], "--tls-ca", ca],
                        "is not the key of --tls-cert")):
        code, _, err = run_cli(capsys, "join", "--no-discovery", "--port", "0", *argv)
        assert code == 2 and len(err) == 1 and says in err[0], err


# -- tls-init -------------------------------------------------------------------------------------------------------

def test_tls_init_adds_machines_to_its_ca_and_keeps_the_ca_key_out_of_their_folders(certs, tmp_path, capsys):
    folder = tmp_path / "certs"
    code, out, err = run_cli(capsys, "tls-init", str(folder), "--hosts", "a,b")
    assert code == 0, err
    assert "ca.key" in out and "never ca.key" in out and out.count("--tls-cert") == 2
    code, out, _ = run_cli(capsys, "tls-init", str(folder), "--hosts", "c")  # (a machine added later)
    assert code == 0 and "the existing CA" in out
    for host in "abc":
        assert sorted(os.listdir(folder / host)) == sorted([f"{host}.pem", f"{host}.key", "ca.pem"])
        assert os.stat(folder / host / f"{host}.key").st_mode & 0o077 == 0
        assert tls.load(*files(folder, host)).name == host  # (and it verifies against the CA)
    code, _, err = run_cli(capsys, "tls-init", str(folder), "--hosts", "b")
    assert code == 2 and len(err) == 1 and "already made" in err[0]
    code, _, err = run_cli(capsys, "tls-init", str(folder), "--hosts", "x y,ca")
    assert code == 2 and len(err) == 1 and "'x y', 'ca'" in err[0]


def test_tls_init_without_openssl_says_what_to_do(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    code, _, err = run_cli(capsys, "tls-init", str(tmp_path / "c"), "--hosts", "a")
    assert code == 2 and len(err) == 1 and "needs the openssl command" in err[0]
    assert not (tmp_path / "c").exists()


@pytest.mark.timeout(120)
def test_two_joins_with_tls_train_to_the_same_parameters(certs, tmp_path):
    mine = ports(2)
    procs = []
    with reaped(procs):
        for i, (port, host) in enumerate(zip(mine, HOSTS)):
            cert, key, ca = files(certs / "home", host)
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "p2ptrain", "join", "--peers", f"127.0.0.1:{mine[1 - i]}", "--no-discovery",
                 "--port", str(port), "--min-peers", "2", "--max-rounds", "8", "--task", "synthetic",
                 "--model-size", "100k", "--compression", "int8", "--secret", "s", "--eval-every", "0", "--no-save",
                 "--tls-cert", cert, "--tls-key", key, "--tls-ca", ca, "--metrics", str(tmp_path / f"m{i}.jsonl")],
                env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        outs = finish(procs, timeout=100)
    assert [p.returncode for p in procs] == [0, 0], [e[-1500:] for _, e in outs]
    summaries = [[json.loads(line) for line in open(tmp_path / f"m{i}.jsonl")][-1] for i in range(2)]
    assert all(s["event"] == "summary" and s["rounds"] == 8 for s in summaries), summaries
    assert summaries[0]["param_checksum"] == summaries[1]["param_checksum"]
