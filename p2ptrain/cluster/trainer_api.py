"""What the cluster asks of the trainer beside it (``Cluster``'s ``trainer``): ``Contributions``,
which every trainer gives, and ``SoloTrainer``, which a trainer that can apply batches at once
while its peer is alone adds (``AsyncPeer``'s ``trainer.contributions.Contributor`` does; the
tests' fakes do not). Every call comes on the cluster's event loop thread."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np

from p2ptrain.cluster.rounds import SyncPoint
from p2ptrain.collective.allreduce import Ready


class Contributions(Protocol):
    """What the cluster asks of the trainer (all called on the event loop's thread)."""

    def take(self, members: int, alone: bool) -> tuple[np.ndarray, int] | tuple[np.ndarray, int, Ready] | None: ...
    #                           swap the accumulator out: (float32 sum, samples) for a round of ``members``;
    #                           None: nothing yet (then call contribution_available). ``alone``: its sum will be
    #                           that very object, unread. A third element: backward still writes the sum (the
    #                           ring awaits each range of it: ``collective.allreduce.Ready``)
    def used(self, contribution: np.ndarray) -> bytes | None: ...  # (its ring ended) which parameters of
    #                                                   ``contribution`` had a gradient: ``used.encode``; None: all
    def apply(self, summed: np.ndarray, total_samples: int, used: bytes | None = None, spread: tuple | None = None
              ) -> list[tuple[int, int]] | None: ...  # committed: summed / total, in round order; total 0 (nothing
    #                                                   to apply) still counts; ``used``: the members' masks OR-ed
    #                                                   (None: all); ``spread``: (largest, squares) of the members'
    #                                                   samples (``roundmsg.spread_of``; None: not known); returns
    #                                                   the ranges of ``summed`` not applied (parameters without a
    #                                                   gradient: ``Rings.keep_owed``)
    def put_back(self, contribution: np.ndarray, samples: int, not_finite: bool = False) -> None: ...  # ``PutBack``
    def snapshot(self, parameters_only: bool = False) -> dict | None: ...  # {"model": {name: tensor}, ...} as of
    #                                                   the last apply(); None: not now
    def restore(self, state: dict) -> None: ...  # a snapshot from a member: load it, drop what was accumulated
    def reconcile(self, state: dict, point: SyncPoint) -> None: ...  # the leader's state at point: load it
    #                                                   when ours reach that point; keep what is accumulated
    def finish(self) -> None: ...  # the cluster's run is over (``ending``): stop once the last update is applied


@runtime_checkable
class SoloTrainer(Protocol):
    """A trainer that, while its peer is alone, applies each batch at once and hands the cluster
    only the rounds to commit for them (``rounds``: solo; the peer's step then never waits for a
    round). Called on the event loop's thread."""

    def solo_begin(self, r: int, version: int, last_version: int) -> bool: ...  # apply batches at once,
    #                         numbering their rounds from r, up to ``last_version`` (0: none); False: not now
    def solo_take(self) -> list[tuple[int, int, float]]: ...  # (round, samples, time.time()) of the batches
    #                                                   applied since
    def solo_end(self) -> list[tuple[int, int, float]]: ...  # no more (once none is being applied): the rest
    def solo_committed(self, point: SyncPoint, rounds: int) -> None: ...  # those rounds are committed
