"""The attacks of issue 59, tried against real meshes over loopback: a third party that relays
one peer's handshake to another, a proof reflected to its maker, frames that announce 1 GiB
before any handshake, 600 idle connections, and a peer of an older protocol version."""

import asyncio
import gc
import logging
import os
import subprocess
import sys

import pytest

from helpers import until

from p2ptrain.net import auth, wire
from p2ptrain.net.mesh import Mesh

pytestmark = pytest.mark.timeout(60)

TIMEOUT = 1.0  # seconds a handshake may take here


class Peer:
    def __init__(self, pid, secret=b"s"):
        self.admitted = []
        self.mesh = Mesh(cluster="lab", peer_id=pid, secret=secret, host="127.0.0.1",
                         on_admitted=lambda p, info: self.admitted.append(p))
        self.mesh.handshake_timeout = TIMEOUT


async def started(*ids):
    peers = [Peer(pid) for pid in ids]
    for p in peers:
        await p.mesh.start()
    return peers


def refusals(caplog, port=None):
    """The WARNING lines of listeners about refused connections (from ``port`` only, if given)."""
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING
            and "refused connection from" in r.getMessage()
            and (port is None or f"127.0.0.1:{port}:" in r.getMessage())]


async def pipe(reader, writer):
    try:
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        writer.close()


async def test_a_relay_between_two_peers_is_refused_and_each_says_so_once(caplog):
    """The relayer dials A and B and passes everything each says to the other: both hellos,
    and whatever answers them. With a listener that proved itself on any hello, each peer's
    proof was exactly what the other expected: both admitted the relayer (issue 59)."""
    caplog.set_level(logging.DEBUG, "p2ptrain")
    a, b = await started("a", "b")
    try:
        ra, wa = await asyncio.open_connection("127.0.0.1", a.mesh.port)
        rb, wb = await asyncio.open_connection("127.0.0.1", b.mesh.port)
        relay_ports = wa.get_extra_info("sockname")[1], wb.get_extra_info("sockname")[1]
        relays = [asyncio.ensure_future(pipe(ra, wb)), asyncio.ensure_future(pipe(rb, wa))]
        await asyncio.wait(relays, timeout=TIMEOUT + 3)  # (both peers close at their timeout)
        assert a.admitted == [] and b.admitted == [] and a.mesh.peers == [] and b.mesh.peers == []
        assert all(r.done() for r in relays), "both peers must close the relayed connections"
        for port in relay_ports:
            await until(lambda: refusals(caplog, port), timeout=3)
            lines = refusals(caplog, port)
            # (its own timeout, or the other's refusal for it, relayed, where that came first: both end at TIMEOUT)
            assert len(lines) == 1 and ("handshake not completed" in lines[0]
                                        or auth.REASON_TIMEOUT in lines[0]), lines
    finally:
        for p in (a, b):
            await p.mesh.close()


async def read_frames(reader, want, timeout=3.0):
    dec, got = wire.FrameDecoder(), []
    async def loop():
        while len(got) < want and (data := await reader.read(4096)):
            got.extend(dec.feed(data))
    await asyncio.wait_for(loop(), timeout)
    return got


def hello(pid, v=wire.PROTOCOL_VERSION):
    return wire.frame_bytes({"t": wire.HELLO, "v": v, "cluster": "lab", "id": pid, "nonce": os.urandom(32),
                             "auth": True, "info": {}})


async def test_a_proof_reflected_to_the_peer_that_made_it_is_refused(caplog):
    """A dials a stranger, which sends A's own proof back: refused, said once. Dialed by the
    stranger, A sends no proof at all before the stranger has proven itself."""
    caplog.set_level(logging.WARNING, "p2ptrain")
    (a,) = await started("a")
    answers = []

    async def stranger(reader, writer):
        (their_hello,) = await read_frames(reader, 1)
        writer.write(hello("b"))
        (proof,) = await read_frames(reader, 1)
        writer.write(wire.frame_bytes(proof.header))  # its own proof, back
        answers.extend(await read_frames(reader, 1))
        writer.close()

    server = await asyncio.start_server(stranger, "127.0.0.1", 0)
    try:
        a.mesh.propose("127.0.0.1", server.sockets[0].getsockname()[1])
        await until(lambda: answers, timeout=5)
        assert answers[0].header == {"t": wire.REJECT, "reason": auth.REASON_SECRET} and a.admitted == []
        lines = [r.getMessage() for r in caplog.records if "refused this peer" in r.getMessage()]
        assert len(lines) == 1 and "wrong secret" in lines[0], lines

        reader, writer = await asyncio.open_connection("127.0.0.1", a.mesh.port)
        writer.write(hello("b"))
        got = await read_frames(reader, 2, timeout=TIMEOUT + 2)  # its hello, then its refusal at the timeout
        writer.close()
        assert [f.type for f in got] == [wire.HELLO, wire.REJECT], [f.header for f in got]
        assert got[1].header["reason"] == auth.REASON_TIMEOUT
    finally:
        server.close()
        await a.mesh.close()


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


async def test_frames_announcing_a_gigabyte_before_the_handshake_allocate_nothing(caplog):
    """Three connections each sent the 16-byte prefix and header of a frame announcing 1 GiB:
    the peer allocated 3 GiB before anyone was authenticated (issue 59)."""
    caplog.set_level(logging.WARNING, "p2ptrain")
    (a,) = await started("a")
    try:
        gc.collect()
        before, peak = rss_bytes(), 0
        conns = [await asyncio.open_connection("127.0.0.1", a.mesh.port) for _ in range(3)]
        for _, writer in conns:
            writer.write(wire.pack_header({"t": wire.CHUNK}, 1 << 30))
        for _ in range(10):
            await asyncio.sleep(0.05)
            peak = max(peak, rss_bytes())
        print(f"\nRSS before {before / 2**20:.1f} MiB, with three 1 GiB announcements {peak / 2**20:.1f} MiB "
              f"(+{(peak - before) / 2**20:.1f} MiB)")
        assert peak - before < 16 << 20
        for reader, writer in conns:  # closed at the handshake's timeout
            await asyncio.wait_for(reader.read(), TIMEOUT + 3)
            writer.close()
        assert a.admitted == []
    finally:
        await a.mesh.close()


IDLE_CLIENTS = r"""
import socket, sys
port, n = int(sys.argv[1]), int(sys.argv[2])
held = []
for _ in range(n):
    try:
        held.append(socket.create_connection(("127.0.0.1", port), timeout=5))
    except OSError:
        pass
print(len(held), flush=True)
sys.stdin.read()
"""


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.timeout(90)
async def test_600_idle_connections_neither_take_every_descriptor_nor_write_600_lines(caplog):
    """600 idle connections used every file descriptor of a peer (limit 1024) and wrote one
    WARNING each (issue 59). The connections come from another process: only the peer's count."""
    caplog.set_level(logging.WARNING, "p2ptrain")
    a, b = await started("a", "b")
    clients = None
    try:
        before = open_fds()
        clients = subprocess.Popen([sys.executable, "-c", IDLE_CLIENTS, str(a.mesh.port), "600"],
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = await asyncio.wait_for(asyncio.to_thread(clients.stdout.readline), 60)
        peak = open_fds()
        for _ in range(20):
            await asyncio.sleep(0.05)
            peak = max(peak, open_fds())
        print(f"\n{line.strip()} idle connections held; the peer's descriptors {before} -> at most {peak}")
        assert int(line) == 600
        # (at most 8 handshakes pending from one address, and the ones being closed: asyncio accepts up
        # to create_server's backlog, 100, in one turn of its loop before the admission closes them)
        assert peak - before < 8 + 100 + 32
        clients.stdin.close()
        clients.wait(10)
        await asyncio.sleep(TIMEOUT + 0.5)
        lines = refusals(caplog)
        assert 1 <= len(lines) <= 2, lines[:5]  # (one line a minute per address)
        b.mesh.propose("127.0.0.1", a.mesh.port)  # (and a real peer is still let in)
        await until(lambda: a.admitted == ["b"], timeout=10)
    finally:
        if clients is not None and clients.poll() is None:
            clients.kill()
            clients.wait()
        for p in (a, b):
            await p.mesh.close()


async def test_a_peer_of_the_older_protocol_is_refused_in_one_line_on_this_side_either_way(caplog):
    """Dialed by an older peer, or dialing one: a REJECT naming the version goes out (the older
    peer's decoder reads the version from the frame prefix and says so in its own one line)."""
    caplog.set_level(logging.WARNING, "p2ptrain")
    (a,) = await started("a")
    old = wire.PROTOCOL_VERSION - 1
    old_frame = wire.PREFIX.pack(wire.MAGIC, old, 0, 4, 0) + b"abcd"

    async def old_listener(reader, writer):
        writer.write(old_frame)
        await reader.read()
        writer.close()

    server = await asyncio.start_server(old_listener, "127.0.0.1", 0)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", a.mesh.port)
        writer.write(old_frame)
        got = await read_frames(reader, 2)
        writer.close()
        assert got[-1].header == {"t": wire.REJECT, "reason": auth.REASON_VERSION}
        await until(lambda: refusals(caplog))
        assert f"version {old}" in refusals(caplog)[0]
        a.mesh.propose("127.0.0.1", server.sockets[0].getsockname()[1])
        await until(lambda: [r for r in caplog.records if "refused this peer" in r.getMessage()])
        lines = [r.getMessage() for r in caplog.records if "refused this peer" in r.getMessage()]
        assert len(lines) == 1 and auth.REASON_VERSION in lines[0] and "same p2ptrain version" in lines[0]
    finally:
        server.close()
        await a.mesh.close()
