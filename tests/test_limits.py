"""What an admitted peer (one that knows the secret) can make another hold: a peer that stops
reading (SIGSTOPped, or hostile) costs its sender one frame at most beside the kernel's buffers,
a few thousand posted messages at most, and its link once a send's timeout passes; a link that
brings nothing at all is closed after ``mesh.IDLE_TIMEOUT``. Meanwhile the others go on. The
insider here is raw bytes over a socket: it passes the handshake, then does what it likes."""

from __future__ import annotations

import asyncio
import logging
import socket

import pytest

from helpers import until

from p2ptrain.errors import ClosedError, LinkError
from p2ptrain.net import admission, auth, mesh, transport, wire
from p2ptrain.net.mesh import Mesh

pytestmark = pytest.mark.timeout(60)

SECRET = b"s"


class Member:
    def __init__(self, pid):
        self.heard = []
        self.lost = []
        self.mesh = Mesh(cluster="lab", peer_id=pid, secret=SECRET, host="127.0.0.1",
                         on_message=lambda p, h: self.heard.append((p, h.get("i"))),
                         on_lost=lambda p, why: self.lost.append((p, why)))


async def linked_pair():
    """Two honest members linked to each other."""
    a, b = Member("a"), Member("b")
    for m in (a, b):
        await m.mesh.start()
    b.mesh.propose("127.0.0.1", a.mesh.port)
    await until(lambda: a.mesh.peers == ["b"] and b.mesh.peers == ["a"])
    return a, b


async def insider(port: int, pid: str = "h"):
    """A raw connection that passes the handshake with the secret (as the dialer), then reads
    nothing more: its socket's receive buffer is small, so the sender's fill up soon."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    hs = auth.Handshake(cluster="lab", peer_id=pid, secret=SECRET, info={})
    for h in hs.start(dialer=True):
        writer.write(wire.frame_bytes(h))
    decoder = wire.FrameDecoder()
    while not hs.done:
        data = await asyncio.wait_for(reader.read(4096), 5)
        assert data, "the listener closed the insider's connection during the handshake"
        for frame in decoder.feed(data):
            if not hs.done:
                for h in hs.receive(frame.header):
                    writer.write(wire.frame_bytes(h))
    return reader, writer


async def close_all(*members):
    for m in members:
        await m.mesh.close()


async def talk(a, b, n, every=0.05):
    """a and b post numbered messages to each other while the insider stalls a."""
    for i in range(n):
        a.mesh.post("b", {"t": "note", "i": i})
        b.mesh.post("a", {"t": "note", "i": i})
        await asyncio.sleep(every)


@pytest.mark.parametrize("path", ["sendmsg", "transport"])
async def test_a_peer_that_stops_reading_costs_one_frame_at_most_and_its_link_at_the_timeout(monkeypatch, path):
    """Sends to a peer that reads nothing, each cancelled while it waits (a round aborted while
    its chunk was on the way) and then one that is not: the transport's write buffer never holds
    more than one frame (through the transport, a send wrote its frame whatever the one before had
    left: one more frame held per cancelled send, 40 MiB here), the last send fails at its timeout
    and the link is dropped; the other member hears everything meanwhile."""
    if path == "transport":  # (the loops without ``add_writer``: Windows' proactor)
        monkeypatch.setattr(transport, "direct_sender", lambda t: None)
    a, b = await linked_pair()
    try:
        reader, writer = await insider(a.mesh.port)
        await until(lambda: "h" in a.mesh.peers)
        link = a.mesh._links["h"]
        frame = 1 << 20
        payload = bytearray(frame)
        chatter = asyncio.ensure_future(talk(a, b, 40))
        peak = 0
        for _ in range(40):
            try:
                await asyncio.wait_for(a.mesh.send("h", {"t": wire.STATE, "k": "x"}, [payload], timeout=3.0), 0.05)
            except asyncio.TimeoutError:
                pass
            peak = max(peak, link._transport.get_write_buffer_size())
        bound = frame + 64  # (one frame: its payload and its header)
        print(f"\n{path}: the most the transport held for a peer that stopped reading: {peak} bytes (bound {bound})")
        assert peak <= bound
        began = asyncio.get_running_loop().time()
        with pytest.raises(LinkError):
            await a.mesh.send("h", {"t": wire.STATE, "k": "x"}, [payload], timeout=1.0)
        # (it waits behind the sends queued ahead of it, each within its own timeout: a keepalive's is longest)
        assert asyncio.get_running_loop().time() - began < mesh.PING_TIMEOUT + 2.0
        await until(lambda: "h" not in a.mesh.peers, timeout=3)
        assert [p for p, _ in a.lost] == ["h"]
        await chatter
        await until(lambda: len(a.heard) == 40 and len(b.heard) == 40, timeout=10)
        assert [i for _, i in b.heard] == list(range(40)) and a.mesh.peers == ["b"]
        writer.close()
    finally:
        await close_all(a, b)


async def test_messages_posted_to_a_peer_that_stopped_reading_pile_up_to_a_limit_then_its_link_closes(caplog):
    """Round messages are posted (``Mesh.post``: never waits); behind a send that a stopped
    reader holds up they queued without end. At ``MAX_POSTED`` the link is closed, in one line."""
    caplog.set_level(logging.WARNING, "p2ptrain")
    a, b = await linked_pair()
    try:
        reader, writer = await insider(a.mesh.port)
        await until(lambda: "h" in a.mesh.peers)
        stuck = asyncio.ensure_future(a.mesh.send("h", {"t": wire.STATE, "k": "x"}, [bytearray(8 << 20)],
                                                  timeout=20.0))
        await asyncio.sleep(0.3)  # (the kernel's buffers are full: the send waits)
        assert not stuck.done()
        for i in range(mesh.MAX_POSTED + 1):
            a.mesh.post("h", {"t": "note", "i": i})
            a.mesh.post("b", {"t": "note", "i": i})
            if i % 256 == 0:
                await asyncio.sleep(0)
        assert len(a.mesh._outbox.get("h", ())) <= mesh.MAX_POSTED
        await until(lambda: "h" not in a.mesh.peers, timeout=2)
        with pytest.raises(ClosedError):  # (the send held up ends with its link)
            await asyncio.wait_for(stuck, 2)
        lines = [r.getMessage() for r in caplog.records if "closing the link to h" in r.getMessage()]
        assert len(lines) == 1 and "stopped reading" in lines[0], lines
        await until(lambda: len(b.heard) == mesh.MAX_POSTED + 1, timeout=20)
        writer.close()
    finally:
        await close_all(a, b)


async def test_an_admitted_link_that_sends_nothing_is_closed_after_the_idle_timeout(monkeypatch, caplog):
    """An insider that passes the handshake and then sends nothing held its connection (and a
    place among the peers) for as long as it liked. Closed after ``IDLE_TIMEOUT`` in one line
    naming it; a peer that pings, or one whose frame is still coming byte by byte, stays."""
    caplog.set_level(logging.WARNING, "p2ptrain")
    monkeypatch.setattr(mesh, "IDLE_TIMEOUT", 1.0)
    monkeypatch.setattr(mesh, "KEEPALIVE", 0.2)
    a, b = await linked_pair()
    try:
        silent_reader, silent = await insider(a.mesh.port, "h")
        slow_reader, slow = await insider(a.mesh.port, "s")
        await until(lambda: {"h", "s"} <= set(a.mesh.peers))
        began, took = asyncio.get_running_loop().time(), None
        data = wire.frame_bytes({"t": wire.STATE, "k": "x"}, b"z" * 40)
        for i in range(len(data)):  # (one byte every 0.05 s: 2.5 s for the frame, 2.5 idle timeouts)
            slow.write(data[i:i + 1])
            await asyncio.sleep(0.05)
            if took is None and "h" not in a.mesh.peers:
                took = asyncio.get_running_loop().time() - began
        assert took is not None and 0.9 < took < 2.5, took
        assert "s" in a.mesh.peers and "b" in a.mesh.peers
        lines = [r.getMessage() for r in caplog.records if "sent nothing" in r.getMessage()]
        assert len(lines) == 1 and "closing the link to h " in lines[0], lines
        for w in (silent, slow):
            w.close()
    finally:
        await close_all(a, b)


async def test_fuzzed_handshakes_on_a_live_listener_leave_it_up_admitting_the_next_honest_peer(monkeypatch):
    """300 connections each send a dialer's handshake (hello, proof, welcome) mutated as bytes
    (``bench/fuzz.py``'s edits, seeded), or random bytes, then end: the listener admits none of
    them, gives none a payload buffer (``wire.PENDING_MAX_PAYLOAD_BYTES``), answers each with a
    refusal or a close, and then admits an honest peer."""
    import random

    import fuzz

    allocated = []
    real_init = transport.Link.__init__

    def spied(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        self._decoder.allocate = lambda header, size: allocated.append(size) or memoryview(bytearray(size))

    monkeypatch.setattr(transport.Link, "__init__", spied)
    a, b = Member("a"), Member("b")
    a.mesh.handshake_timeout = 1.0  # (one that announces a payload is held unread until then)
    await a.mesh.start()
    await b.mesh.start()
    try:
        hs = auth.Handshake(cluster="lab", peer_id="f", secret=SECRET, info={"port": 1})
        honest = [*hs.start(dialer=True), {"t": wire.PROOF, "mac": b"m" * 32}, {"t": wire.WELCOME}]
        sample = b"".join(wire.frame_bytes(h) for h in honest)
        rng = random.Random(65)
        inputs = [rng.randbytes(rng.randrange(1, 200)) if i % 16 == 0 else fuzz.mutate(rng, sample, [sample])
                  for i in range(300)]

        async def send(data):
            reader, writer = await asyncio.open_connection("127.0.0.1", a.mesh.port)
            writer.write(data)
            writer.write_eof()
            await asyncio.wait_for(reader.read(), 3)  # (until it closes: at once, or at the handshake's timeout)
            writer.close()

        for i in range(0, len(inputs), admission.MAX_PENDING_PER_SOURCE):
            await asyncio.gather(*[send(data) for data in inputs[i:i + admission.MAX_PENDING_PER_SOURCE]])
        assert a.mesh.peers == [] and allocated == []
        b.mesh.propose("127.0.0.1", a.mesh.port)
        await until(lambda: a.mesh.peers == ["b"] and b.mesh.peers == ["a"], timeout=10)
    finally:
        await close_all(a, b)


def blocking_insider(port: int, cluster: str, secret: bytes, pid: str = "h") -> socket.socket:
    """``insider`` with a blocking socket, for a test whose peers run on threads of their own."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    hs = auth.Handshake(cluster=cluster, peer_id=pid, secret=secret, info={})
    for h in hs.start(dialer=True):
        sock.sendall(wire.frame_bytes(h))
    decoder = wire.FrameDecoder()
    while not hs.done:
        data = sock.recv(4096)
        assert data, "the peer closed the insider's connection during the handshake"
        for frame in decoder.feed(data):
            if not hs.done:
                for h in hs.receive(frame.header):
                    sock.sendall(wire.frame_bytes(h))
    return sock


@pytest.mark.timeout(120)
def test_training_goes_on_beside_an_insider_that_pings_and_never_reads():
    """Two peers train while a third connection, admitted with the secret, pings (so it is not
    idle) and reads nothing: the peer it reached holds one frame at most for it and closes its
    link once the messages posted to it wait too long; both peers reach the last round equal."""
    import threading

    import torch.nn.functional as F
    from test_trainer_staleness import close_all as close_peers, label, make_adam, open_peers, run_threads
    import torch

    peers = open_peers([make_adam] * 2, staleness=0, compression="int8", max_rounds=30)
    stop, held = threading.Event(), []
    sock = blocking_insider(peers[0].port, "default", b"s")

    def ping():
        while not stop.wait(0.5):
            try:
                sock.sendall(wire.frame_bytes({"t": wire.PING, "at": []}))
            except OSError:
                return

    def loop(r):
        g = torch.Generator().manual_seed(100 + r)
        while not peers[r].finished:
            x = torch.randn(32, 16, generator=g)
            F.cross_entropy(peers[r].model(x), label(x)).backward()
            peers[r].step(batch_size=32)
            link = peers[0]._peer.cluster.mesh._links.get("h")
            if r == 0 and link is not None and link._transport is not None:
                held.append(link._transport.get_write_buffer_size())

    pinger = threading.Thread(target=ping)
    pinger.start()
    try:
        run_threads([lambda r=r: loop(r) for r in range(2)])
    finally:
        stop.set()
        pinger.join(5)
        sock.close()
        close_peers(peers)
    assert [p.version for p in peers] == [30, 30]
    for a, b in zip(peers[0].model.parameters(), peers[1].model.parameters()):
        assert torch.equal(a, b)
    print(f"\n{len(held)} looks at the link to the insider: the transport held at most {max(held, default=0)} bytes")
    assert held and max(held) <= 1 << 20  # (one frame at most: round messages are small)
