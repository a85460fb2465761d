"""``Group``: a fixed set of peers and its allreduce, for people who build their own loops.

Every process of a group runs the same code::

    async with p2ptrain.Group(listen="10.0.0.2:7001", peers=["10.0.0.1:7001", "10.0.0.2:7001"]) as g:
        await g.allreduce(tensor)             # in place, sum; op="mean" averages
        await g.allreduce([t1, t2, t3])       # several tensors in one ring pass

``peers`` is the whole group, this peer included; a peer's position in it is its place in
the ring. Entering connects each peer to its two ring neighbours (the one earlier in the
list dials) and waits, up to ``connect_timeout``, until both links passed the handshake.
``tls_cert``, ``tls_key``, ``tls_ca``: mutual TLS on both links, as ``Peer``'s (``net.tls``).

Collectives are called in the same order with tensors of the same shapes on every peer,
as with torch.distributed. Any floating-point tensors are accepted, on any device: they
are summed in float32 on the host and the result is copied back in their own dtype. A
failed allreduce (a peer gone, a bad chunk) raises, and the group is then closed: open a
new one (the cluster layer of p2ptrain does that for you).
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import numpy as np
import torch

from p2ptrain.net import auth, tls, transport
from p2ptrain.codecs import parse_codec
from p2ptrain.net.discovery import parse_host_port, peer_list
from p2ptrain.collective.allreduce import AllreduceStats, RingAllreduce
from p2ptrain.trace import NO_TRACE
from p2ptrain.device import HostStaging, check_numpy_bridge
from p2ptrain.errors import ClosedError, ConfigError, GroupError, NotFiniteError, P2PTrainError
from p2ptrain.identity import new_peer_id
from p2ptrain.taskset import TaskSet
from p2ptrain.collective.pool import default_threads
from p2ptrain.collective.ring import DEFAULT_CHUNK_ELEMS, chunk_elems_for

log = logging.getLogger("p2ptrain.collective.group")
class Group:
    """A static group of peers (see the module docstring). Use as an async context manager."""

    def __init__(self, listen: str, peers: Sequence[str], *, secret: str | bytes | None = None,
                 cluster: str = "default", compression: str = "none", connect_timeout: float = 60.0,
                 timeout: float = 120.0, chunk_bytes: int = DEFAULT_CHUNK_ELEMS * 4, codec_threads: int | None = None,
                 trace=NO_TRACE, tls_cert: str | None = None, tls_key: str | None = None, tls_ca: str | None = None):
        check_numpy_bridge()
        self.peers = peer_list(peers)
        if not self.peers:
            raise ConfigError("peers is empty: list every peer of the group, this one included")
        if len(set(self.peers)) != len(self.peers):
            raise ConfigError(f"peers lists an address twice: {self.peers}")
        self.listen = str(listen).strip()
        if self.listen not in self.peers:
            raise ConfigError(f"listen={self.listen!r} is not in peers {self.peers}: "
                              "peers is the whole group, this peer included")
        if chunk_bytes < 1024 or chunk_bytes % 4:
            raise ConfigError("chunk_bytes must be a multiple of 4, at least 1024")
        self.rank = self.peers.index(self.listen)
        self.size = len(self.peers)
        self.cluster = cluster
        self.codec = parse_codec(compression)
        self.connect_timeout = connect_timeout
        self.timeout = timeout
        self.chunk_elems = chunk_bytes // 4
        # Threads for the data path (None: pool.default_threads(), by the machine's cores; 0: inline).
        self.codec_threads = default_threads() if codec_threads is None else codec_threads
        self.trace = trace  # (``p2ptrain.trace.Tracer``: every call's chunks, as spans)
        self.peer_id = new_peer_id()
        self._secret = auth.secret_from(secret)
        self._tls = tls.load(tls_cert, tls_key, tls_ca)
        self._links: dict[int, transport.Link] = {}
        self._linked = asyncio.Event()
        self._server = None
        self._dialers = TaskSet()  # dials to the later neighbours, until they link or time out
        self._lock = asyncio.Lock()
        self._next_op = 0
        self._feedback: dict[tuple, np.ndarray] = {}
        self._failure: BaseException | None = None
        self._closed = False
        self._executor: ThreadPoolExecutor | None = None  # codec work, off the event loop
        self.last_stats = AllreduceStats()

    # -- wiring ---------------------------------------------------------------------------
    @property
    def _neighbours(self) -> set[int]:
        return {(self.rank + 1) % self.size, (self.rank - 1) % self.size} - {self.rank}

    def _handshake(self) -> auth.Handshake:
        return auth.Handshake(cluster=self.cluster, peer_id=self.peer_id, secret=self._secret,
                              info={"rank": self.rank, "listen": self.listen})

    def _expected_dialer(self, hello: auth.PeerHello) -> bool:
        j = hello.info.get("rank")
        return (isinstance(j, int) and j in self._neighbours and j < self.rank
                and hello.info.get("listen") == self.peers[j] and j not in self._links)

    def _add_link(self, j: int, link: transport.Link) -> None:
        self._links[j] = link
        if self._neighbours <= self._links.keys():
            self._linked.set()

    async def _on_incoming(self, link: transport.Link) -> None:
        j = link.peer.info["rank"]
        if j in self._links or self._closed:  # a duplicate that raced past the check
            link.close()
            return
        self._add_link(j, link)

    async def _dial(self, j: int, deadline: float) -> None:
        host, port = parse_host_port(self.peers[j])
        loop = asyncio.get_running_loop()
        delay = 0.05
        while True:
            try:
                link = await transport.open_link(
                    host, port, self._handshake(), timeout=max(0.1, min(10.0, deadline - loop.time())),
                    expect=lambda h: h.info.get("rank") == j and h.info.get("listen") == self.peers[j], tls=self._tls)
            except transport.LinkError:
                if loop.time() + delay > deadline:
                    return  # __aenter__ reports who is missing
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)
                continue
            self._add_link(j, link)
            return

    async def __aenter__(self) -> "Group":
        if self._closed:
            raise ClosedError("this group was closed: create a new Group to connect again")
        auth.warn_if_open(self._secret)
        if self.size == 1:
            return self
        host, port = parse_host_port(self.listen)
        try:
            self._server = await transport.serve(host, port, self._handshake, self._on_incoming,
                                                 expect=self._expected_dialer, tls=self._tls)
        except OSError as exc:
            raise ConfigError(f"cannot listen on {self.listen}: {exc.strerror or exc}") from None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.connect_timeout
        for j in self._neighbours:
            if j > self.rank:
                self._dialers.spawn(self._dial(j, deadline))
        try:
            await asyncio.wait_for(self._linked.wait(), self.connect_timeout)
        except asyncio.TimeoutError:
            missing = sorted(self.peers[j] for j in self._neighbours - self._links.keys())
            await self.close()
            raise GroupError(f"group not formed within {self.connect_timeout:.0f} s: no link to "
                             f"{', '.join(missing)} (is p2ptrain running there, with the same peers, "
                             "cluster and secret, and is the port open?)") from None
        except BaseException:
            await self.close()
            raise
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()

    async def close(self) -> None:
        """Close every link and the listener. Idempotent."""
        await self._close()

    async def _close(self, reason: str | None = None) -> None:
        """``close``, telling the peers ``reason`` (one of ``auth``'s fixed reasons) if given."""
        self._closed = True
        await self._dialers.close()
        for link in self._links.values():
            link.close(reason)
        if self._server is not None:
            await self._server.close()
            self._server = None
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None

    # -- the collective -------------------------------------------------------------------
    async def allreduce(self, tensors, op: str = "sum", compression: str | None = None,
                        error_feedback: bool = False):
        """Sum (or average, ``op="mean"``) tensors across the group, in place; returns them.

        ``compression`` overrides the group's codec for this call (the same on every peer).
        ``error_feedback=True`` keeps what a lossy codec dropped and adds it to the next call
        with the same shapes and codec, so that nothing is lost over calls (for gradients).
        Raises ConfigError for bad arguments, and GroupError, LinkError or a
        RemoteProtocolError when the collective fails, after which the group is closed.
        """
        if op not in ("sum", "mean"):
            raise ConfigError(f"op must be 'sum' or 'mean', got {op!r}")
        single = isinstance(tensors, torch.Tensor)
        if not single and (isinstance(tensors, np.ndarray) or not hasattr(tensors, "__iter__")):
            # (an array would be taken apart into its scalars)
            raise ConfigError(f"allreduce takes a torch.Tensor or a list of them, got a {type(tensors).__name__}"
                              + (": wrap it with torch.from_numpy(array) (the sum lands in the array)"
                                 if isinstance(tensors, np.ndarray) else ""))
        items = [tensors] if single else list(tensors)
        for i, t in enumerate(items):
            if not isinstance(t, torch.Tensor):
                raise ConfigError(f"allreduce takes torch tensors; item {i} is a {type(t).__name__}: "
                                  "make it one with torch.as_tensor")
            if not t.is_floating_point():
                raise ConfigError(f"allreduce takes floating-point tensors; item {i} is {t.dtype}: "
                                  "convert it with .float()")
        codec = self.codec if compression is None else parse_codec(compression)
        async with self._lock:
            if self._closed or self._failure is not None:
                raise ClosedError("this group is closed" + (f" after a failure: {self._failure}"
                                                            if self._failure else ""))
            work, copy_back = _host_buffer(items)
            key = (tuple(t.numel() for t in items), codec.spec)
            feedback = None
            if error_feedback and not codec.lossless:
                feedback = self._feedback.setdefault(key, np.zeros(len(work), np.float32))
                np.add(work, feedback, out=work)  # what the last call dropped; the ring rewrites it
            if self.size > 1 and len(work):
                if self._executor is None and self.codec_threads:
                    self._executor = ThreadPoolExecutor(self.codec_threads, thread_name_prefix="p2ptrain-codec")
                run = RingAllreduce(work, rank=self.rank, size=self.size,
                                    send_link=self._links[(self.rank + 1) % self.size],
                                    recv_link=self._links[(self.rank - 1) % self.size],
                                    codec=codec, op_id=self._next_op,
                                    chunk_elems=chunk_elems_for(len(work), self.size, self.chunk_elems),
                                    timeout=self.timeout, residual=feedback, executor=self._executor,
                                    trace=self.trace)
                self._next_op += 1
                try:
                    self.last_stats = await run.run()
                except (P2PTrainError, OSError) as exc:
                    self._failure = exc
                    await self._close(auth.REASON_NOT_FINITE if isinstance(exc, NotFiniteError) else auth.REASON_FAILED)
                    raise
                if feedback is not None and not run.residual_owed:
                    feedback.fill(0)  # (every chunk went exact: nothing dropped, nothing owed)
            if op == "mean":
                np.divide(work, np.float32(self.size), out=work)
            copy_back()
        return tensors


def _host_buffer(items: list[torch.Tensor]):
    """A flat float32 host array holding ``items`` and a function that writes it back.

    One contiguous float32 CPU tensor is reduced in its own memory (no copy). Otherwise the
    tensors are staged through ``HostStaging`` (pinned, asynchronous copies for CUDA tensors;
    tensors on several devices are copied one by one, synchronously)."""
    if len(items) == 1:
        t = items[0]
        if t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous():
            return t.detach().view(-1).numpy(), lambda: None
    devices = {t.device for t in items}
    staging = HostStaging(sum(t.numel() for t in items), devices.pop() if len(devices) == 1 else "cpu")
    return staging.to_host(items), lambda: staging.from_host(items)
