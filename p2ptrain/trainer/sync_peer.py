"""``Peer``: p2ptrain for an ordinary (synchronous) PyTorch loop.

    peer = p2ptrain.Peer(model, optimizer, cluster="lab", compression="int8", staleness=1)
    with peer:                                   # discover, join, sync state
        for x, y in loader:
            loss = F.cross_entropy(model(x.to(peer.device)), y.to(peer.device))
            loss.backward()
            peer.step(batch_size=len(x))         # contribute; apply averaged updates

The blocking front end over the same core as ``AsyncPeer`` (same keywords, same semantics):
it holds an ``AsyncPeer`` (its settings, its state, the properties read here) and drives that
peer's ``Lifetime`` (``lifetime``, reached by ``peer.lifetime_of``) as ``AsyncPeer`` does, blocking
where that one awaits. The cluster runs on its own event loop on a daemon thread, and ``step``
does its work on the caller's thread, crossing to that loop only when it must wait. Exceptions
raised there (``GroupError``, ``FingerprintError``, ``ClosedError``) reach the caller with
their own type. ``close`` (or leaving the ``with`` block) leaves the cluster politely.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from p2ptrain.trainer.options import PEER_TIMEOUT
from p2ptrain.trainer.peer import RECONCILE_EVERY, AsyncPeer, lifetime_of

if TYPE_CHECKING:
    from typing_extensions import Self


def _forwarded(name: str, doc: str | None = None):
    """``AsyncPeer``'s property, method or attribute ``name``, read from the wrapped peer, with its
    docstring (``doc`` for an attribute of the instance)."""
    attr = getattr(AsyncPeer, name, None)
    if attr is None or isinstance(attr, property):
        return property(lambda self: getattr(self._peer, name), doc=doc or getattr(attr, "__doc__", None))

    def method(self, *args, **kwargs):
        return getattr(self._peer, name)(*args, **kwargs)
    method.__name__, method.__doc__ = name, attr.__doc__
    return method


class Peer:
    """One member of a training cluster, for a synchronous loop. Keywords: see ``AsyncPeer``."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, cluster: str = "default",
                 secret: str | bytes | None = None, peers: Sequence[str] = (), listen: str = "0.0.0.0:0",
                 discovery: bool = True, interface: str | None = None, compression: str = "none",
                 staleness: int = 0, target_batch_size: int | None = None, min_peers: int = 1,
                 device: str | torch.device | None = None, clip_grad_norm: float | None = None,
                 scheduler: Any = None, step_timeout: float = 300.0, reconcile_every: int = RECONCILE_EVERY,
                 weight_prediction: bool = False, seed: int | None = None, max_rounds: int | None = None,
                 duration: float | None = None, sync_every: int | str | None = None, outer_lr: float | None = None,
                 outer_momentum: float | None = None, overlap: bool = False, peer_timeout: float = PEER_TIMEOUT,
                 tls_cert: str | None = None, tls_key: str | None = None, tls_ca: str | None = None):
        self._peer = AsyncPeer(model, optimizer, cluster=cluster, secret=secret, peers=peers, listen=listen,
                               discovery=discovery, interface=interface, compression=compression,
                               staleness=staleness, target_batch_size=target_batch_size, min_peers=min_peers,
                               device=device, clip_grad_norm=clip_grad_norm, scheduler=scheduler,
                               step_timeout=step_timeout, reconcile_every=reconcile_every,
                               weight_prediction=weight_prediction, seed=seed,
                               max_rounds=max_rounds, duration=duration, sync_every=sync_every,
                               outer_lr=outer_lr, outer_momentum=outer_momentum, overlap=overlap,
                               peer_timeout=peer_timeout, tls_cert=tls_cert, tls_key=tls_key, tls_ca=tls_ca)
        self._lifetime = lifetime_of(self._peer)  # its loop thread: what start, step and close drive

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._leave(flush=exc_type is None)

    def start(self) -> None:
        """Open the peer (what ``with peer:`` does): listen, discover, join."""
        with self._lifetime.opening() as opened:
            self._lifetime.wait(opened)

    def close(self) -> None:
        """Leave the cluster politely (after a bounded wait for this peer's last samples)."""
        self._leave(flush=True)

    def _leave(self, flush: bool) -> None:
        with self._lifetime.closing(flush) as left:
            if left is not None:
                self._lifetime.wait(left)

    def step(self, batch_size: int) -> int:
        """After ``loss.backward()``: contribute this batch, apply the updates committed since
        the last call (returns how many). Blocks only as the staleness bound requires."""
        return self._step(batch_size)

    def _step(self, batch_size: int, scaled=None) -> int:
        """``step``; ``scaled``: the gradients carry GradScaler's loss scale (``DistributedOptimizer``
        with overlap, ``overlap.ScaledStep``)."""
        waiting = self._lifetime.begin_step(batch_size, scaled)
        if waiting is not None:
            self._lifetime.wait(waiting)
        return self._lifetime.end_step()

    state_dict = _forwarded("state_dict")
    load_state_dict = _forwarded("load_state_dict")
    param_checksum = _forwarded("param_checksum")
    model, module, optimizer, device, peer_id = (_forwarded(n) for n in ("model", "module", "optimizer", "device",
                                                                         "peer_id"))
    version, metrics, history, dropped = (_forwarded(n) for n in ("version", "metrics", "history", "dropped"))
    unapplied = _forwarded("unapplied", "Samples stepped that no round took before this peer left (a batch in "
                                        "flight when it was stopped; local steps not sent): known once closed.")
    staleness_max, finished, corrected, members = (_forwarded(n) for n in (
        "staleness_max", "finished", "corrected", "members"))
    cluster = _forwarded("cluster", "The ``Cluster`` (rounds, mesh, ``reconciled``, ``loads``) once started: for "
                                    "inspection.")

    @property
    def port(self) -> int:
        """The TCP port this peer listens on (once started)."""
        return self._peer.cluster.port
