"""``AsyncPeer``: a training loop's view of the cluster (asyncio). Staleness 0 for now.

    async with p2ptrain.AsyncPeer(model, optimizer, peers=["10.0.0.1:7000"], min_peers=2) as peer:
        for x, y in loader:
            loss = F.cross_entropy(model(x.to(peer.device)), y.to(peer.device))
            loss.backward()
            await peer.step(batch_size=len(x))

``step`` adds the batch's gradient, weighted by its sample count, into an accumulator on the
model's device, offers it to the next round, and (staleness 0) returns once a round that
holds it was applied: every member then set its gradients to ``sum(G_i) / sum(n_i)`` and ran
its own optimizer step on the same values. An aborted round puts the contribution back and
the next round carries it, so no sample is lost.

Peers find each other by discovery (UDP beacons on the LAN) and through ``peers``; with
``discovery=False`` only ``peers`` is used. Today every peer must start from the same
parameters (same seed): joining a running
cluster needs the state transfer that is not built yet (such a peer is refused with a log
line). Asynchronous rounds (``staleness >= 1``) come with it.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from typing import Sequence

import numpy as np
import torch

from p2ptrain import auth
from p2ptrain.cluster import Cluster
from p2ptrain.device import device_kind
from p2ptrain.discovery import Discovery, parse_host_port
from p2ptrain.errors import ConfigError, GroupError
from p2ptrain.identity import new_peer_id
from p2ptrain.rounds import RoundConfig
from p2ptrain.tasks import model_fingerprint, param_checksum

log = logging.getLogger("p2ptrain.peer")


def _listen_address(listen: str) -> tuple[str, int]:
    """``host:port`` to listen on; port 0 means any free port."""
    host, _, port = str(listen).strip().rpartition(":")
    if not host or not port.isdigit() or int(port) > 65535:
        raise ConfigError(f"listen={listen!r}: expected host:port, e.g. 0.0.0.0:7000 (port 0: any free port)")
    return host.strip("[]"), int(port)


class AsyncPeer:
    """One member of a training cluster, for asyncio programs. See the module docstring."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, cluster: str = "default",
                 secret: str | bytes | None = None, peers: Sequence[str] = (), listen: str = "0.0.0.0:0",
                 discovery: bool = True, interface: str | None = None, compression: str = "none",
                 staleness: int = 0, min_peers: int = 1, clip_grad_norm: float | None = None,
                 step_timeout: float = 300.0):
        if staleness != 0:
            raise ConfigError("staleness must be 0 for now (asynchronous rounds are not built yet)")
        if min_peers < 1:
            raise ConfigError("min_peers must be at least 1")
        self.model, self.optimizer = model, optimizer
        self.params = [p for p in model.parameters() if p.requires_grad]
        if not self.params:
            raise ConfigError("the model has no parameters that require gradients")
        self.device = self.params[0].device
        self.peer_id = new_peer_id()
        self.clip_grad_norm = clip_grad_norm
        self.step_timeout = step_timeout
        self.version = 0  # rounds applied here
        self._peers = [p.strip() for p in peers if p.strip()]
        for p in self._peers:
            parse_host_port(p)
        self._cluster_name, self._secret = cluster, auth.secret_from(secret)
        self._discovery_on, self._interface = discovery, interface
        self.discovery: Discovery | None = None
        host, port = _listen_address(listen)
        numel = sum(p.numel() for p in self.params)
        self._acc = torch.zeros(numel, dtype=torch.float32, device=self.device)
        self._samples = 0
        self._in_flight = 0  # samples taken by a round not yet applied or put back
        self._changed = asyncio.Event()
        checksum = hashlib.blake2b(param_checksum(model).encode(), digest_size=16).digest()
        self.cluster = Cluster(peer_id=self.peer_id, source=self, checksum=checksum, cluster=cluster,
                               secret=self._secret, host=host, port=port, compression=compression,
                               config=RoundConfig(min_peers=min_peers), fingerprint=model_fingerprint(model))
        self._proposer: asyncio.Task | None = None

    async def __aenter__(self) -> "AsyncPeer":
        await self.cluster.__aenter__()
        # Beacons announce the mesh's port; discovery (or just --peers) proposes addresses.
        self.discovery = Discovery(self._cluster_name, self.peer_id, self.cluster.port, self._secret,
                                   device=device_kind(self.device), static_peers=self._peers,
                                   interface=self._interface, enabled=self._discovery_on)
        try:
            await self.discovery.__aenter__()
        except BaseException:
            await self.cluster.close()
            raise
        self._proposer = asyncio.get_running_loop().create_task(self._propose())
        return self

    async def __aexit__(self, *exc) -> None:
        if self._proposer is not None:
            self._proposer.cancel()
            await asyncio.gather(self._proposer, return_exceptions=True)
        await self.cluster.close()
        if self.discovery is not None:
            await self.discovery.__aexit__(None, None, None)

    async def _propose(self) -> None:
        """Keep offering every address heard or given to the mesh (it skips those linked)."""
        while True:
            for host, port in self.discovery.addresses():
                self.cluster.propose(host, port)
            await asyncio.sleep(0.5)

    # -- the training loop's side -----------------------------------------------------------
    async def step(self, batch_size: int) -> None:
        """Contribute this batch's gradients (after ``loss.backward()``); return once applied."""
        if batch_size < 1:
            raise ConfigError(f"batch_size must be at least 1, got {batch_size}")
        with torch.no_grad():
            offset = 0
            for p in self.params:
                n = p.numel()
                if p.grad is not None:
                    self._acc[offset : offset + n].add_(p.grad.reshape(-1), alpha=float(batch_size))
                    p.grad = None
                offset += n
        self._samples += batch_size
        self.cluster.contribution_available()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.step_timeout
        while self._samples or self._in_flight:  # staleness 0: wait until our batch is applied
            self.cluster.check()
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                raise GroupError(f"no round applied this peer's batch within {self.step_timeout:.0f} s "
                                 f"(peers linked: {', '.join(self.cluster.mesh.peers) or 'none'})") from None

    # -- the cluster's side (Contributions) ---------------------------------------------------
    def take(self) -> tuple[np.ndarray, int] | None:
        if not self._samples:
            return None
        host = self._acc.to("cpu").numpy().copy()
        samples, self._samples, self._in_flight = self._samples, 0, self._samples
        self._acc.zero_()
        return host, samples

    def apply(self, summed: np.ndarray, total_samples: int) -> None:
        grad = torch.from_numpy(summed).to(self.device).div_(float(total_samples))
        offset = 0
        for p in self.params:
            n = p.numel()
            p.grad = grad[offset : offset + n].view_as(p).to(p.dtype).clone()
            offset += n
        if self.clip_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.params, self.clip_grad_norm)
        self.optimizer.step()
        for p in self.params:
            p.grad = None
        self.version += 1
        self._in_flight = 0
        self._changed.set()

    def put_back(self, contribution: np.ndarray, samples: int) -> None:
        self._acc.add_(torch.from_numpy(contribution).to(self.device))
        self._samples += samples
        self._in_flight = 0
        self._changed.set()
