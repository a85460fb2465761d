"""Reconciliation: replicas on different device kinds (MPS, CUDA, CPU) drift in the last bits
of the optimizer's arithmetic; the leader's parameters are the reference.

The trainer reports its parameter checksum after an update (``Cluster.parameters_at``); the
leader sends its own to the members (a PARAMS message, outside the round machine). A member
whose checksum at the same point of the chain (version, digest) differs downloads the
leader's state while it goes on taking part in rounds, and the trainer loads it when its own
parameters reach that point (``source.reconcile``): nothing it computed is voided.

``Reconciler`` runs on the cluster's loop, called by its actor between events.
"""

from __future__ import annotations

import asyncio
import collections
import logging

from p2ptrain.cluster import roundmsg as msg
from p2ptrain.cluster.statesync import LINEAGE
from p2ptrain.errors import P2PTrainError, RemoteProtocolError

log = logging.getLogger("p2ptrain.cluster.cluster")  # (the cluster's lines, under the cluster's name)

PARAMS = "params"  # the leader's parameter checksum at a (version, digest): not a round message
PARAMS_KEEP = 64  # checksums remembered per side, waiting for the other side's at the same point


class Reconciler:
    """Our checksums and the leader's, compared at equal points; a difference loads the
    leader's state (``transfer.fetch``) and hands it to ``source.reconcile``."""

    def __init__(self, peer_id: str, machine, transfer, source):
        self.peer_id, self.machine, self.transfer, self.source = peer_id, machine, transfer, source
        self.reconciled = 0  # leader states downloaded because our parameters differed from its
        self._own_sums: collections.OrderedDict = collections.OrderedDict()  # (version, digest) -> checksum
        self._leader_sums: collections.OrderedDict = collections.OrderedDict()  # ... -> (leader, checksum)
        self.task: asyncio.Task | None = None  # the download in progress, if any

    def forget(self) -> None:
        """A state was loaded: the checksums remembered belong to another chain."""
        self._own_sums.clear()
        self._leader_sums.clear()

    def on_params(self, peer: str, header: dict) -> list:
        """A parameter checksum: ours (the trainer's) or the leader's. Compare at equal points."""
        version, digest, checksum = header.get("version"), header.get("digest"), header.get("checksum")
        if not (type(version) is int and version >= 0 and isinstance(digest, bytes) and len(digest) <= 64
                and isinstance(checksum, str) and 0 < len(checksum) <= 64):
            raise RemoteProtocolError("a malformed PARAMS message")
        key, m = (version, digest), self.machine
        if peer == self.peer_id:
            _remember(self._own_sums, key, checksum)
            if m.is_leader:
                members = tuple(p for p in m.table.live_synced() if p != self.peer_id)
                return [msg.Broadcast({"t": PARAMS, **header}, members)] if members else []
        elif peer == (m.promised or (0, None))[1]:
            _remember(self._leader_sums, key, (peer, checksum))
        else:
            return []  # (a leader we no longer follow)
        mine, theirs = self._own_sums.get(key), self._leader_sums.get(key)
        if mine is None or theirs is None or mine == theirs[1] or not m.synced or m.is_leader:
            return []
        self._leader_sums.pop(key)
        if self.task is None or self.task.done():
            log.info("parameters differ from the leader %s's after update %d (%s here, %s there: device kinds "
                     "round differently); loading its state", theirs[0], version, mine[:8], theirs[1][:8])
            self.task = asyncio.get_running_loop().create_task(self._reconcile(theirs[0]))
        return []

    async def _reconcile(self, leader: str) -> None:
        try:
            state, point = await self.transfer.fetch(leader)
            state.pop(LINEAGE, None)
        except P2PTrainError as exc:  # the next comparison that differs tries again
            log.warning("could not load the leader's state to reconcile: %s", exc)
            return
        self.reconciled += 1
        self.source.reconcile(state, point)


def _remember(table: collections.OrderedDict, key, value) -> None:
    table[key] = value
    while len(table) > PARAMS_KEEP:
        table.popitem(last=False)
