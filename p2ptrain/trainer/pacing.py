"""When a member waits in ``step`` (the staleness pacing rule), from two measured means.

Sans-I/O: the peer measures (the seconds a batch's compute takes outside ``step``, the seconds
from a ring's start to its commit) and feeds them in; this module only decides, so the rule
is tested without sockets or clocks.

- Staleness 0: a member waits until the round holding its batch is applied (DDP).
- Staleness tau >= 1: a member contributes at most its ``share`` of the target batch, and one
  that holds its share waits for a round to take it. Otherwise it computes the next batch
  while the ring runs, unless that would hide little: when the ring takes less than
  ``OVERLAP_MIN`` of a batch's compute, overlapping saves under half a batch's time and costs
  every gradient a staleness of one, so the member waits for its round as at staleness 0
  (``lockstep``).
- Local steps (``sync_every``): inner steps go on while a round runs; at staleness 0 ``step``
  waits for the round that holds this peer's pseudo-gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

OVERLAP_MIN = 0.5  # staleness >= 1 overlaps a round with the next batch only if it takes this share of one
COMPUTE_WEIGHT = 0.1  # the weight of the newest batch in the moving mean of compute seconds
ROUND_WEIGHT = 0.2  # the weight of the newest round in the moving mean of ring seconds


@dataclass
class Pacing:
    """The two moving means the rule needs, in seconds."""

    compute_mean: float = 0.0  # a batch's compute, outside ``step``
    round_mean: float | None = None  # a ring, from its start to its commit (None: none seen yet)

    def computed(self, seconds: float) -> None:
        """One batch was computed in ``seconds`` (from the last ``step``'s end to this one's start)."""
        self.compute_mean += COMPUTE_WEIGHT * (seconds - self.compute_mean)

    def ring_took(self, seconds: float) -> None:
        """A round that carried samples took ``seconds`` from its ring's start to its commit."""
        if self.round_mean is None:
            self.round_mean = seconds
        else:
            self.round_mean += ROUND_WEIGHT * (seconds - self.round_mean)

    def lockstep(self) -> bool:
        """The ring is much quicker than a batch's compute: overlapping would hide little, so
        rounds go as at staleness 0 (a member waits for its round; a round waits for each
        member's batch in progress)."""
        return self.round_mean is not None and self.round_mean < OVERLAP_MIN * self.compute_mean


def share(target_batch_size: int | None, members: int, batch: int) -> int:
    """The most samples one member contributes to a round: the target batch (None: members x
    ``batch``, DDP's global batch) over the members, in whole batches, at least one batch."""
    members = max(1, members)
    target = target_batch_size or members * batch
    return max(1, target // members // batch) * batch


def must_wait(*, staleness: int, local_steps: bool, finished: bool, held: int, out: bool, share: int,
              lockstep: bool) -> bool:
    """Whether ``step`` waits: ``held`` samples accumulated and not taken yet, ``out``: our
    contribution is in a round; ``share`` and ``lockstep`` as above."""
    if finished:  # no round will take it: the run is over
        return False
    if local_steps:  # at staleness 0 our pseudo-gradient is applied before step() returns
        return staleness == 0 and bool(held or out)
    if staleness == 0:  # our batch is applied before step() returns
        return bool(held or out)
    if held >= share:  # our share of the target batch waits for a round
        return True
    return lockstep and bool(held or out)
