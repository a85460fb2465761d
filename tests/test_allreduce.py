"""``RingAllreduce`` over real loopback links: results and the digest of the sum."""

from __future__ import annotations

import asyncio
import itertools
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from helpers import pending_tasks, until

from p2ptrain.codecs import Codec, parse_codec
from p2ptrain.collective.allreduce import RingAllreduce
from p2ptrain.collective.digest import buffer_digest
from p2ptrain.collective.linkpace import LinkPace
from p2ptrain.collective.ring import split
from p2ptrain.errors import ConfigError, FrameError, GroupError, LinkError, NotFiniteError, RemoteProtocolError
from p2ptrain.net import wire
from p2ptrain.net.mesh import ChunkChannel, Mesh

pytestmark = pytest.mark.timeout(60)


async def meshes(n):
    ids = [chr(ord("a") + i) for i in range(n)]
    ms = [Mesh(cluster="lab", peer_id=i, secret=b"s", host="127.0.0.1", on_message=lambda p, h: None,
               on_lost=lambda p, why: None, on_admitted=lambda p, info: None) for i in ids]
    for m in ms:
        await m.start()
    for m in ms:
        for q in ms:
            m.propose("127.0.0.1", q.port)
    await until(lambda: all(len(m.peers) == n - 1 for m in ms))
    return ids, ms


async def allreduce(ms, ids, data, codec, op_id=1, executor=None, chunk_elems=1000, own_values=None, residuals=None,
                    buckets=None, ready=None):
    n = len(ms)

    async def one(rank):
        m = ms[rank]
        run = RingAllreduce(data[rank], rank=rank, size=n, own=own_values and own_values[rank],
                            residual=residuals and residuals[rank], send_link=m.channel(ids[(rank + 1) % n]),
                            recv_link=m.channel(ids[(rank - 1) % n]), codec=parse_codec(codec), op_id=op_id,
                            chunk_elems=chunk_elems, timeout=10, executor=executor, digest=True,
                            buckets=buckets, ready=ready and ready[rank])
        await run.run()
        return run
    return await asyncio.gather(*[one(r) for r in range(n)])


@pytest.mark.parametrize("codec,threads", [("none", 0), ("int8", 0), ("int8", 2), ("fp16", 2)])
@pytest.mark.parametrize("n", [2, 3])
async def test_every_peer_gets_the_same_sum_and_the_same_digest_of_it(n, codec, threads):
    ids, ms = await meshes(n)
    executor = ThreadPoolExecutor(threads) if threads else None
    try:
        rng = np.random.default_rng(0)
        data = [rng.standard_normal(10_007).astype(np.float32) for _ in range(n)]
        expected = np.sum(data, axis=0)
        began = asyncio.get_running_loop().time()
        runs = await allreduce(ms, ids, data, codec, executor=executor)
        assert all(began < r.moved_at <= asyncio.get_running_loop().time() for r in runs)  # (chunks came)
        assert all(np.array_equal(d, data[0]) for d in data)  # bit-identical on every peer
        assert np.allclose(data[0], expected, atol=0.1 if codec != "none" else 1e-5)
        digests = {r.sum_digest() for r in runs}
        assert len(digests) == 1 and len(digests.pop()) == 16
        # the chunks hashed as they became final make up the digest of the whole result
        assert runs[0].sum_digest() == buffer_digest(data[0], runs[0].plan)
    finally:
        if executor:
            executor.shutdown()
        for m in ms:
            await m.close()


@pytest.mark.parametrize("n", [2, 3])
async def test_hops_that_add_what_came_as_they_encode_get_the_same_bits(n, monkeypatch):
    # int8's reduce-scatter hops add what came as they encode the sum, in one pass
    # (``Codec.add_encode``; the owner adopting its decoded sum too): the same results, digests
    # and residuals as adding, encoding and decoding one after the other, also where some sums
    # go raw (every fifth send of each link, as the plan orders them: at either N a raw send
    # then meets a chunk that came encoded, which it adds on its own first).
    if not parse_codec("int8").fuses_add_encode:
        pytest.skip("int8's kernels are not in use (numba missing, or P2PTRAIN_NUMBA=0): nothing fuses")
    ids, ms = await meshes(n)
    rng = np.random.default_rng(3)
    inputs = [rng.standard_normal(30_007).astype(np.float32) for _ in range(n)]
    owed, sends = [], {}  # (chunks added by the sender: as it encodes, or before a raw send)
    add_encode, add_owed = Codec.add_encode, RingAllreduce._add_owed

    def counted(method):
        def call(self, *args, **kwargs):
            owed.append(method.__name__)
            return method(self, *args, **kwargs)
        return call

    def every_fifth(self, *args):
        sends[id(self)] = sends.get(id(self), 0) + 1
        return sends[id(self)] % 5 == 0

    monkeypatch.setattr(Codec, "add_encode", counted(add_encode))
    monkeypatch.setattr(RingAllreduce, "_add_owed", counted(add_owed))
    added = set()
    try:
        seen = {}
        for op_id, (fused, some_raw) in enumerate(itertools.product((True, False), (False, True)), start=1):
            monkeypatch.setattr(Codec, "fuses_add_encode", property(lambda self, on=fused: on and self.name == "int8"))
            monkeypatch.setattr(LinkPace, "send_raw", every_fifth if some_raw else lambda self, *args: False)
            sends.clear()
            owed.clear()
            data, residuals = [x.copy() for x in inputs], [np.full_like(x, np.nan) for x in inputs]
            runs = await allreduce(ms, ids, data, "int8", op_id=op_id, chunk_elems=5000, residuals=residuals)
            assert bool(owed) == fused
            if fused:
                added |= set(owed)
            assert all(np.array_equal(d.view(np.uint32), data[0].view(np.uint32)) for d in data)
            seen[fused, some_raw] = (data[0], np.concatenate(residuals), runs[0].sum_digest())
        for some_raw in (False, True):
            (a, ra, da), (b, rb, db) = seen[True, some_raw], seen[False, some_raw]
            assert np.array_equal(a.view(np.uint32), b.view(np.uint32)) and da == db
            assert np.array_equal(ra.view(np.uint32), rb.view(np.uint32))
        assert not np.array_equal(seen[True, False][0], seen[True, True][0])  # (some sums did go raw)
        assert added == {"add_encode", "_add_owed"}  # (both ways: as the sum is encoded; before it goes raw)
    finally:
        for m in ms:
            await m.close()


@pytest.mark.parametrize("threads", [0, 2])
async def test_zstd_only_on_a_link_that_is_behind_and_the_same_sum_either_way(monkeypatch, threads):
    # A link still holding more of our bytes than a chunk takes raw sets the ring's pace: zstd
    # saves time there. One that keeps up gets raw chunks (no CPU spent on bytes that cost no
    # time); one the OS cannot tell about (None) keeps zstd as set. The sum's bits never change.
    # (Links between hosts: these loopback ones are taken for such.)
    monkeypatch.setattr(ChunkChannel, "same_host", property(lambda self: False))
    ids, ms = await meshes(3)
    executor = ThreadPoolExecutor(threads) if threads else None
    rng = np.random.default_rng(1)
    sparse = [np.where(rng.random(30_000) < 0.2, rng.standard_normal(30_000), 0).astype(np.float32)
              for _ in range(3)]  # (int8 codes of it: mostly zeros, which zstd shrinks)
    sums, sent = {}, {}
    try:
        for queued in (0, 10**9, None):
            monkeypatch.setattr(ChunkChannel, "queued_bytes", lambda self, q=queued: q)
            data = [x.copy() for x in sparse]
            runs = await allreduce(ms, ids, data, "int8", op_id=len(sums) + 1, executor=executor,
                                   chunk_elems=5000, residuals=[np.empty_like(x) for x in data])
            sums[queued], sent[queued] = data[0].tobytes(), sum(r.stats.wire_bytes for r in runs)
            assert all(np.array_equal(d, data[0]) for d in data)
    finally:
        if executor:
            executor.shutdown()
        for m in ms:
            await m.close()
    assert sums[0] == sums[10**9] == sums[None]
    assert sent[0] >= sum(r.stats.raw_bytes for r in runs) // 4  # a byte a value: no zstd
    assert sent[10**9] == sent[None] < 0.6 * sent[0]



async def test_a_link_to_this_machine_never_compresses_nor_looks_at_its_queue(monkeypatch):
    """A peer on this machine: the "wire" is the kernel's copies on the same cores, which zstd's
    ~2.8 ns a byte never beats, so no chunk is compressed however far behind the link seems,
    and its queue (a syscall a look, three a chunk) is never asked. Profiled on loopback (N = 2,
    16 MiB int8 in chunks of 16 K values): zstd 14 % and those syscalls 12 % of a peer's CPU;
    the call 27-29 -> 21 ms without them."""
    looked = []
    monkeypatch.setattr(ChunkChannel, "queued_bytes", lambda self: looked.append(1) or 10**9)
    ids, ms = await meshes(3)
    rng = np.random.default_rng(1)
    sparse = [np.where(rng.random(30_000) < 0.2, rng.standard_normal(30_000), 0).astype(np.float32)
              for _ in range(3)]  # (zstd would shrink its int8 codes to under half)
    try:
        assert all(ms[0].channel(p).same_host for p in ids[1:])
        runs = await allreduce(ms, ids, sparse, "int8", chunk_elems=5000,
                               residuals=[np.empty_like(x) for x in sparse])
    finally:
        for m in ms:
            await m.close()
    assert all(np.array_equal(d, sparse[0]) for d in sparse)
    assert sum(r.stats.wire_bytes for r in runs) >= sum(r.stats.raw_bytes for r in runs) // 4  # no zstd
    assert looked == []

def test_the_digest_tells_any_changed_bit_and_any_moved_value():
    from p2ptrain.collective.ring import RingPlan
    plan = RingPlan(0, 3, 10_007, 1000)
    values = np.random.default_rng(1).standard_normal(10_007).astype(np.float32)
    ref = buffer_digest(values, plan)
    for i in (0, 999, 1000, 5000, 10_006):
        for bit in (0, 31):
            damaged = values.copy()
            damaged.view(np.uint32)[i] ^= np.uint32(1 << bit)
            assert buffer_digest(damaged, plan) != ref
    swapped = values.copy()
    swapped[[10, 20]] = swapped[[20, 10]]
    assert buffer_digest(swapped, plan) != ref
    minus_zero = np.zeros(10_007, np.float32)
    assert buffer_digest(minus_zero, plan) != buffer_digest(-minus_zero, plan)  # -0.0 is another bit pattern


class _CountingPool(ThreadPoolExecutor):
    def __init__(self):
        super().__init__(2)
        self.calls = 0

    def submit(self, fn, *args, **kwargs):
        self.calls += 1
        return super().submit(fn, *args, **kwargs)


@pytest.mark.parametrize("codec, cores", [("none", 2), ("int8", 2), ("int8", 16)])
async def test_chunks_up_to_the_inline_size_stay_on_the_loop_and_larger_ones_use_the_pool(codec, cores, monkeypatch):
    # A small ring's codec work is a few ms: hopping each chunk to a thread and back costs more
    # (and, on a busy machine, waits for that thread to get a core). Larger chunks use the pool,
    # but a compiled codec's stay on the loop on a machine of few cores (``pool.inline_for``).
    # Either way every peer gets the same bits.
    from p2ptrain.collective import pool as data_pool
    from p2ptrain.collective.allreduce import INLINE_ELEMS
    monkeypatch.setattr(data_pool.os, "cpu_count", lambda: cores)
    inline = codec == "int8" and cores < data_pool.COMPILED_INLINE_BELOW and parse_codec(codec).compiled
    ids, ms = await meshes(2)
    pool = _CountingPool()
    try:
        rng = np.random.default_rng(3)
        base = [rng.standard_normal(4 * INLINE_ELEMS + 4).astype(np.float32) for _ in range(2)]
        results = {}
        for op, chunk in enumerate((INLINE_ELEMS, INLINE_ELEMS + 1), start=1):
            data = [x.copy() for x in base]
            calls = pool.calls
            await allreduce(ms, ids, data, codec, op_id=op, executor=pool, chunk_elems=chunk)
            assert all(np.array_equal(d, data[0]) for d in data)
            results[chunk] = (pool.calls - calls, data[0])
        assert results[INLINE_ELEMS][0] == 0
        assert (results[INLINE_ELEMS + 1][0] > 0) is not inline
        assert np.allclose(results[INLINE_ELEMS][1], base[0] + base[1], atol=0.1 if codec != "none" else 1e-5)
    finally:
        pool.shutdown()
        for m in ms:
            await m.close()


def test_the_data_path_pool_follows_the_environment(monkeypatch):
    from p2ptrain.collective import pool
    monkeypatch.setenv(pool.ENV, "0")
    assert pool.default_threads() == 0 and pool.shared_pool() is None
    monkeypatch.setenv(pool.ENV, "3")
    assert pool.default_threads() == 3
    monkeypatch.setenv(pool.ENV, "many")
    with pytest.raises(ValueError, match="number of threads"):
        pool.default_threads()
    monkeypatch.delenv(pool.ENV)
    assert 2 <= pool.default_threads() <= pool.MAX_THREADS


@pytest.mark.parametrize("codec", ["none", "int8", "topk:0.1"])
@pytest.mark.parametrize("n", [2, 3])
async def test_own_values_apart_are_read_never_written_and_give_the_same_bits(n, codec):
    ids, ms = await meshes(n)
    try:
        rng = np.random.default_rng(2)
        data = [rng.standard_normal(10_007).astype(np.float32) for _ in range(n)]
        own_values = [d.copy() for d in data]
        in_place = [d.copy() for d in data]
        res_a = [np.zeros_like(d) for d in data]
        res_b = [np.zeros_like(d) for d in data]
        await allreduce(ms, ids, in_place, codec, op_id=1, residuals=res_a)
        works = [np.full_like(d, np.nan) for d in data]  # (what work holds on entry does not matter)
        runs = await allreduce(ms, ids, works, codec, op_id=2, own_values=own_values, residuals=res_b)
        assert all(np.array_equal(s, d) for s, d in zip(own_values, data))  # untouched
        assert all(np.array_equal(w, x) for w, x in zip(works, in_place))  # the same sum, bit for bit
        assert all(np.array_equal(a, b) for a, b in zip(res_a, res_b))  # and the same residuals
        assert len({r.sum_digest() for r in runs}) == 1
    finally:
        for m in ms:
            await m.close()


@pytest.mark.parametrize("codec", ["none", "int8"])
@pytest.mark.parametrize("n", [2, 3])
async def test_rings_of_buckets_give_every_peer_the_same_sum(n, codec):
    from p2ptrain.collective.ring import bucket_bounds
    ids, ms = await meshes(n)
    try:
        rng = np.random.default_rng(3)
        data = [rng.standard_normal(10_007).astype(np.float32) for _ in range(n)]
        expected = np.sum(data, axis=0)
        runs = await allreduce(ms, ids, data, codec, buckets=bucket_bounds(10_007, 3000))
        assert all(np.array_equal(d, data[0]) for d in data)
        assert np.allclose(data[0], expected, atol=0.1 if codec != "none" else 1e-5)
        assert len({r.sum_digest() for r in runs}) == 1
        assert runs[0].sum_digest() == buffer_digest(data[0], runs[0].plan)
    finally:
        for m in ms:
            await m.close()


class Filling:
    """Our values written a range at a time from the end, as backward writes a gradient: a read
    of a range not written yet would see NaN."""

    def __init__(self, values: np.ndarray, parts: int, withdraw_at: int | None = None, pause: float = 0.005):
        self.values, self.target, self.pause = values, values.copy(), pause
        values[:] = np.nan
        self.ranges = list(reversed(split(len(values), parts)))
        self.written = 0
        self.withdraw_at, self.waited = withdraw_at, 0
        self.changed = asyncio.Event()

    async def write(self):
        for i, (a, b) in enumerate(self.ranges):
            await asyncio.sleep(self.pause)
            if i == self.withdraw_at:
                break
            self.values[a:b] = self.target[a:b]
            self.written = i + 1
            self.changed.set()

    def _done(self, start, stop):  # (written: the ranges from the end down to this one's start)
        return self.written and start >= self.ranges[self.written - 1][0]

    async def until(self, start, stop):
        while not self._done(start, stop):
            if self.withdraw_at is not None and self.written >= self.withdraw_at:
                raise GroupError("withdrawn")
            self.waited += 1
            self.changed.clear()
            await self.changed.wait()


@pytest.mark.parametrize("codec", ["none", "int8"])
@pytest.mark.parametrize("n", [2, 3])
async def test_own_values_still_being_written_are_read_only_once_written(n, codec):
    from p2ptrain.collective.ring import bucket_bounds
    ids, ms = await meshes(n)
    try:
        rng = np.random.default_rng(4)
        data = [rng.standard_normal(10_007).astype(np.float32) for _ in range(n)]
        expected_runs = await allreduce(ms, ids, [d.copy() for d in data], codec, op_id=1,
                                        own_values=[d.copy() for d in data], buckets=bucket_bounds(10_007, 4000))
        own = [d.copy() for d in data]
        fills = [Filling(o, parts=9, pause=0.0 if i == 0 else 0.01) for i, o in enumerate(own)]  # (peer 0 first:
        #                                    the others receive its chunks before writing their own values)
        works = [np.empty_like(d) for d in data]
        writers = [asyncio.ensure_future(f.write()) for f in fills]
        runs = await allreduce(ms, ids, works, codec, op_id=2, own_values=own, buckets=bucket_bounds(10_007, 4000),
                               ready=fills)
        await asyncio.gather(*writers)
        assert all(np.array_equal(w, expected_runs[0].work) for w in works)  # the same bits as when written first
        assert sum(f.waited for f in fills) > 0  # (the ring did have to wait)
        assert len({r.sum_digest() for r in runs}) == 1
    finally:
        for m in ms:
            await m.close()


async def test_values_withdrawn_while_written_fail_the_call():
    ids, ms = await meshes(2)
    try:
        data = [np.ones(10_007, np.float32) for _ in range(2)]
        fills = [Filling(data[0].copy(), parts=5, withdraw_at=2), None]
        writer = asyncio.ensure_future(fills[0].write())
        own = [fills[0].values, data[1].copy()]
        with pytest.raises(GroupError):
            await allreduce(ms, ids, [np.empty(10_007, np.float32) for _ in range(2)], "none", own_values=own,
                            ready=fills)
        await writer
    finally:
        for m in ms:
            await m.close()


class FaultyLink:
    """A link whose sends and receives either fail at once or never end (the faults a ring meets)."""

    def __init__(self, name: str, send_fails: bool = False, recv_fails: bool = False):
        self.name, self.send_fails, self.recv_fails = name, send_fails, recv_fails
        self.allocator = wire.default_allocate
        self.same_host = False

    def set_allocator(self, allocate) -> None:
        self.allocator = allocate

    def queued_bytes(self) -> None:
        return None

    async def send(self, header, payload, timeout):
        if self.send_fails:
            raise LinkError(f"{self.name}: send failed")

    async def recv(self, timeout):
        if self.recv_fails:
            raise LinkError(f"{self.name}: receive failed")
        await asyncio.sleep(3600)


def own_tasks() -> list:
    """The pending tasks that run a ``RingAllreduce``'s sender or receiver."""
    return [t for t in pending_tasks()
            if t.get_coro().__qualname__ in ("RingAllreduce._send_all", "RingAllreduce._recv_all")]


@pytest.mark.parametrize("failing", ["sender", "receiver"])
async def test_a_failed_allreduce_raises_the_failure_and_leaves_no_task_behind(failing):
    # rank 0 of 3: it sends to one neighbour and receives from the other. One of its two tasks
    # fails while the other waits (the sender for a chunk, the receiver for a frame).
    send_link = FaultyLink("next", send_fails=failing == "sender")
    recv_link = FaultyLink("previous", recv_fails=failing == "receiver")
    run = RingAllreduce(np.ones(10_000, np.float32), rank=0, size=3, send_link=send_link, recv_link=recv_link,
                        codec=parse_codec("none"), op_id=1, chunk_elems=1000, timeout=60)
    loop = asyncio.get_running_loop()
    began = loop.time()
    with pytest.raises(LinkError, match="send" if failing == "sender" else "receive"):
        await run.run()
    assert loop.time() - began < 5  # the failure, not the other task's timeout
    assert own_tasks() == []  # the other task was cancelled and awaited
    assert recv_link.allocator is wire.default_allocate  # the link's allocator is its own again


async def test_a_cancelled_allreduce_leaves_no_task_behind():
    run = RingAllreduce(np.ones(10_000, np.float32), rank=0, size=3, send_link=FaultyLink("next"),
                        recv_link=FaultyLink("previous"), codec=parse_codec("none"), op_id=1,
                        chunk_elems=1000, timeout=60)
    call = asyncio.ensure_future(run.run())
    await until(lambda: len(own_tasks()) == 2)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    assert own_tasks() == []


# -- a lossy codec's chunks sent raw where the link is quicker than the codec (linkpace) --

@pytest.mark.parametrize("threads", [0, 2])
async def test_raw_chunks_of_a_lossy_codec_leave_every_peer_the_same_bits(monkeypatch, threads):
    # Every chunk raw: the none codec's sum, bit for bit, and nothing left in the residuals.
    # Every other chunk raw: still the same bits on every peer, and the residuals still hold
    # exactly what the encoded chunks dropped (sum of inputs = result + sum of residuals).
    ids, ms = await meshes(3)
    executor = ThreadPoolExecutor(threads) if threads else None
    rng = np.random.default_rng(2)
    inputs = [rng.standard_normal(30_000).astype(np.float32) for _ in range(3)]
    try:
        exact = [x.copy() for x in inputs]
        await allreduce(ms, ids, exact, "none", op_id=1, chunk_elems=5000)
        results = {}
        for op_id, choose in ((2, lambda: True), (3, itertools.cycle([True, False]).__next__),
                              (4, lambda: False)):
            monkeypatch.setattr(LinkPace, "send_raw", lambda self, *args, choose=choose: choose())
            data, residuals = [x.copy() for x in inputs], [np.full_like(x, np.nan) for x in inputs]
            runs = await allreduce(ms, ids, data, "int8", op_id=op_id, executor=executor, chunk_elems=5000,
                                   residuals=residuals)
            assert all(np.array_equal(d, data[0]) for d in data)
            assert len({r.sum_digest() for r in runs}) == 1
            assert runs[0].sum_digest() == buffer_digest(data[0], runs[0].plan)
            assert [r.residual_owed for r in runs] == [op_id != 2] * 3
            owed = [res if run.residual_owed else np.zeros_like(res) for res, run in zip(residuals, runs)]
            assert np.allclose(data[0] + np.sum(owed, axis=0), np.sum(inputs, axis=0), atol=1e-4)
            results[op_id] = data[0], residuals, sum(r.stats.wire_bytes for r in runs), sum(r.stats.raw_bytes for r in runs)
    finally:
        if executor:
            executor.shutdown()
        for m in ms:
            await m.close()
    every, residuals, sent, raw = results[2]
    assert np.array_equal(every, exact[0]) and sent == raw
    assert all(np.isnan(r).all() for r in residuals)  # nothing owed: the buffers were not even written
    _, _, sent, raw = results[3]
    assert raw // 3 < sent < raw * 3 // 4  # some chunks each way
    _, _, sent, raw = results[4]
    assert sent < raw // 3  # none raw: int8's byte a value


async def test_a_raw_chunk_refuses_nan_and_inf_as_the_codec_would(monkeypatch):
    monkeypatch.setattr(LinkPace, "send_raw", lambda self, *args: True)
    for bad in (np.nan, np.inf, -np.inf):
        values = np.ones(10_000, np.float32)
        values[1234] = bad
        run = RingAllreduce(values, rank=0, size=3, send_link=FaultyLink("next"), recv_link=FaultyLink("previous"),
                            codec=parse_codec("int8"), op_id=1, chunk_elems=1000, timeout=60)
        run._pace = LinkPace()  # (a link that cannot tell its queue gets none: forced here)
        with pytest.raises(ConfigError, match="cannot encode with int8: the chunk holds NaN, inf"):
            await run.run()
    assert own_tasks() == []



@pytest.mark.parametrize("at", [100, 15_000, 25_000])  # rank 0's values: sent at step 0, added at step 1, final
async def test_nan_anywhere_fails_the_call_when_every_chunk_goes_raw(monkeypatch, at):
    """A NaN that entered a partial sum went on raw and unchecked: every peer ended with it, and
    the call succeeded. Now the segment's final sum is checked too: the call fails, as encoded."""
    monkeypatch.setattr(LinkPace, "send_raw", lambda self, *args: True)
    ids, ms = await meshes(3)
    data = [np.ones(30_000, np.float32) for _ in range(3)]
    data[0][at] = np.nan
    try:
        with pytest.raises(NotFiniteError, match="cannot encode with int8: the chunk holds NaN"):
            await allreduce(ms, ids, data, "int8", chunk_elems=5000)
    finally:
        for m in ms:
            await m.close()

async def test_a_raw_chunk_larger_than_a_chunk_of_float32_is_refused_before_it_is_read():
    ids, ms = await meshes(2)
    try:
        run = RingAllreduce(np.ones(10_000, np.float32), rank=0, size=2, send_link=ms[0].channel(ids[1]),
                            recv_link=ms[0].channel(ids[1]), codec=parse_codec("int8"), op_id=1,
                            chunk_elems=1000, timeout=10)
        t = run.plan.recvs[0]
        header = {"t": wire.CHUNK, "op": 1, "g": t.g, "c": t.chunk, "n": 10_000, "p": {}, "raw": True}
        with pytest.raises(FrameError, match="raw chunk of"):
            run._allocate(header, 4 * 1000 + 4)
    finally:
        for m in ms:
            await m.close()


class _Reordering:
    """Swaps a channel's first two ring chunks, as two links to one peer may deliver them while
    a duplicate link closes (each link has its own reader)."""

    def __init__(self, channel: ChunkChannel):
        self.put, self.held = channel._put, None
        channel._put = self

    def __call__(self, frame):
        if self.held is None and frame.header.get("g") == 0 and frame.header.get("c") == 0:
            self.held = frame
            return
        self.put(frame)
        if self.held is not None and self.held is not True:
            self.put(self.held)
            self.held = True


@pytest.mark.parametrize("codec", ["none", "int8"])
async def test_chunks_that_come_out_of_order_are_taken_in_their_turn(codec):
    ids, ms = await meshes(2)
    try:
        swap = _Reordering(ms[1].channel(ids[0]))
        rng = np.random.default_rng(1)
        data = [rng.standard_normal(10_000).astype(np.float32) for _ in range(2)]
        expected = data[0] + data[1]
        await allreduce(ms, ids, data, codec)
        assert swap.held is True  # (the swap happened)
        assert np.array_equal(data[0], data[1])
        assert np.allclose(data[0], expected, atol=0.1 if codec != "none" else 1e-6)
    finally:
        for m in ms:
            await m.close()


async def test_a_chunk_of_a_later_call_fails_this_one_and_waits_for_its_own():
    """A neighbour already on the next call (this peer has not yet heard that its call was
    aborted): its first chunk fails this call at once and stays for the next one, which
    succeeds (it was taken and lost, and the next call waited out its timeout)."""
    ids, ms = await meshes(2)
    try:
        data = [np.full(10_000, float(r + 1), np.float32) for r in range(2)]

        def ring(rank, op_id):
            return RingAllreduce(data[rank], rank=rank, size=2, send_link=ms[rank].channel(ids[1 - rank]),
                                 recv_link=ms[rank].channel(ids[1 - rank]), codec=parse_codec("none"),
                                 op_id=op_id, chunk_elems=1000, timeout=10)
        ahead = asyncio.ensure_future(ring(0, 2).run())
        loop = asyncio.get_running_loop()
        began = loop.time()
        with pytest.raises(RemoteProtocolError, match="a is already on call 2, past this one.*out of step"):
            await ring(1, 1).run()
        await ring(1, 2).run()
        await ahead
        assert loop.time() - began < 5
        assert np.array_equal(data[0], data[1]) and data[0][0] == 3
    finally:
        for m in ms:
            await m.close()


async def test_a_patient_call_waits_past_its_timeout_for_a_late_member_and_an_impatient_one_fails():
    """A ring begun as its peer contributed (``member``) waits for a slower member's batch: no
    chunk within ``timeout`` fails the call only once ``patient()`` says the round waits no more."""
    ids, ms = await meshes(2)
    try:
        data = [np.full(10_000, float(r + 1), np.float32) for r in range(2)]
        waiting = [True]

        def ring(rank, patient=None):
            return RingAllreduce(data[rank], rank=rank, size=2, send_link=ms[rank].channel(ids[1 - rank]),
                                 recv_link=ms[rank].channel(ids[1 - rank]), codec=parse_codec("none"),
                                 op_id=1, chunk_elems=1000, timeout=0.2, patient=patient)
        early = asyncio.ensure_future(ring(0, patient=lambda: waiting[0]).run())
        await asyncio.sleep(0.7)  # three of its timeouts: the late member computes
        assert not early.done()
        await ring(1).run()
        await early
        assert np.array_equal(data[0], data[1]) and data[0][0] == 3
        waiting[0] = False  # the round waits no more: a quiet link fails the call at its timeout
        with pytest.raises(LinkError, match="no ring chunk for 0 s"):
            await asyncio.wait_for(ring(0, patient=lambda: waiting[0]).run(), 5)
    finally:
        for m in ms:
            await m.close()
