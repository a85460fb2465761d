"""Links over loopback: frames in both directions, and every kind of bad peer against a
live listener, which logs one line, closes that connection and keeps serving good peers."""

import asyncio
import logging
import os
import sys

import numpy as np
import pytest

from helpers import ports, until

from p2ptrain.net import auth, sender, transport, wire
from p2ptrain.errors import HandshakeError, LinkError

pytestmark = pytest.mark.timeout(30)


@pytest.fixture(autouse=True, params=["loop", "threads", "transport"])
def io_mode(request, monkeypatch):
    """Every test three times: the socket's I/O on the event loop, on the links' own threads
    (``P2PTRAIN_IO_THREADS=1``: large frames sent by one, everything read by another), and
    through asyncio's transport where the loop cannot wait for writability (Windows' proactor)."""
    if request.param == "transport":
        monkeypatch.setattr(transport, "direct_sender", lambda t: None)
    if request.param == "threads":
        if not hasattr(__import__("socket").socket, "sendmsg"):
            pytest.skip("no sendmsg here: links send through the transport, and read on the loop")
        monkeypatch.setenv(sender.IO_THREADS_ENV, "1")
    else:
        monkeypatch.delenv(sender.IO_THREADS_ENV, raising=False)
    return request.param


def stop_reading(link):
    """A peer that does not keep up: its link reads nothing until ``go_on_reading``."""
    if link._reader is not None:
        link._reader._backlog = lambda: 1 << 30  # (its consumer "holds" frames: the thread waits for room)
    else:
        link._transport.pause_reading()


def go_on_reading(link):
    if link._reader is not None:
        link._reader._backlog = link._frames.__len__
        link._reader.room.set()
    else:
        link._transport.resume_reading()


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

        def refusals():
            return [r.message for r in caplog.records if "refused connection" in r.message]
        await until(refusals)  # (said as the admission ends, which may be just after the close)
        await asyncio.sleep(0.05)
        assert len(refusals()) == 1, refusals()  # one clear line per bad peer
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
        await until(lambda: any("version 99" in r.message and f"speaks {wire.PROTOCOL_VERSION}" in r.message
                                for r in caplog.records))


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


async def test_a_peer_that_dials_itself_is_refused_without_a_warning(caplog):
    """The same --peers list on every machine lists each peer's own address (README: "is
    fine"): its one dial to itself was refused with a WARNING "refused connection from ...:
    connected to itself" on every peer at start."""
    caplog.set_level(logging.DEBUG, "p2ptrain.net.transport")
    async with Server() as srv:
        with pytest.raises(HandshakeError) as refused:
            await transport.open_link("127.0.0.1", srv.port, hs("srv0"))  # (the server's own id)
        assert refused.value.reason == auth.REASON_SELF
        await until(lambda: any("connected to itself" in r.message for r in caplog.records))
        assert not [r.message for r in caplog.records if r.levelno >= logging.WARNING]


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
        client._close_io()
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
        stop_reading(server_side)  # a peer that does not keep up
        data = np.ones(1 << 20, np.float32)
        sending = asyncio.ensure_future(client.send({"t": "chunk"}, [memoryview(data)], timeout=5))
        await until(lambda: (client.queued_bytes() or 0) > 100_000)
        go_on_reading(server_side)
        await sending
        got = await server_side.recv(timeout=5)
        assert got.payload.nbytes == data.nbytes
        await until(lambda: client.queued_bytes() == 0)  # all of it acknowledged
        client.close()
        assert client.queued_bytes() is None  # (closed: the OS has nothing to tell)


# -- a link's own threads: large frames sent, everything read (P2PTRAIN_IO_THREADS=1) --

@pytest.fixture
def send_thread(io_mode):
    if io_mode != "threads":
        pytest.skip("a test of the links' own threads")


async def test_a_refusal_to_a_peer_that_reset_the_connection_closes_it_without_raising():
    """A handshake timed out on a loaded machine while the peer (a relay) reset its end: the
    refusal's half-close raised ENOTCONN out of ``close``, the admission task died with it, and the
    socket stayed open (tests/test_attacks.py's relay saw its connections kept)."""
    class Reset(asyncio.Transport):
        closed = False

        def is_closing(self):
            return self.closed

        def write(self, data):
            pass

        def can_write_eof(self):
            return True

        def write_eof(self):
            raise OSError(107, "Transport endpoint is not connected")

        def close(self):
            self.closed = True

    link, reset = transport.Link("incoming"), Reset()
    link._transport = reset
    link.close(auth.REASON_TIMEOUT)
    assert reset.closed and link.closed


def _link_threads() -> list:
    import threading
    return [t for t in threading.enumerate() if t.name.startswith(("p2ptrain-send", "p2ptrain-read"))]


async def test_threaded_sends_keep_frames_whole_and_in_order(send_thread):
    async with Server() as srv:
        client, server_side = await srv.good_client()
        big = [np.full(300_000, i, np.float32) for i in range(6)]  # 1.2 MB each: the thread's
        sends = []
        for i, data in enumerate(big):
            sends.append(client.send({"t": "chunk", "i": 2 * i}, [memoryview(data)], timeout=5))
            sends.append(client.send({"t": "chunk", "i": 2 * i + 1}, [b"small"], timeout=5))  # inline
        receiving = asyncio.ensure_future(asyncio.gather(*[server_side.recv(timeout=5) for _ in sends]))
        await asyncio.gather(*sends)
        frames = await receiving
        assert [f.header["i"] for f in frames] == list(range(12))
        for i, data in enumerate(big):
            assert np.array_equal(np.frombuffer(frames[2 * i].payload, np.float32), data)
            assert bytes(frames[2 * i + 1].payload) == b"small"
        assert client._direct._jobs is not None  # (the large ones did go through the thread)
        client.close()
    await until(lambda: not _link_threads())  # closed links leave no thread behind


async def a_send_under_way(client, server_side, timeout):
    """A 16 MiB frame (frame 0) to a peer that stopped reading, partly out: its task, its values."""
    stop_reading(server_side)
    data = np.arange(4 << 20, dtype=np.float32)
    sending = asyncio.ensure_future(client.send({"t": "chunk", "i": 0}, [memoryview(data)], timeout=timeout))
    await until(lambda: (client.queued_bytes() or 0) > 100_000)
    return sending, data


async def test_a_send_to_a_peer_that_stopped_reading_times_out_and_closes_the_link():
    """Part of the frame went out: the link cannot carry another (the peer would read it as the
    rest of this one and hear nothing after), so it closes and the peer is told at once."""
    async with Server() as srv:
        client, server_side = await srv.good_client()
        stop_reading(server_side)
        data = np.ones(4 << 20, np.float32)  # 16 MiB: more than the kernel's buffers hold
        with pytest.raises(LinkError, match="stopped reading"):
            await client.send({"t": "chunk"}, [memoryview(data)], timeout=0.3)
        assert client.closed
        with pytest.raises(LinkError, match="stopped reading"):
            await client.send({"t": "ping"}, timeout=5)
        go_on_reading(server_side)
        with pytest.raises(LinkError, match="closed by peer in the middle of a frame"):
            await server_side.recv(timeout=5)


async def test_a_cancelled_send_still_ends_before_the_next_frame():
    """A ring cancelled while its chunk is half out (its round failed elsewhere) leaves the
    link whole: the rest of the chunk goes first, then the next frame. Before, on the event
    loop, the next frame's bytes were read as the rest of the chunk, and the link went deaf."""
    async with Server() as srv:
        client, server_side = await srv.good_client()
        sending, data = await a_send_under_way(client, server_side, timeout=5)
        sending.cancel()
        following = asyncio.ensure_future(client.send({"t": "chunk", "i": 1}, [b"after"], timeout=5))
        await asyncio.sleep(0.05)
        assert not following.done()  # waits for the frame still going out
        go_on_reading(server_side)
        await following
        first, second = await server_side.recv(timeout=5), await server_side.recv(timeout=5)
        assert first.header["i"] == 0 and np.array_equal(np.frombuffer(first.payload, np.float32), data)
        assert second.header["i"] == 1 and bytes(second.payload) == b"after"
        client.close()


async def test_a_cancelled_send_that_then_stalls_closes_the_link(io_mode):
    """The rest of a cancelled sender's frame cannot go either: no one awaits it, and the link
    closes all the same (the next send says why)."""
    if io_mode == "transport":
        pytest.skip("through the transport a frame is handed over whole: a cancelled send leaves it there")
    async with Server() as srv:
        client, server_side = await srv.good_client()
        sending, _ = await a_send_under_way(client, server_side, timeout=0.3)
        sending.cancel()
        await until(lambda: client.closed, timeout=5)
        with pytest.raises(LinkError, match="stopped reading"):
            await client.send({"t": "ping"}, timeout=5)


async def test_closing_a_link_ends_its_threaded_send(send_thread):
    async with Server() as srv:
        client, server_side = await srv.good_client()
        sending, _ = await a_send_under_way(client, server_side, timeout=30)
        client.close()
        with pytest.raises(Exception, match="closed"):
            await asyncio.wait_for(sending, 2)
    await until(lambda: not _link_threads())


def test_io_threads_setting(monkeypatch):
    from p2ptrain.errors import ConfigError
    monkeypatch.setenv(sender.IO_THREADS_ENV, "0")
    assert sender.io_threads_default() is False
    monkeypatch.setenv(sender.IO_THREADS_ENV, "yes")
    with pytest.raises(ConfigError, match="expected 0 or 1"):
        sender.io_threads_default()
    monkeypatch.delenv(sender.IO_THREADS_ENV)
    assert sender.io_threads_default() is False
    monkeypatch.setenv(sender.IO_THREADS_ENV, "1")
    assert sender.io_threads_default() is True


async def test_reading_stops_at_the_high_water_mark_and_goes_on_as_frames_are_taken():
    async with Server() as srv:
        client, server_side = await srv.good_client()
        frames = 3 * transport.MAX_QUEUED_FRAMES
        for i in range(frames):  # (the kernel's buffers take what the link does not read yet)
            await client.send({"t": "chunk", "i": i}, [bytes(4096)], timeout=5)
        await until(lambda: len(server_side._frames) >= transport.MAX_QUEUED_FRAMES)
        await asyncio.sleep(0.2)
        assert len(server_side._frames) <= transport.MAX_QUEUED_FRAMES + 1  # (bounded: reading waits)
        got = [(await server_side.recv(timeout=5)).header["i"] for _ in range(frames)]
        assert got == list(range(frames))
        client.close()


def test_addresses_are_shown_as_a_user_would_type_them_back():
    from p2ptrain.net.transport import hostport

    assert hostport("10.0.0.2", 7000) == "10.0.0.2:7000"
    assert hostport("::1", 7000) == "[::1]:7000"  # (not "::1:7000", which reads as an address)
    assert hostport("fe80::1%eth0", 7000) == "[fe80::1%eth0]:7000"


async def test_a_lan_link_reads_a_large_payload_once_it_has_all_come_and_small_frames_at_once(io_mode, monkeypatch):
    # (loopback stands in for a LAN link here: on a real one the socket's low-water mark is set)
    import socket

    monkeypatch.setattr(transport, "_reads_whole_payloads", lambda sock: True)
    async with Server() as srv:
        client, server_side = await srv.good_client()
        sock = server_side._transport.get_extra_info("socket")
        payload = os.urandom(300_000)
        head = wire.pack_header({"t": "chunk", "i": 1}, len(payload))
        client._transport.write(head + payload[:100_000])  # the frame begun, two thirds still to come
        await asyncio.sleep(0.2)
        assert not server_side._frames
        if io_mode != "threads":  # (there a thread reads, blocking: the mark does not apply)
            assert server_side._decoder.payload_left >= 200_000 - (1 << 16)
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT) == server_side._decoder.payload_left
        client._transport.write(payload[100_000:])
        frame = await server_side.recv(timeout=5)
        assert frame.header["i"] == 1 and bytes(frame.payload) == payload
        await until(lambda: client._transport.get_write_buffer_size() == 0)
        await client.send({"t": "chunk", "i": 2}, [b"abc"])  # a small frame is not held back
        frame = await server_side.recv(timeout=1)
        assert frame.header["i"] == 2 and bytes(frame.payload) == b"abc"
        if io_mode != "threads":
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT) == 1
        client.close()


async def test_a_listener_cancelled_while_it_opens_leaves_nothing_listening():
    """asyncio's ``create_server`` binds, then yields once to start serving: a cancel there (a
    waiter that stopped waiting for a peer's opening) dropped a server already accepting
    connections, owned by no one; the peer's port stayed taken."""
    import socket

    port = ports(1)[0]

    def taken() -> bool:
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                return True
            return False

    opening = asyncio.ensure_future(transport.serve("127.0.0.1", port, lambda: None, lambda link: None))
    for _ in range(100):  # (until it has bound: then it is at the yield before serving)
        await asyncio.sleep(0)
        if opening.done() or taken():
            break
    if opening.done():
        await opening.result().close()
        pytest.skip("this event loop bound and served without yielding in between")
    opening.cancel()
    with pytest.raises(asyncio.CancelledError):
        await opening
    assert not taken()  # free again
