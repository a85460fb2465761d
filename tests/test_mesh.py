"""Mesh over loopback: every peer linked once, frames routed, losses reported once."""

import asyncio

import numpy as np
import pytest

from helpers import pending_tasks, until

from p2ptrain.codecs import parse_codec
from p2ptrain.collective.allreduce import RingAllreduce
from p2ptrain.net import mesh as mesh_module, transport, wire
from p2ptrain.net.mesh import Mesh

pytestmark = pytest.mark.timeout(30)


class Peer:
    def __init__(self, pid, secret=b"s"):
        self.messages, self.lost, self.admitted = [], [], []
        self.mesh = Mesh(cluster="lab", peer_id=pid, secret=secret, host="127.0.0.1",
                         on_message=lambda p, h: self.messages.append((p, h)),
                         on_lost=lambda p, why: self.lost.append((p, why)),
                         on_admitted=lambda p, info: self.admitted.append(p))




async def started(*ids, secret=b"s"):
    peers = [Peer(pid, secret) for pid in ids]
    for p in peers:
        await p.mesh.start()
    return peers


async def everyone_proposes_everyone(peers):
    for p in peers:
        for q in peers:
            p.mesh.propose("127.0.0.1", q.mesh.port)  # itself included: skipped


async def test_simultaneous_dials_leave_one_link_per_pair():
    peers = await started("a", "b", "c")
    try:
        await everyone_proposes_everyone(peers)
        await until(lambda: all(len(p.mesh.peers) == 2 for p in peers))
        await asyncio.sleep(2.5)  # past the duplicate grace: losing links are closed by now
        assert [p.mesh.peers for p in peers] == [["b", "c"], ["a", "c"], ["a", "b"]]
        assert all(p.lost == [] for p in peers)  # no flapping while duplicates were resolved
        # each pair shares exactly one open link: the same connection seen from both ends
        a, b = peers[0].mesh, peers[1].mesh
        la, lb = a._links["b"], b._links["a"]
        assert la._transport.get_extra_info("sockname") == lb._transport.get_extra_info("peername")
    finally:
        for p in peers:
            await p.mesh.close()


async def test_a_mesh_closed_while_a_duplicate_lingers_leaves_no_connection_open(monkeypatch):
    """A losing duplicate is read a grace period, then closed by a timer; a peer that left within
    it (a short run, a notebook's cell) left that connection open, unseen, until the process ended."""
    lingered = []
    linger = Mesh._linger
    monkeypatch.setattr(Mesh, "_linger", lambda self, pid, link: (lingered.append(link), linger(self, pid, link)))
    for _ in range(10):  # simultaneous dials make duplicates most of the time, not always
        peers = await started("a", "b", "c")
        try:
            await everyone_proposes_everyone(peers)
            await until(lambda: all(len(p.mesh.peers) == 2 for p in peers))
        finally:
            for p in peers:
                await p.mesh.close()
        if lingered:
            break
    assert lingered, "no duplicate link in ten tries"
    assert all(link._transport.is_closing() for link in lingered)


async def test_a_ring_that_took_its_channels_before_a_duplicate_won_runs_over_the_kept_link():
    """Both ends dialed at once and the link both keep (the smaller id's) came second: the
    channels a ring took before the swap move to it, and nothing waits for a dropped link."""
    a, b = await started("a", "b")
    try:
        b.mesh.propose("127.0.0.1", a.mesh.port)  # b's dial first: the link both will drop
        await until(lambda: a.mesh.peers == ["b"] and b.mesh.peers == ["a"])
        channels = {"a": a.mesh.channel("b"), "b": b.mesh.channel("a")}
        dropped = a.mesh._links["b"]
        await a.mesh._dial("127.0.0.1", b.mesh.port)  # (propose skips an address already linked)
        # (both ends on the link a dialed: b's own ``dropped`` is another object, so ask who dialed)
        await until(lambda: a.mesh._links["b"] is not dropped and a.mesh._dialer["b"] == b.mesh._dialer["a"] == "a")
        assert a.mesh.channel("b") is channels["a"] and b.mesh.channel("a") is channels["b"]

        data = {"a": np.arange(5_000, dtype=np.float32), "b": np.ones(5_000, np.float32)}
        want = data["a"] + data["b"]

        async def ring(rank, pid):
            run = RingAllreduce(data[pid], rank=rank, size=2, send_link=channels[pid], recv_link=channels[pid],
                                codec=parse_codec("none"), op_id=1, chunk_elems=512, timeout=5)
            await run.run()

        await asyncio.gather(ring(0, "a"), ring(1, "b"))
        assert np.array_equal(data["a"], want) and np.array_equal(data["b"], want)
        assert a.lost == b.lost == []
    finally:
        await a.mesh.close()
        await b.mesh.close()


async def test_a_peer_given_one_address_links_to_every_peer_of_the_mesh():
    """DDP's habit, one known address: ``c`` proposed only ``a``. Before, it never linked to
    ``b``; a round naming all three failed, and the round machine left ``b``, an old member,
    out while ``c`` stayed (loading state every few seconds, never training)."""
    peers = await started("a", "b", "c")
    a, b, c = peers
    try:
        a.mesh.propose("127.0.0.1", b.mesh.port)
        await until(lambda: a.mesh.peers == ["b"] and b.mesh.peers == ["a"])
        c.mesh.propose("127.0.0.1", a.mesh.port)
        await until(lambda: c.mesh.peers == ["a", "b"] and b.mesh.peers == ["a", "c"], timeout=5)
        assert all(p.lost == [] for p in peers)
    finally:
        for p in peers:
            await p.mesh.close()


def test_keepalives_share_addresses_without_loopback_ones_for_a_peer_elsewhere_and_read_only_sound_ones():
    mesh = Mesh(cluster="lab", peer_id="a", secret=b"s")
    mesh._addr = {"b": ("127.0.0.1", 7001), "c": ("192.168.1.20", 7000), "d": ("192.168.1.30", 7000)}
    assert mesh._shared_with("b") == [["192.168.1.20", 7000], ["192.168.1.30", 7000]]
    assert mesh._shared_with("c") == [["192.168.1.30", 7000]]  # (127.0.0.1 there is c's own machine)
    proposed = []
    mesh.propose = lambda host, port: proposed.append((host, port))
    mesh._heard_of([["10.0.0.5", 7000], ["x", 0], ["y", 70000], ["z", True], [1, 2], "h:1", ["", 1], ["ok", 9, 9]])
    mesh._heard_of({"not": "a list"})
    assert proposed == [("10.0.0.5", 7000)]


async def test_messages_are_routed_and_a_ring_runs_over_the_channels():
    peers = await started("a", "b", "c")
    try:
        await everyone_proposes_everyone(peers)
        await until(lambda: all(len(p.mesh.peers) == 2 for p in peers))
        await peers[0].mesh.send("b", {"t": "status", "x": 1})
        await until(lambda: peers[1].messages)
        assert peers[1].messages == [("a", {"t": "status", "x": 1})]

        view = ["a", "b", "c"]
        data = [np.full(10_001, i + 1, np.float32) for i in range(3)]

        async def ring(rank):
            m = peers[rank].mesh
            run = RingAllreduce(data[rank], rank=rank, size=3, send_link=m.channel(view[(rank + 1) % 3]),
                                recv_link=m.channel(view[(rank - 1) % 3]), codec=parse_codec("int8"),
                                op_id=7, chunk_elems=1024, timeout=5)
            await run.run()

        await asyncio.gather(*[ring(r) for r in range(3)])
        assert all(np.array_equal(d, data[0]) for d in data)
        assert np.allclose(data[0], 6.0, rtol=1e-2)
        assert all(len(p.messages) <= 1 for p in peers)  # chunks never reach on_message
    finally:
        for p in peers:
            await p.mesh.close()


async def test_goodbye_and_crash_are_reported_once():
    peers = await started("a", "b", "c")
    try:
        await everyone_proposes_everyone(peers)
        await until(lambda: all(len(p.mesh.peers) == 2 for p in peers))
        await peers[2].mesh.close()  # polite
        await until(lambda: peers[0].lost and peers[1].lost)
        assert peers[0].lost == [("c", "said goodbye")] and peers[0].mesh.peers == ["b"]
        for link in list(peers[1].mesh._links.values()):  # b dies without a word
            link._transport.abort()
            link._close_io()
        await until(lambda: len(peers[0].lost) == 2)
        assert peers[0].lost[1][0] == "b" and peers[0].mesh.peers == []
        with pytest.raises(Exception, match="no link"):
            await peers[0].mesh.send("b", {"t": "status"})
    finally:
        for p in peers:
            await p.mesh.close()


async def test_a_peer_that_finds_our_frames_malformed_closes_the_link_with_its_reason():
    # It sends REJECT on the link (its decoder failed on something of ours): that is the link
    # ending, with the peer's reason, not a round message of an unknown type.
    peers = await started("a", "b")
    try:
        await everyone_proposes_everyone(peers)
        await until(lambda: all(len(p.mesh.peers) == 1 for p in peers))
        peers[1].mesh._links["a"]._refuse("malformed frame")
        await until(lambda: peers[0].lost)
        assert peers[0].lost == [("b", "closed by the peer: malformed frame")] and peers[0].messages == []
    finally:
        for p in peers:
            await p.mesh.close()


async def test_wrong_secret_is_never_admitted():
    (good,) = await started("a")
    (bad,) = await started("z", secret=b"wrong")
    try:
        bad.mesh.propose("127.0.0.1", good.mesh.port)
        good.mesh.propose("127.0.0.1", bad.mesh.port)
        await asyncio.sleep(1.0)
        assert good.mesh.peers == [] and bad.mesh.peers == [] and good.admitted == []
    finally:
        await good.mesh.close()
        await bad.mesh.close()


async def test_close_leaves_no_task_behind_not_even_a_ping_stuck_in_a_send(monkeypatch):
    monkeypatch.setattr(mesh_module, "KEEPALIVE", 0.05)
    send, stuck = transport.Link.send, []

    async def stalled_ping(self, header, payload=(), timeout=None):
        if header["t"] == wire.PING:  # a peer that stopped reading: the ping waits (up to 5 keepalives)
            stuck.append(self)
            await asyncio.sleep(60)
        await send(self, header, payload, timeout)

    monkeypatch.setattr(transport.Link, "send", stalled_ping)
    peers = await started("a", "b")
    try:
        await everyone_proposes_everyone(peers)
        await until(lambda: all(len(p.mesh.peers) == 1 for p in peers))
        await until(lambda: len(stuck) >= 4)  # pings of both ends, several rounds of them
    finally:
        for p in peers:
            await p.mesh.close()
    assert pending_tasks() == []


async def test_the_reach_hint_names_addresses_no_dial_reached_until_one_does():
    import socket

    (a,) = await started("a")
    spare = socket.socket()
    spare.bind(("127.0.0.1", 0))
    port = spare.getsockname()[1]  # (bound, not listening: a dial to it is refused)
    try:
        assert "no other peer found" in a.mesh.reach_hint() and "--peers" in a.mesh.reach_hint()
        a.mesh.propose("127.0.0.1", port)
        await until(lambda: "cannot connect" in a.mesh.reach_hint())
        assert a.mesh.reach_hint().startswith(f"cannot connect to 127.0.0.1:{port}: Connection refused: check the address")
        spare.close()
        (b,) = [Peer("b")]
        b.mesh.port = port
        await b.mesh.start()
        a.mesh.propose("127.0.0.1", port, now=1e9)  # (past the retry pause)
        await until(lambda: a.mesh.peers == ["b"])
        assert "cannot connect" not in a.mesh.reach_hint()
        await b.mesh.close()
    finally:
        spare.close()
        await a.mesh.close()


async def test_a_duplicate_that_wins_in_the_middle_of_a_ring_leaves_its_sum_whole():
    """The swap lands while both rings stream chunks: each end's chunks come over two links
    for a moment, read by two readers, so some arrive out of order; the ring takes them in
    their turn (it failed "peers out of step")."""
    a, b = await started("a", "b")
    try:
        b.mesh.propose("127.0.0.1", a.mesh.port)  # b's dial first: the link both will drop
        await until(lambda: a.mesh.peers == ["b"] and b.mesh.peers == ["a"])
        channels = {"a": a.mesh.channel("b"), "b": b.mesh.channel("a")}
        rng = np.random.default_rng(3)
        data = {p: rng.standard_normal(400_000).astype(np.float32) for p in "ab"}
        want = data["a"] + data["b"]

        async def ring(rank, pid):
            run = RingAllreduce(data[pid], rank=rank, size=2, send_link=channels[pid], recv_link=channels[pid],
                                codec=parse_codec("none"), op_id=1, chunk_elems=256, timeout=10)
            await run.run()

        rings = asyncio.gather(ring(0, "a"), ring(1, "b"))
        await asyncio.sleep(0.005)
        assert not rings.done()
        await a.mesh._dial("127.0.0.1", b.mesh.port)  # (the link a dials wins, mid-ring)
        await rings
        assert np.array_equal(data["a"], want) and np.array_equal(data["b"], want)
        assert a.mesh._dialer["b"] == "a" and a.lost == b.lost == []
    finally:
        await a.mesh.close()
        await b.mesh.close()


def test_a_frame_still_coming_counts_as_heard_and_a_link_that_brings_no_byte_does_not():
    """A snapshot's 4 MB part on a slow link holds the keepalives behind it for seconds: the peer
    sending it is not silent. Stopped or unplugged, a peer sends no byte: its time stays."""
    mesh = Mesh(cluster="lab", peer_id="a", secret=b"s")

    class Link:
        bytes_received = 1000

    sending, stopped = Link(), Link()
    mesh._links, mesh.heard_at = {"b": sending, "c": stopped}, {"b": 1.0, "c": 1.0}
    assert mesh.heard(2.0) == {"b": 2.0, "c": 2.0}  # (a link's first look: its bytes so far are news)
    sending.bytes_received += 65536  # (part of a frame: no frame was read, heard_at not refreshed)
    assert mesh.heard(6.0) == {"b": 6.0, "c": 2.0}
    assert mesh.heard(9.0) == {"b": 6.0, "c": 2.0}  # (nothing more came)
    mesh.heard_at["c"] = 9.5  # (a frame read: the reader's time is kept, never moved back)
    assert mesh.heard(9.2)["c"] == 9.5
    del mesh._links["c"]  # (a link dropped is forgotten)
    mesh.heard(10.0)
    assert list(mesh._bytes_seen) == [sending]
