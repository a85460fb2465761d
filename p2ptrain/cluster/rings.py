"""``Rings``: the data path of a peer's rounds, for ``Cluster``: each round's ring-allreduce
over the mesh, its sum kept until the round commits or aborts, and error feedback's residual.
``Round``: what one round holds on this peer, from its contribution to its commit or abort.

Why apart from ``cluster``: the cluster's actor decides (events in, the machine's actions
out); this is what carries out ``StartRing``, and what ``Apply`` and ``PutBack`` do to the
buffers. It owns every buffer of the model's size that a round uses besides the trainer's.

Buckets. A round's ring runs over the buffer in buckets, its end first (``ring.bucket_bounds``):
with the trainer's overlap, backward still writes our contribution when the ring starts
(``Round.ready``), and the first bucket's ring runs on the gradients backward made first (with
a residual owed, each range is added to it as it is written: ``_PlusOwed``). Alone, the round
waits for the whole vector.

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
import dataclasses
import logging
from collections.abc import Callable

import numpy as np

from p2ptrain.cluster.roundmsg import NOT_FINITE, WITHDRAWN
from p2ptrain.codecs import Codec
from p2ptrain.collective.allreduce import AllreduceStats, Ready, RingAllreduce
from p2ptrain.collective.pool import shared_pool
from p2ptrain.collective.ring import bucket_bounds, chunk_elems_for
from p2ptrain.errors import NotFiniteError, P2PTrainError, WithdrawnError
from p2ptrain.net.mesh import Mesh
from p2ptrain.taskset import TaskSet
from p2ptrain.trace import NO_TRACE

log = logging.getLogger("p2ptrain.cluster.cluster")  # (the cluster's lines, under the cluster's name)
KEEP_RESULTS = 2  # applied sums kept for later rings to write into


@dataclasses.dataclass(eq=False)
class Round:
    """One round's state on this peer, from the machine's ``Contribute`` to its ``Apply`` or
    ``PutBack``. ``Cluster`` keeps one per round in flight, by number, and forgets it then (one
    still ``waiting`` at its Apply, once the next take has answered the machine, late);
    ``Rings`` fills in the ring's part."""

    r: int
    taken: tuple[np.ndarray, int] | None = None  # our contribution (vector, samples), once the trainer gave it
    ready: Ready | None = None  # ... while backward still writes that vector (the trainer's overlap)
    waiting: bool = False  # asked for a contribution the trainer did not have yet: the next ``take`` asks again
    began: float | None = None  # loop time our ring started (as we contributed: ``member``) ...
    flowing: float | None = None  # ... and its first chunk came (None: none did, or alone)
    others_after: float | None = None  # seconds from our READY to the last of the others' (START's)
    ring: asyncio.Task | None = None  # our ring, while it runs
    allreduce: RingAllreduce | None = None  # ... and its data path (when a chunk last came: ``moved_at``)
    stats: AllreduceStats | None = None  # what a finished ring sent
    summed: np.ndarray | None = None  # a finished ring's sum ...
    residual: np.ndarray | None = None  # ... and the residual owed once it commits (None: nothing is owed)

    @property
    def moved_at(self) -> float | None:
        """Loop time our running ring last received a chunk (None: none yet, or not running)."""
        return self.allreduce.moved_at if self.allreduce is not None else None

    @property
    def ring_began(self) -> float | None:
        """Loop time the ring's data began to move here: its first chunk (a ring started as we
        contributed waits for the others' batches first; that wait is no part of the ring's time),
        else when ours started."""
        return self.flowing if self.flowing is not None else self.began

    @property
    def samples(self) -> int:
        """Our contribution's samples (0: none taken)."""
        return self.taken[1] if self.taken is not None else 0


class _PlusOwed:
    """Our values for a ring, ``vector + owed`` (error feedback), written into ``work`` a range
    at a time as the ring reads it (and as ``ready``, backward, lets it: None, written already).
    The ring reads each of our values once, in the reduce-scatter, before any sum lands on it,
    so ``work`` can hold both. A range at a time, not the whole vector before the ring: its
    first chunk goes out after one chunk's add, and the others' adds run while chunks are on
    the wire (1 M values, N = 2 at 1 Gbit/s: the first encode began 1.4-1.7 ms after the ring
    did, most of it this add)."""

    def __init__(self, ready: Ready | None, vector: np.ndarray, owed: np.ndarray, work: np.ndarray):
        self.ready, self.vector, self.owed, self.work = ready, vector, owed, work

    async def until(self, start: int, stop: int) -> None:
        if self.ready is not None:
            await self.ready.until(start, stop)
        np.add(self.vector[start:stop], self.owed[start:stop], out=self.work[start:stop])


class Rings:
    """One peer's rings. ``start`` a round's ring (a task in the owner's ``tasks``, which
    closing cancels; ``on_done(r, ok, checksum, void)`` when it ends), then ``commit`` (its sum, for
    the trainer) or ``cancel`` it. ``void``: why a ring failed with no peer or link at fault (a
    ``roundmsg.VOID`` reason), else None. What a ring leaves (its sum, residual, stats) is the ``Round``'s."""

    def __init__(self, peer_id: str, mesh: Mesh, codec: Codec, timeout: float, tasks: TaskSet,
                 on_done: Callable[[int, bool, bytes | None, str | None], None]):
        self.peer_id, self.mesh, self.codec, self.timeout = peer_id, mesh, codec, timeout
        self._tasks, self._on_done = tasks, on_done
        # Error feedback (lossy codecs): what our encodes dropped in the rounds applied so far,
        # added to our next contribution; a round's own residual replaces it when it commits.
        self.residual: np.ndarray | None = None
        self._spare: np.ndarray | None = None  # (the buffer the next ring writes its residual into)
        self._replaced: tuple | None = None  # (what was owed before the last commit replaced it, for ``keep_owed``)
        self._free: collections.deque[np.ndarray] = collections.deque()  # (recycle: any thread)

    def sums_to_own(self, view: tuple[str, ...]) -> bool:
        """A round over ``view`` hands our contribution itself back as its sum, unread: we are
        its only member and owe no residual (the trainer may keep its batch as it is)."""
        return view == (self.peer_id,) and self.residual is None

    def start(self, rnd: Round, view: tuple[str, ...], trace=NO_TRACE, patient=None) -> None:
        """The round's ring over ``view`` (in its order), on our contribution (``rnd.taken``).
        ``patient()``: the round still waits for members' batches (no chunk timeout meanwhile)."""
        rnd.ring = self._tasks.spawn(self._ring(rnd, view, rnd.taken[0], trace, patient))

    async def _ring(self, rnd: Round, view: tuple[str, ...], vector: np.ndarray, trace, patient) -> None:
        r, ok, void, checksum = rnd.r, True, None, None
        try:
            checksum = await self._sum(rnd, view, vector, trace, patient)
        except WithdrawnError as exc:  # (not a fault: the batch changed after backward began)
            log.info("round %d: %s", r, exc)
            ok, void = False, WITHDRAWN
        except NotFiniteError:  # (nor this: a gradient overflowed, ours or one summed through us)
            log.info("round %d: the sum holds NaN or inf, which %s cannot carry", r, self.codec.name)
            ok, void = False, NOT_FINITE
        except (P2PTrainError, KeyError, ValueError) as exc:
            log.warning("round %d: ring failed: %s", r, exc)
            ok = False
        except Exception:  # a defect of ours: said with its traceback, and the round ends now, not at its deadline
            log.exception("round %d: ring failed on an internal error (please report it with this traceback)", r)
            ok = False
        rnd.ring = rnd.allreduce = None
        self._on_done(r, ok, checksum, void)

    async def _sum(self, rnd: Round, view: tuple[str, ...], vector: np.ndarray, trace, patient) -> bytes | None:
        """The round's sum into ``rnd`` (and its stats and residual); the digest of it (None alone)."""
        # The vector stays whole (an aborted round puts it back), and so does the residual
        # owed from earlier rounds: a ring writes this round's into the spare buffer.
        owed = self.residual if self.residual is not None and len(self.residual) == len(vector) else None
        ready = rnd.ready
        if view == (self.peer_id,):  # alone: the sum is our own vector (no copy, nothing to compare)
            if ready is not None:
                await ready.until(0, len(vector))
            rnd.summed = vector if owed is None else vector + owed  # (exact: nothing owed)
            return None
        # The sum goes into a buffer the trainer gave back (``recycle``: no fresh pages to fault
        # in); our values are read from ``vector`` itself (``own``), never copied first.
        work = self._buffer(len(vector))
        if owed is not None:  # (each range as the ring reads it, once backward wrote it)
            ready = _PlusOwed(ready, vector, owed, work)
        residual, self._spare, self._replaced = self._spare, None, None
        if self.codec.lossless:
            residual = None
        elif residual is None or len(residual) != len(work):
            residual = np.empty_like(work)
        rank, n = view.index(self.peer_id), len(view)
        buckets = bucket_bounds(len(work))
        run = RingAllreduce(work, rank=rank, size=n, send_link=self.mesh.channel(view[(rank + 1) % n]),
                            recv_link=self.mesh.channel(view[(rank - 1) % n]), codec=self.codec,
                            op_id=rnd.r, chunk_elems=chunk_elems_for(max(b - a for a, b in buckets), n),
                            timeout=self.timeout, residual=residual, trace=trace, digest=True,
                            executor=shared_pool(), own=vector if owed is None else None, buckets=buckets,
                            ready=ready, patient=patient)
        rnd.allreduce = run
        try:
            rnd.stats = await run.run()
        finally:
            rnd.flowing = run.first_at
        if residual is not None and not run.residual_owed:  # (every chunk went exact: the buffer stays spare)
            self._spare, residual = residual, None
        rnd.summed, rnd.residual = work, residual
        return run.sum_digest()  # (hashed a chunk at a time as the all-gather delivered them)

    def commit(self, rnd: Round, total: int) -> np.ndarray | None:
        """The round committed: its sum (None: no ring of ours finished for it); what it dropped
        is owed from now on. A round of total 0 (nobody had anything) applies nothing: what was
        owed before it is still owed (its ring carried it, and that sum is not applied)."""
        summed, residual, rnd.summed, rnd.residual = rnd.summed, rnd.residual, None, None
        self._replaced = None
        if summed is not None and not total:
            if residual is not None:
                self._spare = residual
        elif summed is not None:
            owed, self.residual = self.residual, residual
            self._replaced = (owed,)
            if owed is not None:
                self._spare = owed
        return summed

    def keep_owed(self, spans: list[tuple[int, int]] | None) -> None:
        """(right after ``commit``) The committed sum is not applied on ``spans`` (parameters no
        member had a gradient for keep ``grad`` None): what was owed there before that round is
        still owed, and what its ring dropped there (of sums of what was owed) is not."""
        if not spans or self.codec.lossless or self._replaced is None:  # (no residual replaced: it is owed still)
            return
        (before,), owed, self._replaced = self._replaced, self.residual, None
        if owed is None:
            if before is None:
                return
            owed = self.residual = np.zeros_like(before)
        for a, b in spans:
            owed[a:b] = 0.0 if before is None else before[a:b]

    def cancel(self, rnd: Round) -> None:
        """The round aborted: stop its ring if it runs, forget its sum (and its residual: the one
        owed before it is still owed)."""
        if rnd.ring is not None:
            rnd.ring.cancel()
        rnd.ring = rnd.allreduce = rnd.summed = rnd.residual = rnd.stats = None

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
