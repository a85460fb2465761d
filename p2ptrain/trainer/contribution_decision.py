"""When this member contributes to a round, and what: the decision, pure.

Sans-I/O: no lock, no clock, no thread. The cluster asks for our contribution
(``contributions.Contributor.take``, on its loop thread); the contributor reads a ``View`` of the
trainer's state under its lock (``state.TrainerState.view``), calls ``decide`` with the ``Mode``
and the time now, and carries out the ``Decision``: drop what is too stale, then hand the round
our sum (``TAKE``), the buffer backward is still writing (``TAKE_FILLING``), or nothing yet
(``WAIT``: the round waits; ``retry_at`` says until when at the latest, after which the linger
timer asks the cluster to take again). The pseudo-gradient's own moment in local-steps mode,
decided on the caller's thread after an inner step, is ``pseudo_gradient_due``.

The rules (``Mode.staleness`` tau):

- Always: nothing while a state load waits or our last contribution is still out.
- Local steps (``sync_every``): our pseudo-gradient once ``step`` put it in the accumulator.
  With none yet, the round waits for a member still stepping, at most ``patience`` after its
  last ``step`` (a member not stepping: evaluation, a checkpoint); past that it gives an empty
  contribution, but once a round found nothing anywhere it backs off as idle (``linger``).
- tau = 0, gradient mode: our batch, once added; with overlap the buffer backward writes, once
  the ring's first bucket is written (``View.filling_ready``).
- tau >= 1: a batch in progress that would be staler than tau after this round (or, in lockstep
  at tau = 1, any batch in progress, or the next one) is waited for, at most ``patience``;
  what was accumulated on a version more than tau behind is dropped first; with nothing left, a
  member lingers ``LINGER_S`` for its batch (doubling after idle rounds, up to ``LINGER_MAX_S``)
  unless the linger has already run out for this round, or, the cluster not idle, its batch in
  progress is not due within it (from the mean step: a slower member's, not waited for).

Rounds by time (``sync_every`` a window or ``auto``, ``round_window``), local steps:
``pseudo_gradient_due`` answers "the window since our last contribution has passed" instead of
"H inner steps are owed"; ``decide``'s local-steps branch is the same for both (a round waits
for a member still stepping: its window ends within a step).
Gradient mode beside a slower member (tau >= 1): while another batch of ours belongs in the
round before the slower members' READYs (``View.more_until``, ``pacing.Pacing.fits``), the round
waits for it, at most until they are due, and for a batch in progress begun so
(``View.filling``) at most ``patience``: every batch of the round is computed on the same
parameters.
A per-parameter "had a gradient" mask (DDP's rule for parameters without one) is not decided
here: it travels with the contribution (``accumulator.Outgoing``) and is written where the
batch is (``Accumulator.add``, ``backward_feed.BackwardFeed.filled``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

LINGER_S = 0.02  # a member with nothing yet waits this long for its batch before contributing nothing
LINGER_MAX_S = 2.0  # ... doubling after each round in which no member had anything (an idle cluster:
#                    a round every 2 s, under the leader's first stall warning, half its 5 s floor)
PATIENCE_S, PATIENCE_STEPS = 2.0, 4.0  # a batch later than both (and than that many mean steps) is not waited for


class Action(enum.Enum):
    TAKE = "take"  # hand the round what is accumulated (possibly nothing: an empty contribution)
    TAKE_FILLING = "take_filling"  # hand the round the buffer backward is writing (overlap)
    WAIT = "wait"  # nothing yet: the round waits for us (``step`` or the linger timer says when)


@dataclass(frozen=True)
class Mode:
    """The settings the decision depends on (fixed for a peer's life)."""
    staleness: int
    local_steps: bool = False  # ``sync_every`` set: contributions are pseudo-gradients
    overlap: bool = False  # backward writes the round's buffer as it goes (staleness 0)


@dataclass(frozen=True)
class View:
    """The trainer's state as the decision needs it, read under the state's lock at one moment.
    Times are ``time.perf_counter()`` seconds."""
    accumulated: int  # samples in the accumulator, not contributed yet
    oldest: int | None  # the oldest parameter version among them (None: none)
    committed: int  # updates the cluster committed (applied here or queued)
    computing_on: int  # the version the batch in progress is computed on
    computing: bool  # a batch is in progress (the caller is outside ``step``)
    step_end: float  # when ``step`` last returned
    compute_mean: float  # a batch's mean compute seconds (``pacing.Pacing``)
    lockstep: bool  # rounds go as at staleness 0 (``pacing.Pacing.lockstep``)
    leaving: bool = False  # the peer is closing: a round gets what we have
    out: bool = False  # our last contribution is still in a round
    restore_waiting: bool = False  # a handed-over state waits to be loaded
    filling_ready: bool = False  # overlap: backward's buffer may be taken (first bucket written, not taken)
    linger_due: bool = False  # the linger ran out while this round waited: take what we have
    idle_rounds: int = 0  # rounds in a row in which no member had anything
    more_until: float | None = None  # another batch fits before a slower member's READY, due then
    filling: bool = False  # the batch in progress was begun for this round beside a slower member


@dataclass(frozen=True)
class Decision:
    """What to do with the round asking now. ``drop_stale``: first void what is accumulated (staler
    than the bound); ``retry_at``: with ``WAIT``, when the linger timer asks again (None: only
    ``step`` says when); ``why``: for the log."""
    action: Action
    why: str = ""
    retry_at: float | None = None
    drop_stale: bool = False


def patience(compute_mean: float) -> float:
    """How long a round waits for a member's batch after its last ``step`` returned."""
    return max(PATIENCE_S, PATIENCE_STEPS * compute_mean)


def idle_linger(idle_rounds: int) -> float:
    """How long a member with nothing waits for its batch: ``LINGER_S``, doubled per idle round."""
    return min(LINGER_MAX_S, LINGER_S * 2 ** min(idle_rounds, 16))


def _wait(why: str, retry_at: float | None = None, drop_stale: bool = False) -> Decision:
    return Decision(Action.WAIT, why, retry_at, drop_stale)


def decide(view: View, mode: Mode, now: float) -> Decision:
    """The contribution for the round asking at ``now`` (the module docstring has the rules)."""
    if view.restore_waiting or view.out:
        return _wait("a state load waits" if not view.out else "our last one is still out")
    late = now - view.step_end
    wait_for = patience(view.compute_mean)
    if mode.local_steps:
        if not view.accumulated and not view.leaving:
            if not view.computing:  # inside step(): it says when its pseudo-gradient is ready
                return _wait("inner steps")
            if late < wait_for:  # its inner steps go on: wait for them
                return _wait("inner steps", now + wait_for - late)
            # (a peer not stepping: nothing this round; its progress goes in a later one. But once
            # a round found nothing anywhere, every member is paused: back off as idle)
            if view.idle_rounds and not view.linger_due:
                return _wait("lingering for a batch", now + idle_linger(view.idle_rounds))
        return Decision(Action.TAKE)
    if mode.staleness == 0:
        if mode.overlap and not view.accumulated and view.filling_ready:  # backward still writes it: the ring reads
            return Decision(Action.TAKE_FILLING)  # each range once written
        if not view.accumulated:
            return _wait("no batch yet")
        return Decision(Action.TAKE)
    too_late = view.committed + 1 - view.computing_on > mode.staleness
    # (in lockstep at staleness 1 also a batch that would not be too late, so that each round holds
    # every member's; at 2 or more a slower member is not waited for then. That includes the next
    # batch of a member still in step() applying the last update: a quicker member's batch starts
    # the round before it computes one.)
    lockstep = mode.staleness == 1 and view.lockstep
    if late < wait_for and ((view.computing and (too_late or lockstep or view.filling))
                            or (lockstep and not view.accumulated and not view.leaving)):
        return _wait("the batch in progress" if view.computing else "the next batch", now + wait_for - late)
    drop = view.oldest is not None and view.committed - view.oldest > mode.staleness
    accumulated = 0 if drop else view.accumulated
    # (a member not waited for any more, still computing, gives nothing at once, so that the others'
    # rounds go on; so does one whose batch in progress is not due within the linger, a slower member's
    # at staleness >= 2: each round waited the linger for it, 20 ms beside fast batches of 30 ms. But
    # once a round found nothing anywhere, it backs off too: every member paused, rounds went on at
    # once, hundreds a second)
    linger = idle_linger(view.idle_rounds)
    due = view.step_end + view.compute_mean <= now + linger  # (the batch in progress, from the mean step)
    if not accumulated and not view.linger_due and (view.idle_rounds or not view.computing
                                                    or (due and late < wait_for)):
        return _wait("lingering for a batch", now + linger, drop)
    if view.more_until is not None and accumulated and not view.leaving and not view.linger_due:
        return _wait("the batches that fit before a slower member's", view.more_until, drop)
    return Decision(Action.TAKE, drop_stale=drop)


def pseudo_gradient_due(*, steps: int, every: int | None, accumulated: int, out: bool, window_s: float | None = None,
                        since: float = 0.0, now: float = 0.0, step_s: float = 0.0) -> bool:
    """Local-steps mode, after an inner step (caller's thread): the pseudo-gradient goes to the
    accumulator once it is owed and nothing of ours is accumulated or out. Owed: by count,
    ``every`` inner steps; by time (``window_s`` set, ``every`` None), at least one inner step
    and the window's end nearer now than the next step's end: ``window_s`` seconds since our
    window began (``since``: the step of our last contribution returned,
    ``TrainerState.window_began``; ``now``: the time now, both ``time.perf_counter()``), less half
    a step (``step_s``, the mean; ``round_window`` says why)."""
    if accumulated or out:
        return False
    if window_s is not None:
        return steps >= 1 and now + step_s / 2 - since >= window_s
    return steps >= every
