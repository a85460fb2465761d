"""Run one ring-allreduce over two links: the I/O side of ``ring.RingPlan``.

A sender task walks ``plan.sends`` and a receiver task walks ``plan.recvs``; a chunk is sent
as soon as the same chunk of the previous step has arrived (and, in the reduce-scatter, been
added to), so sending, receiving and adding overlap across chunks.

Chunks pass through a codec (``p2ptrain.codecs``):

- reduce-scatter: each hop decodes what it received, adds its own values, re-encodes. Where
  the codec fuses the two (int8: ``Codec.add_encode``, one pass over the chunk instead of two,
  or three where the sum is one of our own segments' and we adopt its decoded values), the
  receiver leaves the chunk owed and the sender adds it as it encodes the sum (``_owes``);
- all-gather: the owner of a segment encodes its final sum once, and every peer, the owner
  too, decodes those same bytes, which are forwarded unchanged around the ring. So every peer
  ends with bit-identical values, whatever the codec.
- raw chunks (``linkpace``): a lossy codec's chunk goes as the float32 values themselves
  (header ``"raw": true``, exact, no residual) where the link carries them sooner than the
  codec would turn them out: a fast LAN, CPUs too busy to encode in time. Measured per link
  as the ring runs (what the link still holds of ours counted at its rate); to a peer on this
  machine, where the wire is the same cores, by timing whole calls both ways. Every
  peer takes the bytes that came, so replicas stay bit-identical whichever way each chunk went.
  A raw chunk is refused what the codec would refuse (NaN, inf: ``NotFiniteError``) where our
  own values go out (step 0) and where a segment's sum is final, which holds every peer's: so a
  NaN anywhere fails the call, however its chunks travelled; a final sum that comes with NaN or
  inf is the sender's fault (``CodecError``), and no parameter takes it.
- zstd (the codec's lossless layer) only where the send link is behind: it still holds more
  of our bytes than the chunk would take raw (``Link.queued_bytes``). Elsewhere the link
  keeps up, and the bytes zstd would save cost no time, only CPU (``_link_behind``). Never to
  a peer on this machine (``Link.same_host``), whose "wire" is the kernel's copies on the same
  cores: zstd's ~2.8 ns a byte never pays there, and its queue is not looked at (a syscall a
  look, three a chunk). The values never depend on it.
- error feedback (optional): what a lossy encode dropped, ``x - decode(encode(x))``, is
  written per value into ``residual``; the caller adds it into the next call's input (the
  ``Group`` keeps it across calls, the ``Cluster`` until its round commits). Every value is
  encoded exactly once per peer per call, so one float32 buffer of the input's size holds it
  all, and every value of it is written, unless no chunk dropped anything (every one went
  raw): then ``residual_owed`` is False after the call and the buffer was left as it was (a
  caller owes nothing, and skips both the zeros and adding them next time).

With the ``none`` codec nothing is copied in Python: chunks are sent from the work buffer's
memory, and all-gather chunks are received straight into it (the link's allocator).

With an ``executor`` (``pool.shared_pool()``), the data work (the sender's encode, the
receiver's decode, add and hash) runs on its threads, so it and the event loop's socket work
proceed in parallel (numpy, zstd and xxhash release the GIL). A hop to a thread and back
costs tens of microseconds of wake-ups and GIL hand-offs on each side, so the ``none``
codec's steps that only hash (or do nothing) stay on the event loop: only its adds move;
and a compiled codec's stay there too on a machine of few cores (``pool.inline_for``).
Sender and receiver each use their own codec instance: zstd contexts are not thread-safe.

With ``digest=True`` every chunk's final values are hashed where they become final, and
``sum_digest()`` combines them (``digest``): 16 bytes equal on two peers exactly when their
results are bit-identical, computed a chunk at a time while the ring runs.

Our values still being written (``ready``: a round's gradient while backward runs,
``overlap=True``): each read of our own values (a bucket's first send, a reduce-scatter's add) first
awaits ``ready.until(start, stop)``; everything else (forwarding, the all-gather) never waits
for it. ``ready`` raises to withdraw the values, and the call fails as on any error.

Failure: any error (link lost, timeout, bad chunk) cancels both tasks and is raised; the
work buffer then holds partial sums and the links are unusable, so the caller must close
them. ``residual`` is complete only on success.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Callable, NamedTuple, Protocol

import numpy as np

from p2ptrain.net import wire
from p2ptrain.codecs import Codec, parse_codec
from p2ptrain.codecs._codec import check_domain, check_finite, check_received
from p2ptrain.errors import CodecError, FrameError, LinkError, RemoteProtocolError
from p2ptrain.collective.buffers import BufferPool
from p2ptrain.collective.chunk_header import check_chunk_header, chunk_header
from p2ptrain.collective.digest import buffer_digest, chunk_digest, combine
from p2ptrain.collective.linkpace import pace_of, raw_chunks_enabled
from p2ptrain.collective.pool import inline_for
from p2ptrain.collective.ring import MIN_CHUNK_ELEMS, RingPlan, Transfer
from p2ptrain.taskset import TaskSet
from p2ptrain.trace import NO_TRACE
from p2ptrain.net.transport import Link


class Ready(Protocol):
    """Values still being written by another thread (``RingAllreduce``'s ``ready``)."""

    async def until(self, start: int, stop: int) -> None: ...  # returns once [start, stop) is written;
    #                                                          raises to withdraw them (the call fails)


class Owed(NamedTuple):
    """A received reduce-scatter chunk not added yet: the sender adds it as it encodes the sum (``_owes``)."""

    key: tuple[int, int]  # (step, chunk), as it came
    params: dict
    payload: memoryview


@dataclass
class AllreduceStats:
    """What this peer sent in one call: payload bytes on the wire, and the fp32 bytes they stand for."""

    wire_bytes: int = 0
    raw_bytes: int = 0


# The largest chunk of a sparse codec: 2 MiB of float32, ~40 KiB of top-k:0.01 payload,
# ~0.4 ms to encode. Measured best of 1, 2 and 4 MiB (64 MiB buffers, 2 and 4 peers on
# 2 cores): larger ones spill the selection's scratch out of the cache.
_SPARSE_CHUNK_ELEMS = 1 << 19
# A chunk of at most this many values is encoded, decoded or reduced on the loop's thread: the
# hop to the pool and back (60 us, and a thread to wake on a busy machine) costs more than its
# work. That is every chunk of a ring whose segments have at most 8 of the smallest chunks (a
# 4 M-value vector at N = 4): there the codec's work is a few ms a call, and the round's
# latency counts more than spreading it over cores; larger rings use the pool.
INLINE_ELEMS = MIN_CHUNK_ELEMS


def _check_finite(name: str, values: np.ndarray) -> None:
    """Refuse NaN and inf in a raw chunk, as the codec would (max, min: ~25 us a 256 K values)."""
    if len(values) and not (np.isfinite(values.max()) and np.isfinite(values.min())):
        check_domain(name, float(np.max(np.abs(values))))


def _chunk_elems(codec: Codec, chunk_elems: int, length: int, size: int) -> int:
    """The chunk size for this codec: ``chunk_elems``, or for a sparse codec at least 1/8
    of a segment and at most _SPARSE_CHUNK_ELEMS (unless asked for more).

    A codec whose payload is at most 1/8 of float32 (top-k up to 1/16) keeps a link busy
    with few chunks, while each chunk still costs its fixed CPU (a frame each way, a dozen
    numpy calls); its selection's scratch spills out of the cache above _SPARSE_CHUNK_ELEMS.
    A pure function of the call, so every peer derives the same plan.
    """
    if codec.max_payload(_SPARSE_CHUNK_ELEMS) * 8 > 4 * _SPARSE_CHUNK_ELEMS:
        return chunk_elems
    segment = -(-length // max(1, size))
    return max(min(chunk_elems, _SPARSE_CHUNK_ELEMS), min(_SPARSE_CHUNK_ELEMS, -(-segment // 8)))


class RingAllreduce:
    """One allreduce of ``work`` (1-D float32, summed in place) as peer ``rank`` of ``size``.

    With ``own`` (the same shape), this peer's values are read from ``own``, which is
    left untouched, and the sum is written into ``work`` (its contents on entry do not
    matter): a caller that must keep its contribution whole (to put it back if the call
    fails) need not copy it first. ``buckets``: rings one after the other (``ring.RingPlan``).
    ``ready``: our values are still being written (the module docstring; with ``own``).
    ``patient``: while it says so, a receive link quiet for ``timeout`` is no failure (a round's
    members still compute their batches: its ring began as we contributed, and the round's own
    deadlines end that wait, cancelling this call)."""

    def __init__(self, work: np.ndarray, *, rank: int, size: int, send_link: Link, recv_link: Link,
                 codec: Codec, op_id: int, chunk_elems: int, timeout: float,
                 residual: np.ndarray | None = None, executor: Executor | None = None, trace=NO_TRACE,
                 digest: bool = False, own: np.ndarray | None = None,
                 buckets: tuple[tuple[int, int], ...] | None = None, ready: Ready | None = None,
                 patient: Callable[[], bool] | None = None):
        if work.dtype != np.float32 or work.ndim != 1 or not work.flags.c_contiguous:
            raise TypeError("work must be a contiguous 1-D float32 array")
        if own is not None and (own.dtype != np.float32 or own.shape != work.shape
                                or not own.flags.c_contiguous or np.may_share_memory(own, work)):
            raise TypeError("own must be a contiguous float32 array of work's shape, apart from it")
        self.work = work
        self.own = work if own is None else own  # this peer's own values
        chunk_elems = _chunk_elems(codec, chunk_elems, len(work), size)
        self.plan = RingPlan(rank, size, len(work), chunk_elems, buckets)
        self._ready = ready
        self.send_link, self.recv_link = send_link, recv_link
        self.codec = codec
        executor = None if executor is not None and inline_for(codec) else executor  # (a compiled codec)
        self._recv_codec = codec if codec.is_identity or executor is None else parse_codec(codec.spec)
        self._executor = executor
        self.trace = trace  # p2ptrain.trace: spans of encode, send, receive-wait, reduce per chunk
        self.op_id = op_id
        self.timeout = timeout
        self._patient = patient
        self.residual = residual
        self.residual_owed = residual is not None  # (after ``run``: False where nothing was dropped)
        self._raw_spans: list[tuple[int, int]] = []  # ranges of ``residual`` that are 0 (their chunks went raw)
        self._encoded = False  # whether an encode wrote ``residual``
        self.stats = AllreduceStats()
        self._digests: dict[int, int] | None = {} if digest else None  # chunk start -> xxh3 of its final values
        self._arrived: set[tuple[int, int]] = set()
        self._progress = asyncio.Event()
        self.moved_at: float | None = None  # loop time the last chunk arrived (a slow ring still moves)
        self.first_at: float | None = None  # ... and the first (the ring moves: every member before us began)
        self._forward: dict[tuple[int, int], tuple[dict, memoryview | None, bool]] = {}  # (params, payload, raw)
        self._recv_index = {(t.g, t.chunk): t for t in self.plan.recvs}
        self._pool = BufferPool(codec.max_payload(chunk_elems))
        # A lossy codec's chunks may go raw (``linkpace``): their own buffers, and the link's pace.
        self._raw_pool = None if codec.is_identity else BufferPool(4 * chunk_elems)
        self._pace = None if codec.is_identity or not raw_chunks_enabled() else pace_of(send_link)
        self._same_host = send_link.same_host  # (no zstd, no queue to look at: see the module docstring)
        # The receiver's scratch for decode-then-add (the sender's encodes need none: ``encode_final``).
        self._recv_scratch = np.empty(min(chunk_elems, len(work)), np.float32)
        # The reduce-scatter chunks we send on: where the codec fuses it, the sender adds each
        # as it encodes the sum (``Codec.add_encode``), so the receiver leaves it owed here, with
        # the chunk's values already ours (``_absorb``).
        owner_step = self.plan.size - 1
        self._owes = frozenset(t.after for t in self.plan.sends if t.after is not None and (
            t.reduce or t.step == owner_step)) if codec.fuses_add_encode else frozenset()
        self._owed: dict[tuple[int, int], Owed] = {}

    async def run(self) -> AllreduceStats:
        if self.plan.size == 1 or len(self.work) == 0:
            if self._ready is not None:
                await self._ready.until(0, len(self.work))
            if self.own is not self.work:
                self.work[:] = self.own
            self.residual_owed = False  # (alone, the sum is exact)
            return self.stats
        self.recv_link.set_allocator(self._allocate)
        if self._pace is not None:
            self._pace.call_began(self.op_id)
        tasks = TaskSet()  # sender and receiver: neither outlives this call, however it ends
        try:
            sender, receiver = tasks.spawn(self._send_all()), tasks.spawn(self._recv_all())
            done, _ = await asyncio.wait({sender, receiver}, return_when=asyncio.FIRST_EXCEPTION)
            failures = [task.exception() for task in done]  # (each looked at: none left unretrieved)
            for failure in failures:
                if failure is not None:
                    raise failure  # the first (a task still running is cancelled below)
        finally:
            await tasks.close()
            self.recv_link.set_allocator(wire.default_allocate)
        if self._pace is not None:  # (a link to this machine times whole calls: ``linkpace``)
            began = self.first_at
            self._pace.call_ended(len(self.work), None if began is None else asyncio.get_running_loop().time() - began)
        if self.residual is not None:
            self.residual_owed = self._encoded
            for start, stop in self._raw_spans if self._encoded else ():
                self.residual[start:stop] = 0.0
        return self.stats

    # -- sending --------------------------------------------------------------------------
    async def _send_all(self) -> None:
        owner_step = self.plan.size - 1
        for t in self.plan.sends:
            if t.after is not None:
                await self._wait_arrived(t.after)
            elif self._ready is not None:
                await self._ready.until(t.start, t.stop)
            src = (self.own if t.step == 0 else self.work)[t.start : t.stop]  # (step 0: our own values)
            raw, forwarded = False, None
            if self.codec.is_identity and (t.reduce or t.step == owner_step):
                params, payload = {}, [memoryview(src)]  # nothing to compute: no thread hop
                if not t.reduce:  # (a final sum holds every peer's values: NaN or inf fails the call)
                    check_finite(src)
                    self._finished(t.start, src)  # (a hash, ~0.04 ms per MiB: cheaper inline than a hop)
            elif t.reduce or t.step == owner_step:
                began = time.perf_counter()
                queued = None if self._same_host else self.send_link.queued_bytes()  # (one look, both choices)
                raw = self._pace is not None and self._pace.send_raw(len(src), self.codec.max_payload(len(src)), queued)
                owed = self._owed.pop(t.after, None)  # (what came for this sum, not added yet: ``_owes``)
                if raw:
                    if owed is not None:
                        await self._offload(len(src), self._add_owed, owed, src)
                    params, payload = self._raw(src, t)
                else:
                    zstd = self.codec.compresses and not self._same_host and self._link_behind(len(src), queued)
                    params, payload = await self._offload(len(src), self._encode, src, not t.reduce, t.start,
                                                          zstd, owed)
                    if self._pace is not None and owed is None:  # (a fused call's time holds an add too)
                        self._pace.encoded(len(src), time.perf_counter() - began)
                self.trace.span("raw" if raw else "encode", "encode", began, time.perf_counter(), round=self.op_id,
                                step=t.g, chunk=t.chunk)
            elif self.codec.is_identity:
                params, payload = {}, [memoryview(src)]
            else:  # an all-gather chunk on its way round, as it came (raw ones were received in place)
                params, forwarded, raw = self._forward.pop(t.after)
                payload = [memoryview(src) if raw else forwarded]
            await self._send(chunk_header(self.op_id, t, self.plan.length, self.codec.spec, params, raw), payload, t)
            self.stats.raw_bytes += src.nbytes
            if forwarded is not None and not raw:
                self._pool.give(forwarded)

    def _raw(self, src: np.ndarray, t: Transfer) -> tuple[dict, list]:
        """Our values as they are (``linkpace``): nothing dropped (no residual); a final sum stays as it is."""
        if t.step == 0 or not t.reduce:  # our own values, or a final sum (of everyone's)
            _check_finite(self.codec.name, src)
        self._raw_spans.append((t.start, t.stop))
        if not t.reduce:
            self._finished(t.start, src)
        return {}, [memoryview(src)]

    async def _send(self, header: dict, payload: list, t: Transfer) -> None:
        """One chunk's frame out; how fast the link drained meanwhile goes to its pace."""
        nbytes = sum(memoryview(p).nbytes for p in payload)
        pace = self._pace
        looks = pace is not None and not self._same_host  # (a link to this machine: calls are timed whole)
        queued = self.send_link.queued_bytes() if looks else None
        began = time.perf_counter()
        await self.send_link.send(header, payload, timeout=self.timeout)
        ended = time.perf_counter()
        if pace is not None:
            pace.sent(began, queued, ended, self.send_link.queued_bytes() if looks else None, nbytes)
        self.trace.span("send", "send", began, ended, round=self.op_id, step=t.g, chunk=t.chunk)
        self.stats.wire_bytes += nbytes

    def _encode(self, src: np.ndarray, final: bool, start: int, zstd: bool, owed: Owed | None = None
                ) -> tuple[dict, list]:
        """Encode our values; keep the residual; the owner adopts its own decoded final sum (and
        hashes it: ``start`` is where ``src`` begins in the buffer). ``zstd``: whether the codec's zstd
        layer may run (``_link_behind``). ``owed``: the chunk this sum still lacks, added as it is encoded."""
        params, buffers = self._encode_values(src, final, start, zstd, owed)
        if final:
            self._finished(start, src)
        return params, buffers

    def _add_owed(self, owed: Owed, dst: np.ndarray) -> None:
        """The owed chunk added on its own: the sum goes raw (``linkpace``), exact."""
        self._use_owed(owed, self.codec.decode_add, dst, np.empty_like(dst))  # (int8 adds in place: untouched)

    def _use_owed(self, owed: Owed, codec_call, *args):
        """``codec_call(params, payload, *args)`` on the owed chunk: a bad one blamed on its sender."""
        try:
            result = codec_call(owed.params, owed.payload, *args)
        except CodecError as exc:
            raise self._bad_chunk(owed.key, exc) from None
        self._pool.give(owed.payload)
        return result

    def _finished(self, start: int, values: np.ndarray) -> None:
        """``values`` (from ``start``) hold their final sum here."""
        if self._digests is not None:
            self._digests[start] = chunk_digest(values)

    def sum_digest(self) -> bytes:
        """After ``run``, with ``digest=True``: 16 bytes, the same on two peers exactly when
        their results are bit-identical (see the module docstring); ``buffer_digest`` of the
        result, computed a chunk at a time."""
        if self._digests is None:
            raise ValueError("this allreduce was not asked for a digest (digest=True)")
        if self.plan.size == 1 or len(self.work) == 0:
            return buffer_digest(self.work, self.plan)
        return combine(self._digests)

    def _encode_values(self, src: np.ndarray, final: bool, start: int, zstd: bool, owed: Owed | None
                       ) -> tuple[dict, list]:
        if self.codec.is_identity:
            return {}, [memoryview(src)]
        residual = None if self.residual is None else self.residual[start : start + len(src)]
        if owed is not None:
            enc = self._use_owed(owed, self.codec.add_encode, src, residual, final, zstd)
        elif residual is None:  # (the owner's final sum is decoded straight into place: the payload is apart)
            enc = self.codec.encode_decoded(src, src, zstd) if final else self.codec.encode(src, zstd)
        elif final:
            enc = self.codec.encode_final(src, residual, zstd)  # (the owner adopts the decoded sum)
        else:
            enc = self.codec.encode_residual(src, residual, zstd)
        self._encoded |= residual is not None
        return enc.params, enc.buffers

    def _link_behind(self, elems: int, queued: int | None) -> bool:
        """Whether the send link still holds ``queued`` bytes of ours, more than ``elems`` values take
        encoded without zstd: then the link, not our CPU, sets the ring's pace, and the bytes
        zstd saves are time saved. A link that keeps up (loopback, a fast LAN, or peers short
        of CPU, as several on one machine) gets chunks without zstd: compressing them would
        only delay them and take CPU from the ring. Where the OS cannot tell, zstd as set."""
        return queued is None or queued > self.codec.max_payload(elems)

    async def _offload(self, elems: int, fn, *args):
        """``fn(*args)`` on the pool, for a chunk of ``elems`` values; a small one inline (the
        hop to a thread and back costs more than its work)."""
        if self._executor is None or elems <= INLINE_ELEMS:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    async def _wait_arrived(self, key: tuple[int, int]) -> None:
        while key not in self._arrived:
            self._progress.clear()
            await self._progress.wait()  # the receiver, which has the timeout, wakes us or fails

    # -- receiving ------------------------------------------------------------------------
    def _allocate(self, header: dict, nbytes: int) -> memoryview:
        """Called by the link's decoder per payload: all-gather chunks of the none codec go
        straight to their place in ``work``; anything else to a pooled buffer."""
        if header.get("op") != self.op_id:  # a peer already on the next call: checked then
            return wire.default_allocate(header, nbytes)
        t = self._recv_index.get((header.get("g"), header.get("c")))
        raw = header.get("raw") is True and self._raw_pool is not None
        if t is not None and not t.reduce and (self.codec.is_identity or raw):
            if nbytes != (t.stop - t.start) * 4:
                raise FrameError(f"chunk of {nbytes} bytes where {(t.stop - t.start) * 4} were expected")
            return memoryview(self.work[t.start : t.stop]).cast("B")
        if raw:
            if nbytes > self._raw_pool.size:
                raise FrameError(f"raw chunk of {nbytes} bytes exceeds {self._raw_pool.size}")
            return self._raw_pool.take(nbytes)
        if nbytes > self._pool.size:
            raise FrameError(f"chunk payload of {nbytes} bytes exceeds {self._pool.size} for this codec")
        return self._pool.take(nbytes)

    async def _recv_all(self) -> None:
        early: dict[tuple, wire.Frame] = {}
        loop = asyncio.get_running_loop()
        for t in self.plan.recvs:
            began = self.trace.now()
            frame = early.pop((t.g, t.chunk), None) or await self._recv_chunk(t, early)
            arrived = self.trace.now()
            if self.first_at is None:
                self.first_at = loop.time()
            self.trace.span("receive", "receive", began, arrived, round=self.op_id, step=t.g, chunk=t.chunk)
            params, raw = check_chunk_header(frame.header, self.recv_link.name, self.op_id, t, self.plan.length,
                                             self.codec.spec, not self.codec.is_identity)
            if t.reduce and self._ready is not None:
                await self._ready.until(t.start, t.stop)
            try:
                if (self.codec.is_identity or raw) and not t.reduce:
                    self._absorb(t, params, frame.payload, raw)  # already in place: at most a hash, inline
                elif not raw and (t.g, t.chunk) in self._owes and self.own is self.work:
                    self._absorb(t, params, frame.payload)  # left owed to the sender: nothing to compute
                else:
                    await self._offload(t.stop - t.start, self._absorb, t, params, frame.payload, raw)
                self.trace.span("reduce" if t.reduce else "decode", "reduce", arrived, self.trace.now(),
                                round=self.op_id, step=t.g, chunk=t.chunk)
            except CodecError as exc:
                raise self._bad_chunk((t.g, t.chunk), exc) from None
            self._arrived.add((t.g, t.chunk))
            self._progress.set()
            self.moved_at = loop.time()

    def _bad_chunk(self, key: tuple[int, int], exc: CodecError) -> CodecError:
        return CodecError(f"{self.recv_link.name} sent a bad chunk (step {key[0]}, chunk {key[1]}): {exc}")

    async def _recv(self) -> wire.Frame:
        """The receive link's next frame within ``timeout``, or later while ``patient`` (a link
        that failed fails the call at once)."""
        while True:
            try:
                return await self.recv_link.recv(timeout=self.timeout)
            except LinkError:
                if self._patient is None or getattr(self.recv_link, "closed", True) or not self._patient():
                    raise

    async def _recv_chunk(self, t: Transfer, early: dict[tuple, wire.Frame]) -> wire.Frame:
        """The next frame for ``t``, or one that ``check_chunk_header`` refuses. Chunks of this call that
        come ahead of their turn wait in ``early``: while a duplicate link to the peer closes,
        each of the two links has its own reader, so the peer's chunks may arrive out of order.
        A chunk of a later call goes back to the link for that call (the peer is past this
        one, which must have been aborted), and this call fails now."""
        while True:
            frame = await self._recv()
            h = frame.header
            op, key = h.get("op"), (h.get("g"), h.get("c"))
            if h.get("t") != wire.CHUNK or not isinstance(op, int) or (op == self.op_id and key == (t.g, t.chunk)):
                return frame
            if op < self.op_id:
                continue  # left by an aborted earlier call
            if op > self.op_id:
                self.recv_link.put_back(frame)
                raise RemoteProtocolError(f"{self.recv_link.name} is already on call {op}, past this one "
                                          f"({self.op_id}): peers out of step")
            if key not in self._recv_index or key in early or key in self._arrived:
                return frame  # (``check_chunk_header`` says what is wrong with it)
            early[key] = frame

    def _absorb(self, t: Transfer, params: dict, payload: memoryview, raw: bool = False) -> None:
        dst = self.work[t.start : t.stop]
        n = t.stop - t.start
        if self.codec.is_identity or raw:
            if payload.nbytes != n * 4:
                raise CodecError(f"{payload.nbytes} bytes for {n} float32 values")
            incoming = np.frombuffer(payload, np.float32)
            if t.reduce:
                np.add(incoming, self.own[t.start : t.stop], out=dst)
            elif incoming.__array_interface__["data"][0] != dst.__array_interface__["data"][0]:
                dst[:] = incoming  # arrived before this call owned the link's allocator
            if not t.reduce:
                check_received(dst)  # (a final sum: no NaN or inf is taken)
                self._finished(t.start, dst)
                if raw and t.step < self.plan.steps - 1:
                    self._forward[(t.g, t.chunk)] = (params, None, True)  # (sent on from ``work``)
            (self._raw_pool if raw else self._pool).give(payload)
            return
        began = time.perf_counter()
        if t.reduce:
            if self.own is not self.work:
                dst[:] = self.own[t.start : t.stop]
            if (t.g, t.chunk) in self._owes:
                self._owed[(t.g, t.chunk)] = Owed((t.g, t.chunk), params, payload)  # (checked and added by the sender)
                return
            self._recv_codec.decode_add(params, payload, dst, self._recv_scratch[:n])
            self._pool.give(payload)
        else:
            self._recv_codec.decode(params, payload, dst)
            check_received(dst)  # (a final sum: no parameter takes NaN or inf)
            self._finished(t.start, dst)
            if t.step < self.plan.steps - 1:
                self._forward[(t.g, t.chunk)] = (params, payload, False)
            else:
                self._pool.give(payload)
        if self._pace is not None:
            self._pace.decoded(n, time.perf_counter() - began)
