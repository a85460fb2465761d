"""``Rings``: the data path of a peer's rounds, for ``Cluster``: each round's ring-allreduce
over the mesh, its sum kept until the round commits or aborts, and error feedback's residual.

Why apart from ``cluster``: the cluster's actor decides (events in, the machine's actions
out); this is what carries out ``StartRing``, and what ``Apply`` and ``PutBack`` do to the
buffers. It owns every buffer of the model's size that a round uses besides the trainer's.

Error feedback. With a lossy codec, what this peer's encodes dropped in a round (its
``residual``: of its own contribution and of the partial sums it forwarded) is added to its
contribution in the next round, so the applied updates plus what is still owed always sum to
the gradients computed. It is owed from the round's commit on; an aborted round, and a round
in which nobody had anything (total 0: its sum is not applied), leave the residual owed before
it as it was (two buffers of the model's size: the owed one, and the one a ring writes).
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable

import numpy as np

from p2ptrain.codecs import Codec
from p2ptrain.collective.allreduce import RingAllreduce
from p2ptrain.collective.pool import shared_pool
from p2ptrain.collective.ring import chunk_elems_for
from p2ptrain.errors import P2PTrainError
from p2ptrain.net.mesh import Mesh
from p2ptrain.taskset import TaskSet
from p2ptrain.trace import NO_TRACE

log = logging.getLogger("p2ptrain.cluster.cluster")  # (the cluster's lines, under the cluster's name)
KEEP_RESULTS = 2  # applied sums kept for later rings to write into


class Rings:
    """One peer's rings. ``start`` a round's ring (a task in the owner's ``tasks``, which
    closing cancels; ``on_done(r, ok, checksum)`` when it ends), then ``commit`` (its sum, for
    the trainer) or ``cancel`` it."""

    def __init__(self, peer_id: str, mesh: Mesh, codec: Codec, timeout: float, tasks: TaskSet,
                 on_done: Callable[[int, bool, bytes | None], None]):
        self.peer_id, self.mesh, self.codec, self.timeout = peer_id, mesh, codec, timeout
        self._tasks, self._on_done = tasks, on_done
        self._running: dict[int, asyncio.Task] = {}  # the rings running, by round
        self.stats: dict[int, object] = {}  # a finished ring's ``RingStats``, until the round is recorded
        # A finished ring's sum, and the residual owed once it commits (None: nothing is owed).
        self._results: dict[int, tuple[np.ndarray, np.ndarray | None]] = {}
        # Error feedback (lossy codecs): what our encodes dropped in the rounds applied so far,
        # added to our next contribution; a round's own residual replaces it when it commits.
        self.residual: np.ndarray | None = None
        self._spare: np.ndarray | None = None  # (the buffer the next ring writes its residual into)
        self._free: collections.deque[np.ndarray] = collections.deque()  # (recycle: any thread)

    def start(self, r: int, view: tuple[str, ...], vector: np.ndarray, trace=NO_TRACE) -> None:
        """Round r's ring over ``view`` (in its order), on our contribution ``vector``."""
        self._running[r] = self._tasks.spawn(self._ring(r, view, vector, trace))

    async def _ring(self, r: int, view: tuple[str, ...], vector: np.ndarray, trace) -> None:
        # The vector stays whole (an aborted round puts it back), and so does the residual
        # owed from earlier rounds: a ring writes this round's into the spare buffer.
        owed = self.residual if self.residual is not None and len(self.residual) == len(vector) else None
        if view == (self.peer_id,):  # alone: the sum is our own vector (no copy, nothing to compare)
            self._results[r] = (vector if owed is None else vector + owed, None)  # (exact: nothing owed)
            self._running.pop(r, None)
            self._on_done(r, True, None)
            return
        # The sum goes into a buffer the trainer gave back (``recycle``: no fresh pages to fault
        # in); our values are read from ``vector`` itself (``source``), never copied first.
        work = self._buffer(len(vector))
        if owed is not None:
            np.add(vector, owed, out=work)
        residual, self._spare = self._spare, None
        if self.codec.lossless:
            residual = None
        elif residual is None or len(residual) != len(work):
            residual = np.empty_like(work)
        ok = True
        try:
            rank, n = view.index(self.peer_id), len(view)
            run = RingAllreduce(work, rank=rank, size=n, send_link=self.mesh.channel(view[(rank + 1) % n]),
                                recv_link=self.mesh.channel(view[(rank - 1) % n]), codec=self.codec,
                                op_id=r, chunk_elems=chunk_elems_for(len(work), n), timeout=self.timeout,
                                residual=residual, trace=trace, digest=True, executor=shared_pool(),
                                source=vector if owed is None else None)
            self.stats[r] = await run.run()
            self._results[r] = (work, residual)
            checksum = run.sum_digest()  # (hashed a chunk at a time as the all-gather delivered them)
        except (P2PTrainError, KeyError, ValueError) as exc:
            log.warning("round %d: ring failed: %s", r, exc)
            ok, checksum = False, None
        self._running.pop(r, None)
        self._on_done(r, ok, checksum)

    def commit(self, r: int, total: int) -> np.ndarray | None:
        """Round r committed: its sum (None: no ring of ours finished for it); what it dropped
        is owed from now on. A round of total 0 (nobody had anything) applies nothing: what was
        owed before it is still owed (its ring carried it, and that sum is not applied)."""
        summed, residual = self._results.pop(r, (None, None))
        if summed is not None and not total:
            if residual is not None:
                self._spare = residual
        elif summed is not None:
            owed, self.residual = self.residual, residual
            if owed is not None:
                self._spare = owed
        return summed

    def cancel(self, r: int) -> None:
        """Round r aborted: stop its ring if it runs, forget its sum (and its residual: the one
        owed before it is still owed)."""
        ring = self._running.pop(r, None)
        if ring is not None:
            ring.cancel()
        self._results.pop(r, None)
        self.stats.pop(r, None)

    def forget_residual(self) -> None:
        """A state was loaded: what was owed is for gradients voided with the accumulator."""
        self.residual = None

    def recycle(self, summed: np.ndarray) -> None:
        """The trainer is done with an applied sum (any thread): a later ring writes into it."""
        if len(self._free) < KEEP_RESULTS:
            self._free.append(summed)

    def _buffer(self, n: int) -> np.ndarray:
        while self._free:
            buffer = self._free.pop()
            if len(buffer) == n:
                return buffer
        return np.empty(n, np.float32)
