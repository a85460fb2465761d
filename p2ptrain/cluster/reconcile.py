"""Reconciliation: replicas on different device kinds (MPS, CUDA, CPU) drift in the last bits
of the optimizer's arithmetic; the leader's parameters are the reference.

Every ``reconcile_every`` updates the trainer reports a sketch of its parameters
(``Cluster.parameters_at``, ``drift.param_sketch``); the leader sends its own to the members
(a PARAMS message, outside the round machine). A member compares the two at the same point of
the chain (version, digest):

- identical bits: nothing to do (same-kind replicas stay so, and ``identical`` counts it);
- a drift within ``drift.TOLERANCE``: nothing to do either: rounding, not worth a download
  (the largest seen is ``drift_max``; the first is logged);
- beyond it: the member downloads the leader's *parameters* (never its optimizer state) while
  it goes on taking part in rounds, and the trainer loads them when its own parameters reach
  that point (``trainer.reconcile``): nothing it computed is voided. A drift past the tolerance
  again after such a load is no rounding: the member steps its parameters otherwise (another
  learning rate, other model code); it reloads each time, and says so once, as a warning.

``Reconciler`` runs on the cluster's loop, called by its actor between events.
"""

from __future__ import annotations

import asyncio
import collections
import logging

from p2ptrain.cluster import drift
from p2ptrain.cluster import roundmsg as msg
from p2ptrain.cluster.statesync import LINEAGE
from p2ptrain.errors import P2PTrainError, RemoteProtocolError
from p2ptrain.taskset import TaskSet

log = logging.getLogger("p2ptrain.cluster.cluster")  # (the cluster's lines, under the cluster's name)

PARAMS = "params"  # the leader's parameter sketch at a (version, digest): not a round message
PARAMS_KEEP = 64  # sketches remembered per side, waiting for the other side's at the same point
_SKETCH_BYTES = drift.MAX_GROUPS * (drift.K + 3) * 8


class Reconciler:
    """Our sketches and the leader's, compared at equal points; a drift past the tolerance loads
    the leader's parameters (``transfer.fetch``, a task in the owner's ``tasks``) and hands them
    to ``trainer.reconcile``."""

    def __init__(self, peer_id: str, machine, transfer, trainer, tasks: TaskSet):
        self.peer_id, self.machine, self.transfer, self.trainer = peer_id, machine, transfer, trainer
        self._tasks = tasks
        self.reconciled = 0  # the leader's parameters downloaded because ours drifted past the tolerance
        self.compared = 0  # comparisons with the leader's sketch
        self.identical = 0  # ... of which bit-identical
        self.drift_max = 0.0  # the largest relative drift seen (drift.Drift.relative)
        self.drift_last = 0.0  # the last one
        self._own: collections.OrderedDict = collections.OrderedDict()  # (version, digest) -> sketch
        self._leader: collections.OrderedDict = collections.OrderedDict()  # ... -> (leader, sketch)
        self._said_within = False
        self._loaded_at: int | None = None  # the version of the leader's parameters last downloaded
        self._said_again = False
        self.task: asyncio.Task | None = None  # the download in progress, if any

    def forget(self) -> None:
        """A state was loaded: the sketches remembered belong to another chain."""
        self._own.clear()
        self._leader.clear()

    def on_params(self, peer: str, header: dict) -> list:
        """A parameter sketch: ours (the trainer's) or the leader's. Compare at equal points."""
        version, digest, sketch = header.get("version"), header.get("digest"), header.get("sketch")
        if not (type(version) is int and version >= 0 and isinstance(digest, bytes) and len(digest) <= 64
                and isinstance(sketch, bytes) and 0 < len(sketch) <= _SKETCH_BYTES):
            raise RemoteProtocolError("a malformed PARAMS message")
        key, m = (version, digest), self.machine
        if peer == self.peer_id:
            _remember(self._own, key, sketch)
            if m.is_leader:
                members = tuple(p for p in m.table.live_synced() if p != self.peer_id)
                return [msg.Broadcast({"t": PARAMS, **header}, members)] if members else []
        elif peer == (m.promised or (0, None))[1]:
            _remember(self._leader, key, (peer, sketch))
        else:
            return []  # (a leader we no longer follow)
        mine, theirs = self._own.get(key), self._leader.get(key)
        if mine is None or theirs is None or not m.synced or m.is_leader:
            return []
        self._leader.pop(key)
        self._own.pop(key)
        try:
            d = drift.compare(mine, theirs[1])
        except ValueError as exc:
            raise RemoteProtocolError(f"a PARAMS sketch that does not match ours: {exc}") from None
        self._count(d, theirs[0], version)
        if d.beyond and self._loaded_at is not None and version > self._loaded_at and not self._said_again:
            self._said_again = True  # (rounding stays within the tolerance: this is another update rule)
            log.warning("parameters drifted past the tolerance again after loading the leader's (relative L2 "
                        "%.1e at update %d): this peer steps them otherwise than the leader, so it reloads them "
                        "every few updates; start every peer with the same optimizer settings (--lr) and the same "
                        "model code", d.relative, version)
        if d.beyond and (self.task is None or self.task.done()):
            log.info("parameters drifted from the leader %s's after update %d: relative L2 %.1e in group %d, "
                     "beyond the tolerance %.0e; loading its parameters", theirs[0], version, d.relative, d.group,
                     drift.TOLERANCE)
            self.task = self._tasks.spawn(self._reconcile(theirs[0]))
        return []

    def _count(self, d: drift.Drift, leader: str, version: int) -> None:
        self.compared += 1
        self.identical += d.identical
        self.drift_last, self.drift_max = d.relative, max(self.drift_max, d.relative)
        if not d.identical and not d.beyond and not self._said_within:
            self._said_within = True  # (said once: device kinds round differently all the time)
            log.info("parameters differ from the leader %s's in the last bits after update %d (relative L2 "
                     "%.1e, within the tolerance %.0e: device kinds round differently); not reloading",
                     leader, version, d.relative, drift.TOLERANCE)

    async def _reconcile(self, leader: str) -> None:
        try:
            state, point = await self.transfer.fetch(leader, parameters_only=True)
            state.pop(LINEAGE, None)
        except P2PTrainError as exc:  # the next comparison beyond the tolerance tries again
            log.warning("could not load the leader's parameters to reconcile: %s", exc)
            return
        self.reconciled += 1
        self._loaded_at = point.version
        self.trainer.reconcile(state, point)


def _remember(table: collections.OrderedDict, key, value) -> None:
    table[key] = value
    while len(table) > PARAMS_KEEP:
        table.popitem(last=False)
