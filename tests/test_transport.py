"""Links over loopback: frames in both directions, and every kind of bad peer against a
live listener, which logs one line, closes that connection and keeps serving good peers."""

import asyncio
import logging
import os
import sys

import numpy as np
import pytest

from helpers import until

from p2ptrain.net import auth, transport, wire
from p2ptrain.errors import HandshakeError, LinkError

pytestmark = pytest.mark.timeout(30)


def hs(pid, secret=None, cluster="lab"):
    return auth.Handshake(cluster=cluster, peer_id=pid, secret=secret, info={"id": pid})


class Server:
    def __init__(self, secret=None, timeout=2.0):
        self.secret, self.timeout = secret, timeout
        self.links: list[transport.Link] = []

    async def __aenter__(self):
        n = iter(range(1000))
        self.listener = await transport.serve("127.0.0.1", 0, lambda: hs(f"srv{next(n)}", self.secret),
                                              self.links.append, timeout=self.timeout)
        self.port = self.listener.port
        return self

    async def __aexit__(self, *a):
        for link in self.links:
            link.close()
        await self.listener.close()

    async def good_client(self, pid="good"):
        link = await transport.open_link("127.0.0.1", self.port, hs(pid, self.secret))
        for _ in range(100):
            if len(self.links) and self.links[-1].peer.peer_id == pid:
                break
            await asyncio.sleep(0.01)
        return link, self.links[-1]


async def test_frames_both_ways_with_payloads():
    async with Server(secret=b"k") as srv:
        client, server_side = await srv.good_client()
        data = np.arange(1 << 20, dtype=np.float32)
        await client.send({"t": "chunk", "i": 1}, [memoryview(data)])
        await server_side.send({"t": "chunk", "i": 2}, [b"abc"])
        got = await server_side.recv(timeout=5)
        assert got.header["i"] == 1 and np.array_equal(np.frombuffer(got.payload, np.float32), data)
        back = await client.recv(timeout=5)
        assert bytes(back.payload) == b"abc"
        assert client.peer.peer_id.startswith("srv") and server_side.peer.info == {"id": "good"}
        client.close()


async def test_allocator_receives_payload_in_place():
    async with Server() as srv:
        client, server_side = await srv.good_client()
        target = bytearray(1 << 16)
        server_side.set_allocator(lambda h, n: memoryview(target)[:n])
        await client.send({"t": "chunk"}, [os.urandom(1 << 16)])
        frame = await server_side.recv(timeout=5)
        assert frame.payload.obj is target
        client.close()


async def raw(port, data, then_wait=1.0):
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    await writer.drain()
    try:
        got = await asyncio.wait_for(reader.read(), then_wait)  # read to EOF: the server closes
    except asyncio.TimeoutError:
        got = None
    except ConnectionResetError:  # closed with our unread bytes in its buffer: a reset
        got = b""
    writer.close()
    return got


def hello_bytes(**kw):
    h = {"t": "hello", "v": wire.PROTOCOL_VERSION, "cluster": "lab", "id": "x", "nonce": b"\0" * 32,
         "auth": False, "info": {}}
    h.update(kw)
    return wire.frame_bytes(h)


BAD = {
    "random bytes": os.urandom(64),
    "http request": b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
    "wrong magic": wire.PREFIX.pack(b"XXXX", 1, 0, 4, 0) + b"abcd",
    "wrong version": wire.PREFIX.pack(wire.MAGIC, 99, 0, 4, 0) + b"abcd",
    "huge payload claim": wire.PREFIX.pack(wire.MAGIC, wire.PROTOCOL_VERSION, 0, 4, 1 << 60) + b"abcd",
    "wrong cluster": hello_bytes(cluster="other"),
    "garbage header": wire.PREFIX.pack(wire.MAGIC, wire.PROTOCOL_VERSION, 0, 3, 0) + b"\xc1\xc1\xc1",
}


@pytest.mark.parametrize("what", sorted(BAD))
async def test_bad_peer_is_refused_and_listener_keeps_serving(what, caplog):
    caplog.set_level(logging.WARNING, "p2ptrain.net.transport")
    async with Server() as srv:
        got = await raw(srv.port, BAD[what])
        assert got is not None, "server must close the connection"
        refusals = [r.message for r in caplog.records if "refused connection" in r.message]
        assert len(refusals) == 1, refusals  # one clear line per bad peer
        client, _ = await srv.good_client()
        client.close()


async def test_wrong_version_gets_a_reason_naming_versions(caplog):
    caplog.set_level(logging.WARNING, "p2ptrain.net.transport")
    async with Server() as srv:
        got = await raw(srv.port, wire.PREFIX.pack(wire.MAGIC, 99, 0, 4, 0) + b"abcd")
        # the reply is a p2ptrain frame (our version) with the fixed reason
        reasons = []
        dec = wire.FrameDecoder()
        for f in dec.feed(got):  # the server's hello, then its reject
            reasons.append(f.header.get("reason"))
        assert auth.REASON_VERSION in reasons
        assert any("version 99" in r.message and f"speaks {wire.PROTOCOL_VERSION}" in r.message
                   for r in caplog.records)


async def test_a_malformed_frame_gets_the_malformed_reason(caplog):
    async with Server() as srv:
        got = await raw(srv.port, wire.PREFIX.pack(wire.MAGIC, wire.PROTOCOL_VERSION, 1, 4, 0) + b"abcd")
        reasons = [f.header.get("reason") for f in wire.FrameDecoder().feed(got)]
        assert reasons[-1] == auth.REASON_MALFORMED


async def test_wrong_secret_is_refused_both_sides(caplog):
    caplog.set_level(logging.WARNING, "p2ptrain.net.transport")
    async with Server(secret=b"right") as srv:
        with pytest.raises(HandshakeError, match="wrong secret"):
            await transport.open_link("127.0.0.1", srv.port, hs("intruder", b"wrong"))
        await asyncio.sleep(0.1)
        assert any("wrong secret" in r.message for r in caplog.records)
        assert srv.links == []
        client, _ = await srv.good_client()
        client.close()


async def test_silent_peer_times_out(caplog):
    caplog.set_level(logging.WARNING, "p2ptrain.net.transport")
    async with Server(timeout=0.3) as srv:
        reader, writer = await asyncio.open_connection("127.0.0.1", srv.port)
        data = await asyncio.wait_for(reader.read(), 5)  # the server gives up and closes
        writer.close()
        assert wire.MAGIC in data  # it had sent its hello
        assert any("handshake not completed" in r.message for r in caplog.records)
        client, _ = await srv.good_client()
        client.close()


async def test_truncated_frame_then_close_is_a_clear_link_error():
    async with Server() as srv:
        client, server_side = await srv.good_client()
        # write half a frame through the raw transport, then vanish
        half = wire.frame_bytes({"t": "chunk"}, b"x" * 1000)[:500]
        client._transport.write(half)
        await asyncio.sleep(0.05)
        client._transport.abort()
        client._close_direct()
        with pytest.raises(LinkError, match="middle of a frame"):
            await server_side.recv(timeout=5)


async def test_recv_timeout_is_a_link_error():
    async with Server() as srv:
        client, server_side = await srv.good_client()
        with pytest.raises(LinkError, match="nothing received"):
            await server_side.recv(timeout=0.1)
        client.close()


async def test_connect_refused_is_a_link_error():
    async with Server() as srv:
        port = srv.port
    with pytest.raises(LinkError, match="cannot connect"):
        await transport.open_link("127.0.0.1", port, hs("a"), timeout=2)


async def test_peer_close_wakes_receiver():
    async with Server() as srv:
        client, server_side = await srv.good_client()
        waiter = asyncio.ensure_future(server_side.recv(timeout=5))
        await asyncio.sleep(0.05)
        client.close()
        with pytest.raises(LinkError, match="closed by peer"):
            await waiter


async def test_loopback_links_get_a_small_send_buffer():
    import socket

    async with Server() as srv:
        client, server_side = await srv.good_client()
        for link in (client, server_side):
            sock = link._transport.get_extra_info("socket")
            # Linux doubles what it is given; autotuning would have grown it to MiBs
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) in (
                transport.LOOPBACK_SNDBUF, 2 * transport.LOOPBACK_SNDBUF)
        client.close()
    with socket.socket() as unconnected:
        assert not transport._is_loopback(unconnected)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="queued_bytes reads Linux's SIOCOUTQ; None elsewhere")
async def test_queued_bytes_tell_how_far_the_link_is_behind():
    async with Server() as srv:
        client, server_side = await srv.good_client()
        await until(lambda: client.queued_bytes() == 0)  # (the handshake acknowledged)
        server_side._transport.pause_reading()  # a peer that does not keep up
        data = np.ones(1 << 20, np.float32)
        sending = asyncio.ensure_future(client.send({"t": "chunk"}, [memoryview(data)], timeout=5))
        await until(lambda: (client.queued_bytes() or 0) > 100_000)
        server_side._transport.resume_reading()
        await sending
        got = await server_side.recv(timeout=5)
        assert got.payload.nbytes == data.nbytes
        await until(lambda: client.queued_bytes() == 0)  # all of it acknowledged
        client.close()
        assert client.queued_bytes() is None  # (closed: the OS has nothing to tell)
