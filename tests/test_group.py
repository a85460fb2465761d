"""Group.allreduce over loopback: the sum, bit-identical on every peer, for every codec;
in one process and in separate processes; and the errors a user can make."""

import asyncio
import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from helpers import finish, pending_tasks, ports
import torch

from p2ptrain import ConfigError, Group, GroupError
from p2ptrain.errors import ClosedError, NotFiniteError, P2PTrainError

pytestmark = pytest.mark.timeout(60)

def addrs(n):
    return [f"127.0.0.1:{port}" for port in ports(n)]


async def run_group(n, body, **kw):
    """Run ``body(group, rank)`` on n peers in this process; return their results."""
    peers = addrs(n)

    async def one(r):
        async with Group(listen=peers[r], peers=peers, connect_timeout=20, timeout=20, **kw) as g:
            return await body(g, r)

    return await asyncio.gather(*[one(r) for r in range(n)])


def contribution(rank, length, dtype=np.float32):
    return np.random.default_rng(rank).standard_normal(length).astype(dtype)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("length", [1, 3, 1000, 262_147])
async def test_sum_is_exact_and_bit_identical(n, length):
    async def body(g, r):
        x = torch.from_numpy(contribution(r, length))
        out = await g.allreduce(x)
        assert out is x
        return x.numpy().tobytes()

    results = await run_group(n, body, chunk_bytes=4096)
    assert len(set(results)) == 1
    got = np.frombuffer(results[0], np.float32)
    exact = sum(contribution(r, length).astype(np.float64) for r in range(n))
    np.testing.assert_allclose(got, exact, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("codec", ["none", "fp16", "bf16", "int8", "int8+nozstd", "topk:0.05", "fp16+zstd:3"])
@pytest.mark.parametrize("threads", [0, 2])
async def test_every_codec_gives_bit_identical_results(codec, threads):
    async def body(g, r):
        x = torch.from_numpy(contribution(r, 50_001))
        await g.allreduce(x, error_feedback=True)
        return x.numpy().tobytes(), g.last_stats

    results = await run_group(3, body, compression=codec, chunk_bytes=16384, codec_threads=threads)
    assert len({b for b, _ in results}) == 1
    stats = results[0][1]
    if codec != "none":
        assert stats.wire_bytes < stats.raw_bytes


async def test_a_tracer_gets_every_chunk_of_every_call_by_step():
    """``Group(trace=...)``: what ``bench/allreduce.py --trace`` reads, each chunk's encode,
    send and receive, named by call and ring step (3 peers: 4 steps)."""
    from p2ptrain.trace import Tracer
    tracers = [Tracer("unused.json") for _ in range(3)]
    peers = addrs(3)

    async def one(r):
        async with Group(listen=peers[r], peers=peers, connect_timeout=20, timeout=20, compression="int8",
                         chunk_bytes=4096, trace=tracers[r]) as g:
            for _ in range(2):
                await g.allreduce(torch.from_numpy(contribution(r, 3000)))

    await asyncio.gather(*[one(r) for r in range(3)])
    for tracer in tracers:
        received = {(args["round"], args["step"]) for name, _, _, _, args in tracer.spans if name == "receive"}
        assert received == {(op, g) for op in (0, 1) for g in range(4)}
        assert {name for name, *_ in tracer.spans} >= {"encode", "send", "receive", "reduce", "decode"}


@pytest.mark.parametrize("raw_chunks", ["1", "0"])
async def test_a_lossy_codec_between_peers_on_one_machine_times_both_ways_once_settled(raw_chunks, monkeypatch):
    """Loopback's "wire" is the kernel copying on the cores the codec would use, and which way
    is sooner depends on the machine: once the link has carried a few MiB, calls go raw (exact)
    and encoded by turns, the peers alike, and then the quicker way is kept (``linkpace``);
    unless turned off: then every chunk is encoded."""
    monkeypatch.setenv("P2PTRAIN_RAW_CHUNKS", raw_chunks)
    length = 1 << 21  # 8 MiB a call, 2 MiB of int8 sent: the link has carried SETTLED_BYTES after 4

    async def body(g, r):
        calls = []
        for _ in range(12):
            x = torch.from_numpy(contribution(r, length))
            await g.allreduce(x, compression="int8")
            calls.append((x.numpy().tobytes(), g.last_stats.wire_bytes == g.last_stats.raw_bytes))
        return calls

    results = await run_group(2, body)
    assert all(a[0] == b[0] for a, b in zip(*results))  # bit-identical replicas, call by call
    ways = [[raw for _, raw in calls] for calls in results]  # (each peer's own send link)
    exact = (contribution(0, length) + contribution(1, length)).tobytes()  # (float32, as the ring adds)
    for i, (result, _) in enumerate(results[0]):
        assert (result == exact) is (ways[0][i] and ways[1][i])  # exact where both links went raw
    if raw_chunks == "0":
        assert not any(ways[0] + ways[1])
        return
    for way in ways:
        assert way[:4] == [False] * 4  # (nothing measured yet: encoded, as asked)
        assert way[4:10] == [True, False] * 3  # (timed both ways, by the call's parity)
        assert way[10] == way[11]  # (then the quicker way, kept: each peer chooses for its own link)


async def test_several_tensors_mixed_dtypes_devices_and_layouts():
    async def body(g, r):
        a = torch.full((3, 4), float(r + 1), dtype=torch.float16)
        b = torch.full((5,), float(r + 1), dtype=torch.bfloat16)
        c = torch.full((2, 6), float(r + 1), dtype=torch.float64).t()  # non-contiguous
        d = torch.full((7,), float(r + 1), requires_grad=True)
        await g.allreduce([a, b, c, d], op="mean")
        return [t.detach().double().tolist() for t in (a, b, c, d)], [t.dtype for t in (a, b, c, d)]

    results = await run_group(3, body)
    for values, dtypes in results:
        assert dtypes == [torch.float16, torch.bfloat16, torch.float64, torch.float32]
        for v in values:
            assert np.allclose(np.array(v), 2.0)  # mean of 1, 2, 3


async def test_empty_list_and_empty_tensor_are_no_ops():
    async def body(g, r):
        assert await g.allreduce([]) == []
        e = torch.empty(0)
        await g.allreduce(e)
        x = torch.ones(4)
        await g.allreduce(x)  # the group still works afterwards
        return x.tolist()

    assert (await run_group(2, body))[0] == [2.0] * 4


async def test_integer_tensors_are_refused_clearly():
    async def body(g, r):
        with pytest.raises(ConfigError, match="floating-point.*item 1 is torch.int64.*float"):
            await g.allreduce([torch.ones(2), torch.ones(2, dtype=torch.int64)])
        with pytest.raises(ConfigError, match="op must be"):
            await g.allreduce(torch.ones(2), op="max")
        # (an array went by its scalars, refused as "item 0 is float32: convert it with .float()")
        with pytest.raises(ConfigError, match=r"got a ndarray: wrap it with torch.from_numpy\(array\)"):
            await g.allreduce(np.ones(4, np.float32))
        with pytest.raises(ConfigError, match="item 1 is a float: make it one with torch.as_tensor"):
            await g.allreduce([torch.ones(2), 2.0])
        x = torch.ones(3)
        await g.allreduce(t for t in [x])  # any iterable of tensors
        return x.tolist()

    assert await run_group(2, body) == [[2.0] * 3] * 2


async def test_error_feedback_conserves_mass_over_rounds():
    rounds, n, length = 30, 3, 4096

    async def body(g, r):
        applied = np.zeros(length, np.float64)
        given = np.zeros(length, np.float64)
        rng = np.random.default_rng(100 + r)
        for _ in range(rounds):
            c = (rng.standard_normal(length) * np.where(rng.random(length) < 0.01, 30, 1)).astype(np.float32)
            given += c
            x = torch.from_numpy(c.copy())
            await g.allreduce(x, compression="topk:0.01", error_feedback=True)
            applied += x.numpy()
        (residual,) = g._feedback.values()  # what is still owed by this peer
        return applied, given, residual.astype(np.float64)

    results = await run_group(n, body, chunk_bytes=4096)
    applied = results[0][0]
    assert all(np.array_equal(applied, a) for a, _, _ in results)
    given = sum(gv for _, gv, _ in results)
    owed = sum(res for _, _, res in results)
    np.testing.assert_allclose(applied + owed, given, atol=1e-3)  # nothing lost
    assert np.linalg.norm(applied - given) > 1e-2 * np.linalg.norm(given)  # ...and topk did drop a lot per round


@pytest.mark.parametrize("differs, message", [
    ({"compression": "int8"}, "same compression"),
    ({"length": 1001}, "same shapes"),
])
async def test_peers_that_disagree_get_a_clear_error_and_a_closed_group(differs, message):
    peers = addrs(2)

    async def one(r):
        length = differs.get("length", 1000) if r else 1000
        kw = {"compression": differs["compression"]} if r and "compression" in differs else {}
        async with Group(listen=peers[r], peers=peers, timeout=5, **kw) as g:
            with pytest.raises(P2PTrainError) as err:
                await g.allreduce(torch.ones(length))
            with pytest.raises(ClosedError):  # a failed group is closed
                await g.allreduce(torch.ones(3))
            return str(err.value)

    msgs = await asyncio.gather(one(0), one(1))
    assert any(message in m for m in msgs)


async def test_missing_peer_is_named_after_the_timeout():
    peers = addrs(3)
    with pytest.raises(GroupError, match=peers[1].replace(".", r"\.")):
        async with Group(listen=peers[0], peers=peers, connect_timeout=1):
            pass


def dialers() -> list:
    return [t for t in pending_tasks() if t.get_coro().__qualname__ == "Group._dial"]


async def test_a_group_that_never_forms_or_is_cancelled_entering_leaves_no_dial_behind():
    peers = addrs(3)  # rank 0 dials ranks 1 and 2, which never listen
    with pytest.raises(GroupError):
        async with Group(listen=peers[0], peers=peers, connect_timeout=1):
            pass
    assert dialers() == []
    entering = asyncio.ensure_future(Group(listen=peers[0], peers=peers, connect_timeout=30).__aenter__())
    await asyncio.sleep(0.3)
    assert len(dialers()) == 2  # still dialing
    entering.cancel()
    with pytest.raises(asyncio.CancelledError):
        await entering
    assert dialers() == []


async def test_a_closed_group_cannot_be_entered_again():
    peers = addrs(2)
    group = Group(listen=peers[0], peers=peers, connect_timeout=1)
    await group.close()
    with pytest.raises(ClosedError, match="new Group"):
        await group.__aenter__()


async def test_wrong_secret_never_forms():
    peers = addrs(2)
    a = Group(listen=peers[0], peers=peers, connect_timeout=1.5, secret="one")
    b = Group(listen=peers[1], peers=peers, connect_timeout=1.5, secret="two")
    res = await asyncio.gather(a.__aenter__(), b.__aenter__(), return_exceptions=True)
    assert all(isinstance(e, GroupError) for e in res), res


def test_bad_arguments():
    with pytest.raises(ConfigError, match="not in peers"):
        Group(listen="127.0.0.1:1", peers=["127.0.0.1:2"])
    with pytest.raises(ConfigError, match="host:port"):
        Group(listen="x", peers=["x"])
    with pytest.raises(ConfigError, match="twice"):
        Group(listen="127.0.0.1:1", peers=["127.0.0.1:1", "127.0.0.1:1"])
    with pytest.raises(ConfigError, match="compression"):
        Group(listen="127.0.0.1:1", peers=["127.0.0.1:1"], compression="int9")


async def test_a_peer_dying_mid_allreduce_fails_the_others_quickly():
    peers = addrs(3)

    async def survivor(r):
        async with Group(listen=peers[r], peers=peers, timeout=3) as g:
            await g.allreduce(torch.ones(10))
            with pytest.raises(P2PTrainError):
                await g.allreduce(torch.ones(1 << 20))
            return True

    async def victim():
        g = Group(listen=peers[2], peers=peers)
        await g.__aenter__()
        await g.allreduce(torch.ones(10))
        await g.close()  # vanishes instead of joining the second allreduce

    t0 = asyncio.get_running_loop().time()
    res = await asyncio.gather(survivor(0), survivor(1), victim())
    assert res[:2] == [True, True]
    assert asyncio.get_running_loop().time() - t0 < 10


WORKER = textwrap.dedent("""
    import asyncio, json, sys, numpy as np, torch
    from p2ptrain import Group
    from p2ptrain.net.transport import install_uvloop
    rank, loop, cases = int(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3])
    async def main(peers, codec):
        async with Group(listen=peers[rank], peers=peers, compression=codec, connect_timeout=30) as g:
            x = torch.from_numpy(np.random.default_rng(rank).standard_normal(100_003).astype(np.float32))
            await g.allreduce(x)
            return x.numpy().view(np.uint32)[::97].tolist()
    if loop == "uvloop":
        assert install_uvloop()
    for peers, codec in cases:  # one group after another, each on its own ports; a rank past its size sits out
        print(json.dumps(asyncio.run(main(peers, codec)) if rank < len(peers) else None), flush=True)
""")

# Groups of several sizes and codecs, in processes that import torch once for all of them:
# each process runs the groups of its event loop one after the other.
SEPARATE = {"asyncio": [(2, "none"), (3, "int8")], "uvloop": [(4, "none"), (5, "topk:0.1")]}


@pytest.mark.parametrize("loop", sorted(SEPARATE))
def test_separate_processes(loop, tmp_path):
    if loop == "uvloop":
        pytest.importorskip("uvloop", reason="uvloop is not installed (optional: never on Windows)")
    cases = [(addrs(n), codec) for n, codec in SEPARATE[loop]]
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    procs = [subprocess.Popen([sys.executable, str(script), str(r), loop, json.dumps(cases)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(max(len(peers) for peers, _ in cases))]
    outs = finish(procs, timeout=60)
    assert all(p.returncode == 0 for p in procs), [e[-2000:] for _, e in outs]
    lines = [[json.loads(line) for line in o.strip().splitlines()] for o, _ in outs]
    for k, (peers, codec) in enumerate(cases):
        n = len(peers)
        results = [lines[r][k] for r in range(n)]
        assert all(r == results[0] for r in results), (n, codec)  # bit-identical on every peer
        if codec == "none":
            exact = sum(np.random.default_rng(r).standard_normal(100_003).astype(np.float32).astype(np.float64)
                        for r in range(n))
            got = np.array(results[0], np.uint32).view(np.float32)
            np.testing.assert_allclose(got, exact[::97], rtol=1e-5, atol=1e-5)


async def test_a_corrupt_compressed_chunk_names_the_peer_and_chunk():
    from p2ptrain.codecs import Encoded
    from p2ptrain.errors import CodecError

    peers = addrs(2)

    class Corrupting:
        """Wraps a codec and flips the payload of every encoded chunk into garbage."""

        def __init__(self, codec):
            self._codec = codec

        def __getattr__(self, name):
            return getattr(self._codec, name)

        def encode(self, x, zstd=True):
            enc = self._codec.encode(x, zstd)
            junk = memoryview(b"\xff" * enc.nbytes)
            return Encoded(enc.params, [junk], enc.nbytes)

    async def one(r):
        async with Group(listen=peers[r], peers=peers, timeout=5, compression="int8+nozstd") as g:
            if r == 1:
                g.codec = Corrupting(g.codec)
            try:
                await g.allreduce(torch.ones(5000))
            except P2PTrainError as exc:
                return exc
            return None

    errors = await asyncio.gather(one(0), one(1))
    codec_errors = [e for e in errors if isinstance(e, CodecError)]
    assert codec_errors, errors
    assert "sent a bad chunk (step" in str(codec_errors[0])  # names the peer (its id) and the chunk


def test_receive_buffer_cache_reuses_and_stays_under_its_cap():
    from p2ptrain.collective.buffers import BufferCache

    cache = BufferCache(keep_bytes=3 * 1024)
    a, b = cache.take(1024), cache.take(1024)
    assert len(a) == 1024 and a is not b
    cache.give(a)
    assert cache.take(1024) is a  # handed out again, not allocated
    for buf in (a, b, bytearray(1024), bytearray(1024)):
        cache.give(buf)
    assert cache._kept == 3 * 1024  # the fourth was over the cap: dropped
    big = bytearray(2048)
    cache.give(big)  # a size asked for now pushes out the others' buffers
    assert cache._kept == 3 * 1024
    assert cache.take(2048) is big and len(cache.take(2048)) == 2048


async def test_reduce_scatter_buffers_outlive_the_call(monkeypatch):
    from p2ptrain.collective import buffers

    cache = buffers.BufferCache(keep_bytes=64 << 20)
    monkeypatch.setattr(buffers, "CACHE", cache)
    kept = []

    async def body(g, r):
        for _ in range(2):
            await g.allreduce(torch.ones(1 << 16))
            kept.append(cache._kept)
        return True

    await run_group(2, body, chunk_bytes=16384)
    assert all(k > 0 for k in kept)  # a second call finds the first one's buffers


@pytest.mark.parametrize("n", [2, 3, 4])
async def test_a_nan_under_a_lossy_codec_fails_the_call_everywhere_and_every_peer_hears_why(n):
    """The peer holding the NaN raises NotFiniteError; the others used to hear only "connection
    closed by peer" (a crash's words), the one it sends to excepted. Each now hears why: from
    its refusal (the peer that sends to it), or that a peer left after a failure (whichever
    comes first). Every peer's group is closed."""
    async def body(g, r):
        x = torch.ones(100_000)
        if r == 0:
            x[123] = float("nan")
        try:
            await g.allreduce(x, compression="int8")
        except P2PTrainError as exc:
            return exc
        return None

    errors = await run_group(n, body)
    assert isinstance(errors[0], NotFiniteError)
    assert isinstance(errors[1], GroupError)
    assert "closed the link: it left the allreduce: its values held NaN or inf" in str(errors[1])
    assert all("closed the link: it left the allreduce" in str(e) for e in errors[1:]), errors
