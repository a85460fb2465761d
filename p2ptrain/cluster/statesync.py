"""State transfer: a joiner downloads a snapshot from a synced member; peers of another model
are told what differs. One frame type (``wire.STATE``); its header's ``"k"`` says which step:

    joiner                                   member
    {k: ask, id, only?} + fingerprint ---->  the member's actor captures a snapshot at a round
                                             boundary (or refuses: not synced, another model);
                                             only "parameters": its trainable parameters alone
                  <----  {k: part, id, i, n, size, sync, checksum} + bytes   (n parts of PART_BYTES)
                  <----  {k: refuse, id, why, cause?}      (cause "model": another model)
    {k: model} + our fingerprint      <--->  sent both ways when the handshake's model digests
                                             differ, so each side can name the first difference

``sync`` is the member's ``SyncPoint`` (version, digest, round, epoch) at the capture and
``checksum`` the parameters' ``snapshot.tensors_checksum``: the joiner checks it on what it
decoded before it loads anything, so it is proven to hold the members' parameters before it
contributes. Nothing is unpickled: see ``p2ptrain.cluster.snapshot``.

``Assembly`` (parts in, bytes out) is pure; ``StateTransfer`` is the thin asyncio layer.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import logging
import math
import time
from typing import Callable

import msgpack
import torch

from p2ptrain.cluster import snapshot

from p2ptrain.net import wire
from p2ptrain.errors import FingerprintError, LinkError, P2PTrainError, RemoteProtocolError
from p2ptrain.taskset import TaskSet
from p2ptrain.cluster.rounds import SyncPoint
from p2ptrain.cluster.fingerprint import normalized, fingerprint_diff

log = logging.getLogger("p2ptrain.cluster.statesync")

LINEAGE = "lineage"  # a served snapshot's key for the member's History window ([[version, digest], ...])
PART_BYTES = 4 << 20  # a part is one frame: round messages interleave between parts
# A transfer is given up on when a part (PART_BYTES) takes longer than FLOOR_S plus its time at
# MIN_RATE, either way; a slow link that keeps moving (a big model over Wi-Fi) is waited for.
MIN_RATE = 10e6  # bytes/s
FLOOR_S = 20.0
ASK, PART, REFUSE, MODEL = "ask", "part", "refuse", "model"


def fingerprint_digest(fingerprint) -> str:
    """Short digest of a model fingerprint, for the handshake: equal models, equal digests."""
    return hashlib.blake2b(_fp_bytes(fingerprint), digest_size=8).hexdigest()


def _fp_bytes(fingerprint) -> bytes:
    return msgpack.packb([[name, list(shape), *rest] for name, shape, *rest in fingerprint])


def state_limit(fingerprint) -> int:
    """The largest snapshot we accept: parameters, optimizer moments and buffers several times over."""
    nbytes = sum(getattr(torch, d).itemsize * math.prod(s) for _, s, d, *_ in fingerprint)
    return 8 * nbytes + (64 << 20)


def _need(ok: bool, what: str) -> None:
    if not ok:
        raise RemoteProtocolError(f"malformed state part: {what}")


def _not_finite(state, where: str = "", depth: int = 0) -> str:
    """Where a floating-point tensor of a decoded state holds NaN or inf ("" if none does).
    One pass over each (a load is rare); ``snapshot.unpack`` bounds the depth."""
    if isinstance(state, torch.Tensor):
        return where if state.is_floating_point() and not bool(torch.isfinite(state).all()) else ""
    items = state.items() if isinstance(state, dict) else enumerate(state) if isinstance(state, (list, tuple)) else ()
    for key, value in items:
        bad = _not_finite(value, f"{where}.{key}" if where else str(key), depth + 1)
        if bad:
            return bad
    return ""


class Assembly:
    """The parts of one snapshot as they arrive, checked against the first part's header."""

    def __init__(self, header: dict, limit: int):
        size, n, sync = header.get("size"), header.get("n"), header.get("sync")
        _need(type(size) is int and 0 < size <= limit, f"size {size!r} (limit {limit})")
        _need(type(n) is int and n == -(-size // PART_BYTES), "part count")
        _need(isinstance(sync, list) and len(sync) == 4 and all(type(v) is int for v in sync[::2])
              and isinstance(sync[1], bytes) and type(sync[3]) is int, "sync point")
        _need(isinstance(header.get("checksum"), str), "checksum")
        self.size, self.n, self.checksum = size, n, header["checksum"]
        self.sync = SyncPoint(sync[0], sync[1], sync[2], sync[3])
        self.buffer = bytearray(size)
        self.next = 0

    def add(self, header: dict, payload: memoryview) -> bool:
        """Take part ``i`` (in order); True once every part is in."""
        i = header.get("i")
        _need(i == self.next and header.get("n") == self.n and header.get("size") == self.size, "out of order")
        start = i * PART_BYTES
        _need(payload.nbytes == min(PART_BYTES, self.size - start), "part length")
        self.buffer[start: start + payload.nbytes] = payload
        self.next += 1
        return self.next == self.n


class StateTransfer:
    """Serve and fetch snapshots over a mesh's STATE frames. ``on_ask(peer, ask_id,
    parameters_only)`` is the owner's: it captures a snapshot at a round boundary and calls ``serve`` or ``refuse``;
    ``on_foreign(peer, diff)`` hears what differs in a peer of another model."""

    def __init__(self, mesh, fingerprint, on_ask: Callable, on_foreign: Callable[[str, str], None]):
        self.mesh, self.fingerprint = mesh, [(n, tuple(s), *rest) for n, s, *rest in fingerprint]
        self.digest, self.limit = fingerprint_digest(self.fingerprint), state_limit(self.fingerprint)
        self._on_ask, self._on_foreign = on_ask, on_foreign
        self._ids = itertools.count(1)
        self._fetches: dict[int, tuple[str, asyncio.Queue]] = {}
        self._sending = TaskSet()  # the messages and snapshots being sent
        self._told: set[str] = set()

    async def close(self) -> None:
        """Stop sending: a snapshot half sent is abandoned."""
        await self._sending.close()

    # -- frames in ----------------------------------------------------------------------------
    def on_frame(self, peer: str, frame: wire.Frame) -> None:
        header, kind = frame.header, frame.header.get("k")
        if kind in (ASK, MODEL):
            try:
                theirs = msgpack.unpackb(frame.payload, raw=False, max_ext_len=0) if frame.payload.nbytes else None
            except Exception:  # noqa: BLE001 - any msgpack failure means "not a fingerprint"
                theirs = None
            diff = fingerprint_diff(self.fingerprint, theirs) if theirs is not None else "no model fingerprint"
            if kind == MODEL:
                self._on_foreign(peer, diff or "the same parameters, but the handshake digests differ")
                return
            if type(header.get("id")) is not int:
                raise RemoteProtocolError("malformed state ask: no id")
            if diff:  # (told in the asker's words: "here" is the asker, where its fingerprint reads)
                told = fingerprint_diff(theirs, self.fingerprint) if normalized(theirs) is not None else diff
                self.refuse(peer, header["id"], f"another model: {told}", cause=MODEL)
            else:
                self._on_ask(peer, header["id"], header.get("only") == "parameters")
        elif kind in (PART, REFUSE):
            if type(header.get("id")) is not int:  # (msgpack may give a list: unhashable)
                raise RemoteProtocolError(f"malformed state {kind}: no id")
            entry = self._fetches.get(header["id"])
            if entry is not None and entry[0] == peer:
                entry[1].put_nowait(frame)
        else:
            raise RemoteProtocolError(f"unknown state message {str(kind)[:20]!r}")

    def tell_model(self, peer: str) -> None:
        """Send our fingerprint to a peer whose handshake digest differs (once per peer)."""
        if peer not in self._told:
            self._told.add(peer)
            self._sending.spawn(self._send(peer, {"t": wire.STATE, "k": MODEL}, [_fp_bytes(self.fingerprint)]))

    # -- serving ------------------------------------------------------------------------------
    def refuse(self, peer: str, ask_id: int, why: str, cause: str | None = None) -> None:
        """Tell ``peer`` it gets no snapshot, and ``why`` (one line, for its log). ``cause``
        (MODEL: it trains another model) is what the asker branches on."""
        head = {"t": wire.STATE, "k": REFUSE, "id": ask_id, "why": why[:200]}
        self._sending.spawn(self._send(peer, {**head, "cause": cause} if cause else head))

    def serve(self, peer: str, ask_id: int, state: dict, point: SyncPoint,
              on_sent: Callable[[float | None], None] = lambda rate: None) -> None:
        """Send ``state`` (captured at ``point``) to ``peer``. Packs now, sends in the background;
        ``on_sent(rate)`` once the sending is over: the bytes a second it went at, or None if
        not every part went."""
        buffers = snapshot.pack(state)
        blob = memoryview(b"".join(buffers))
        checksum = snapshot.tensors_checksum(state["model"].items())
        n = -(-blob.nbytes // PART_BYTES)
        head = {"t": wire.STATE, "k": PART, "id": ask_id, "n": n, "size": blob.nbytes, "checksum": checksum,
                "sync": [point.version, point.digest, point.round, point.epoch]}
        self._sending.spawn(self._send_parts(peer, head, blob, on_sent))

    async def _send_parts(self, peer: str, head: dict, blob: memoryview,
                          on_sent: Callable[[float | None], None]) -> None:
        rate, began = None, time.perf_counter()
        try:
            for i in range(head["n"]):
                part = blob[i * PART_BYTES: (i + 1) * PART_BYTES]
                if not await self._send(peer, {**head, "i": i}, [part], timeout=FLOOR_S + part.nbytes / MIN_RATE):
                    return
            took = time.perf_counter() - began
            rate = blob.nbytes / took if took > 0 else None
            log.info("sent a snapshot of %.1f MB to %s in %.1f s", blob.nbytes / 1e6, peer, took)
        finally:
            on_sent(rate)

    async def _send(self, peer: str, header: dict, payload=(), timeout: float = 10.0) -> bool:
        try:
            await self.mesh.send(peer, header, payload, timeout=timeout)
            return True
        except P2PTrainError as exc:
            log.debug("state message to %s failed: %s", peer, exc)
            return False

    # -- fetching -----------------------------------------------------------------------------
    def lost(self, peer: str, why: str) -> None:
        """The link to ``peer`` is gone (``Mesh``'s ``on_lost``): a download from it fails now,
        not after ``FLOOR_S`` of silence (a donor killed mid-download sends nothing more)."""
        self._fail(peer, LinkError(f"lost the link to {peer} mid-download: {why}"))

    def donors(self) -> set[str]:
        """The peers a download is in flight from."""
        return {owner for owner, _ in self._fetches.values()}

    def silent(self, peers, seconds: float) -> None:
        """``peers`` sent nothing for ``seconds``, keepalives included (stopped, or unplugged;
        their links stay open until ``--peer-timeout``): a download from one fails now, and
        ``Cluster._fetch_state`` asks another member."""
        for peer in peers:
            self._fail(peer, LinkError(f"{peer} sent nothing for {seconds:g} s mid-download (stopped, or unplugged)"))

    def _fail(self, peer: str, error: LinkError) -> None:
        for owner, inbox in self._fetches.values():
            if owner == peer:
                inbox.put_nowait(error)

    async def fetch(self, peer: str, parameters_only: bool = False) -> tuple[dict, SyncPoint]:
        """Download, decode and check a snapshot from ``peer`` (``parameters_only``: its trainable
        parameters alone, to correct a drift). Raises ``FingerprintError`` if
        it trains another model, ``LinkError`` if it refuses, goes silent or its link is lost, and
        ``RemoteProtocolError`` if what it sends is malformed or fails its checksum."""
        ask_id, inbox = next(self._ids), asyncio.Queue()
        self._fetches[ask_id] = (peer, inbox)
        try:
            ask = {"t": wire.STATE, "k": ASK, "id": ask_id, **({"only": "parameters"} if parameters_only else {})}
            if not await self._send(peer, ask, [_fp_bytes(self.fingerprint)]):
                raise LinkError(f"cannot ask {peer} for its state: no link")
            assembly, loop = None, asyncio.get_running_loop()
            deadline = loop.time() + FLOOR_S
            while True:
                try:
                    frame = await asyncio.wait_for(inbox.get(), max(0.0, deadline - loop.time()))
                except asyncio.TimeoutError:
                    raise LinkError(f"{peer} sent no state for {FLOOR_S:.0f} s") from None
                if isinstance(frame, LinkError):  # (``lost``)
                    raise frame
                if frame.header["k"] == REFUSE:
                    why = str(frame.header.get("why", ""))[:200]
                    if frame.header.get("cause") == MODEL:
                        raise FingerprintError(f"peer {peer} trains {why}; start every peer with the same model")
                    raise LinkError(f"{peer} refused to send its state: {why}")
                if assembly is None:
                    assembly = Assembly(frame.header, self.limit)
                if assembly.add(frame.header, frame.payload):
                    break
                deadline = loop.time() + FLOOR_S + PART_BYTES / MIN_RATE  # the next part
        finally:
            self._fetches.pop(ask_id, None)
        state = snapshot.unpack(assembly.buffer)
        self.check(state, assembly.checksum, peer)
        return state, assembly.sync

    def check(self, state, checksum: str, peer: str) -> None:
        """The decoded state is our model's, and its parameters are the ones the member holds."""
        if not isinstance(state, dict) or not isinstance(state.get("model"), dict):
            raise RemoteProtocolError(f"malformed snapshot from {peer}: no model")
        model, names = state["model"], {entry[0] for entry in self.fingerprint}
        if not all(isinstance(t, torch.Tensor) for t in model.values()):
            raise RemoteProtocolError(f"malformed snapshot from {peer}: a parameter that is not a tensor")
        theirs = [(name, tuple(t.shape), str(t.dtype).removeprefix("torch."))  # (buffers are not parameters;
                  # a tensor does not say whether it is trained)
                  for name, t in model.items() if name in names]
        diff = fingerprint_diff(self.fingerprint, theirs)
        if diff:
            raise FingerprintError(f"the snapshot from {peer} is of another model: {diff}")
        if snapshot.tensors_checksum(model.items()) != checksum:
            raise RemoteProtocolError(f"the snapshot from {peer} fails its parameter checksum")
        bad = _not_finite(state)
        if bad:  # (a checksum proves what was sent, not that it can be trained on: a peer that lies)
            raise RemoteProtocolError(f"the snapshot from {peer} holds NaN or inf ({bad}): it is not loaded")
