"""When a member waits in ``step`` (the staleness pacing rule), from two measured means.

Sans-I/O: the peer measures (the seconds a batch's compute takes outside ``step``, the seconds
from a ring's start to its commit) and feeds them in; this module only decides, so the rule
is tested without sockets or clocks.

- Staleness 0: a member waits until the round holding its batch is applied (DDP).
- Staleness tau >= 1: a member contributes at most its ``share`` of the target batch, and one
  that holds its share waits for a round to take it. Otherwise it computes the next batch
  while the ring runs, but only where that pays (``lockstep`` says when it does not: then the
  member waits for its round, and a round for each member's batch in progress, as at
  staleness 0). Overlapping a ring of ``r`` seconds with a batch of ``c`` makes a batch come
  ``(c + r) / max(c, r)`` times as often (at most 2x, at ``r == c``), and costs every gradient
  a staleness of one, which costs updates: with Adam on the synthetic task (1 M parameters,
  lr 1e-3, 32 samples an update) a smoothed loss of 1.0 took 100 updates one update late
  against 54 fresh (10 M parameters: 77 against 23), and 61 with weight prediction. So
  overlapping pays only where its gain beats ``DELAY_COST`` (``PREDICTED_DELAY_COST`` with
  weight prediction): without prediction, practically never (a gain of 2 needs ``r == c``).
  Until a round has been timed a member of a cluster of two or more waits, as at staleness 0
  (its first round times the ring; before, the batch computed beside that round came an update
  late, the one way staleness 1's rounds differed from staleness 0's where overlap does not pay).
  A peer alone overlaps (no ring of others will time it: its own rounds take no time to wait for).
  The modelled gain is a bound: it leaves out ``step``'s own work (the batch copied out of
  ``.grad``, the update, weight prediction's passes), which overlap adds to every period and the
  ring slows where the cores are few. So the rule also measures: a batch's period (from one
  ``step``'s start to the next) in lockstep over ``LOCKSTEP_PERIODS`` batches before it first
  overlaps, then over ``REALIZED_ROUNDS`` while overlapping, and where lockstep's median period
  over overlap's is under the delay's cost, it goes back to lockstep (``refuted``) for
  ``RETRY_AFTER`` batches, then overlaps again and measures anew (the regime may have changed: a
  peer joined or left, a device warmed up); each refutation in a row doubles the wait, up to
  ``RETRY_MAX``, so a regime where overlap never pays loses at most 8 late batches in 64, then
  in 4,096. Before, a refutation was for good: a run whose first batches were atypical (a GPU's
  first steps, a cluster forming) stayed in lockstep to its end.
  Measured on 2 cores with weight prediction, the host idle 8 ms a batch (as beside a GPU), N = 2:
  a modelled 1.5-1.8 realized about 1.06 (the training thread's period: 10 ms of compute and
  5-8 ms of ``step``'s own work, the ring beside it), and each run needed 17-19 % more rounds
  to the loss, 1.07-1.36 s against staleness 0's 1.01-1.12 s. With the measure it goes back to
  lockstep after 17 batches: 1.04, 0.97, 1.11 s against 1.05, 1.06, 1.08. Where overlap does
  pay (100 Mbit/s, host idle 80 ms a batch: modelled 1.96-1.98, realized 1.75-1.83) it stays:
  6.02 s to the loss against staleness 0's 7.51 s.
- Beside a slower member (staleness tau >= 1, no ``target_batch_size``): a round in lockstep
  waits for each member's batch, so a faster member would idle in ``step`` until the slowest's
  READY every round. It computes on instead, on the same parameters, and holds its contribution
  while another batch ends before the others' READYs are due (``fits``: timed from the moment
  its batches reached its share, over the last ``HELD_ROUNDS`` rounds, the earliest trusted,
  from ``HELD_FIRST`` on; at most ``SPARE_MAX`` batches over its share): every batch of the
  round is fresh, and the mean weighs them by samples with the others'. Members alike are due
  when we are, so they add nothing (DDP's global batch). Once one batch is added, so is any that
  begins before the others are due: the round waits up to a batch for ours, since the faster
  member's seconds are worth more samples than the slower's. START says how long before the
  last READY each member's came (``roundmsg.ready_offsets``), so the others' READYs are timed
  against ours as the leader heard both: a delay common to every member (the commit's apply, a
  loaded host) cancels. Timed from the commit instead, two members alike in one process on a
  loaded 2-core host saw each other's READYs 20-43 ms after it, against batches of 10-16 ms,
  and one added two batches in 1 of 15 runs. The
  GPU-like 9 M pair (``bench/uneven.py --model 9m --netns 1gbit --gpu-like --batch-size 64
  --target 0.75``, one run, the two rules side by side): beside a peer 3.7x slower 0.87 of the
  two alone's samples/s against 0.73 with whole batches before the READY only, 0.38x the fast
  peer's time to the loss against 0.45x; 10x slower 1.05 against 1.00, 0.71x against 0.70x,
  final loss 0.587 against 0.606. The 9 M model at batch 64 (``bench/uneven.py --model 9m``,
  2 cores, quiet) reached its loss in 0.31-0.45x the fast peer's time alone beside a peer 3.7x slower
  and 0.46-0.63x beside one 10x slower (three runs each), against 0.60-0.65x and 1.44x or never
  with one batch a member a round (``target_batch_size`` 128). Batches computed while a
  contribution is out instead go into the next round one update late, and lose (0.93 against
  0.69 at the end of a loaded run), as ``DELAY_COST`` says.
- Local steps (``sync_every``): inner steps go on while a round runs; at staleness 0 ``step``
  waits for the round that holds this peer's pseudo-gradient, and so it does at staleness >= 1
  where the machine has no core to spare (``cores_short``: its threads waited runnable for a
  CPU more than ``QUEUED_LIMIT`` of the time they could run, a moving mean sampled as each
  pseudo-gradient is formed, from the first one on, and short until a share is measured that
  can be trusted; Linux only, elsewhere it steps on).
  Stepping on while the ring runs pays where the ring does not need the cores the compute uses
  (a wire, a GPU's compute): the outer update lands some steps late, which costs less than
  waiting for it (``bench/local_steps_sim.py``: N = 4, H = 8, 51 inner steps to the loss with
  the update at once, 53 two steps late, 84 eight late; waiting costs the ring's whole time every
  round). Where compute and ring share too few cores, the ring beside the compute takes as long
  as both, the update lands later still, and the steps taken meanwhile are not free. Measured on
  2 cores at 1 Gbit/s (H = 8, int8; ``bench/lan.py --local 4 --netns 1gbit --sync-every 8
  --local-staleness 0,1``): four peers waited for a CPU 41-49 % of the time; stepping on took
  0.9-2.0x waiting's time to the loss (1.2-1.5x in most runs). With this rule they wait, with
  staleness 0's rounds and samples (400 steps, six runs each, interleaved: 1.12-1.54 s against
  1.33-1.54 s at staleness 0; the spread is the machine's). The first share is measured over the
  second round: one from the peer's start took in the cluster forming, came out low, and every
  peer stepped on for the first rounds. Two peers there waited 20-39 %, about the limit: they
  step on in most rounds, 0.58-1.12 s against staleness 0's 0.97-1.53 s (six runs each).
  A first share under ``FIRST_TRUSTED`` starts the mean (a core to itself: 0.03-0.04 for a peer
  beside a 4x slower one, pinned); a higher one starts it only with the second, from the larger
  of the two. While every peer waits, the last to finish its steps runs with the cores to itself
  a while, so one round's share can come out low (N = 4: 0.15, then 0.5 every round after), and a
  peer that stepped on in rounds 2 and 3 cost the run 15-60 % more samples to the loss; waiting one more round for every first share cost the fast
  peer beside the slow one about a sixth of its samples/s over that benchmark's 13 rounds.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

DELAY_COST = 2.0  # times the updates to a loss when every gradient is one update late (1.85 measured)
PREDICTED_DELAY_COST = 1.25  # the same with weight prediction (batches computed on predicted parameters)
COMPUTE_WEIGHT = 0.1  # the weight of the newest batch in the moving mean of compute seconds
ROUND_WEIGHT = 0.2  # the weight of the newest round in the moving mean of ring seconds
QUEUED_LIMIT = 0.3  # local steps: waiting runnable for a CPU above this share of the time: no core to spare
QUEUED_WEIGHT = 0.3  # the weight of the newest round in the moving mean of that share
FIRST_TRUSTED = 0.1  # a first share below this starts the mean alone; a higher one waits for a second
LOCKSTEP_PERIODS = 8  # a batch's period measured in lockstep this many times before overlap is tried
REALIZED_ROUNDS = 8  # and while overlapping this many times before what it realized may overrule the model
RETRY_AFTER = 64  # batches in lockstep after overlap was refuted, before it is tried again
RETRY_MAX = 4096  # (each refutation in a row doubles the wait, up to this)
HELD_ROUNDS = 8  # rounds over which the others' READYs are timed (the earliest is trusted)
HELD_FIRST = 2  # rounds timed before the first batch of ours is added (a slower member's wait filled)
HELD_MIN_S = 0.01  # the others' READY comes at least this after a batch of ours added before it
SPARE_MAX = 15  # gradient mode: at most this many batches more than the share, before a slower member's READY
PACE_BATCHES = 4  # gradient mode: rounds holding this many batches of ours or more come at a slower member's pace
PACE_ROUNDS = 8  # ... said once (``Pacing.paced``) when this many more such rounds in a row follow the first
PACE_ADVICE = ("early in training, while the loss falls with the count of updates, --sync-every auto (each "
               "machine steps on its own between rounds) trains faster; later these large updates win (beside a "
               "10x slower peer: 3.5-3.8x against 1.07-1.17x the fast peer's time alone to early losses; "
               "bench/README.md)")


@dataclass
class Pacing:
    """The two moving means the rule needs, in seconds."""

    compute_mean: float = 0.0  # a batch's compute, outside ``step``
    round_mean: float | None = None  # a ring, from its start to its commit (None: none seen yet)
    exchange: float | None = None  # the cluster's usual ring from START, the exchange alone (None: untimed)
    predicted: bool = False  # weight prediction is on: a late gradient costs less
    queued_mean: float | None = None  # the share of runnable time spent waiting for a CPU (None: unmeasured)
    refuted: bool = False  # overlap was measured not to pay: lockstep for a while (``lockstep``)
    _retry_in: int = 0  # (refuted: batches left before overlap is tried again)
    _backoff: int = RETRY_AFTER  # (the wait after the next refutation)
    _first_share: float | None = None  # a first share not trusted alone, until the second (the mean starts from both)
    _periods: dict[bool, deque] = field(default_factory=lambda: {  # a batch's period: in lockstep (True) or not
        True: deque(maxlen=LOCKSTEP_PERIODS), False: deque(maxlen=REALIZED_ROUNDS)})
    _began: tuple[float, bool] | None = None  # (the last measured step's start, and whether it went in lockstep)
    _cpu: tuple[float, float] | None = None  # (the threads' run and queued seconds when last sampled)
    _others: deque = field(default_factory=lambda: deque(maxlen=HELD_ROUNDS))  # (the others' READYs, from our share)
    _batches: int = 0  # (batches computed: the first is not counted in ``compute_mean``)
    _members: int = 0  # (the members of the last round ``round_committed`` saw: a change times anew)
    _paced: int = 0  # (rounds in a row that held ``PACE_BATCHES`` of ours or more; -1: said)
    _paced_since: float = 0.0  # (the first of them committed then)

    def computed(self, seconds: float) -> None:
        """One batch was computed in ``seconds`` (from the last ``step``'s end to this one's start).
        The first is not counted (kernels compiled, memory faulted in) and the second starts the
        mean: a mean started at zero took some twenty batches to reach a slow member's step, and
        meanwhile the member judged overlap to pay (its batch came a round early, and the faster
        member beside it, timing that READY, stopped adding batches for ``HELD_ROUNDS`` rounds)."""
        self._batches += 1
        if self._batches == 2:
            self.compute_mean = seconds
        elif self._batches > 2:
            self.compute_mean += COMPUTE_WEIGHT * (seconds - self.compute_mean)

    def ring_took(self, seconds: float) -> None:
        """A round that carried samples took ``seconds`` from its ring's start to its commit."""
        if self.round_mean is None:
            self.round_mean = seconds
        else:
            self.round_mean += ROUND_WEIGHT * (seconds - self.round_mean)

    def round_committed(self, taken_at: float, share_at: float | None, others_after: float | None,
                        members: int) -> None:
        """A round of ``members`` holding ours committed: ours was taken (its READY sent) at
        ``taken_at``, its batches reached our share at ``share_at``, and the last of the others'
        READYs came ``others_after`` seconds after ours (START's offsets, ``roundmsg.others_after``;
        None: not said, and nothing is timed). How long after our share the others' came: both
        READYs as the leader heard them, so what delays every member alike (the commit's apply, a
        loaded host) cancels, and members alike time each other near zero.
        The first round of a cluster that formed or changed (``members`` not the last round's) is
        not timed, and those timed before are forgotten (who is slower may have changed): a first
        batch says little of a member's pace (kernels compiled; ``bench/uneven.py``'s slow peer
        sleeps after its step, so its first batch is as quick as the others'), and one early READY,
        the earliest of ``HELD_ROUNDS`` trusted, kept the faster members from adding a batch until
        it left the window (four peers, one 10x slower: 12 rounds of 0.5 s in lockstep, 6 of the
        first 7 s). Where the first READY was on time, skipping it costs one round in lockstep."""
        if members != self._members:
            self._members = members
            self._others.clear()
            return
        if share_at is not None and others_after is not None:
            self._others.append(taken_at + others_after - share_at)

    def paced(self, batches: int, now: float) -> str | None:
        """A round holding ``batches`` of ours committed at ``now`` (gradient mode, the batches
        beyond our share added beside a slower member, the module docstring): the line to log,
        once, when ``PACE_ROUNDS`` more rounds in a row follow a first that held ``PACE_BATCHES``
        or more (the period: over those rounds). Our updates then come at the slower member's pace,
        one per slow step, and Adam's early progress follows the count of updates: the pair beside
        a 10x slower peer reached early losses in 3.5-3.8x the fast peer's time alone. Said by the
        faster member, whose updates these are; ``worth.Worth`` says who holds rounds unfilled."""
        if self._paced < 0:
            return None
        if batches < PACE_BATCHES:
            self._paced = 0
            return None
        self._paced += 1
        if self._paced == 1:
            self._paced_since = now
        if self._paced <= PACE_ROUNDS:
            return None
        self._paced = -1
        return (f"updates come at a slower member's pace: {batches} of our batches a round (one each "
                f"{self.compute_mean:.2g} s), a round every {(now - self._paced_since) / PACE_ROUNDS:.2g} s; "
                f"{PACE_ADVICE}")

    def others_due(self, share_at: float | None) -> float | None:
        """When the slower members' READYs are due, for a contribution that reached our share at
        ``share_at``: the earliest of the last ``HELD_ROUNDS`` rounds' (None: fewer than
        ``HELD_FIRST`` timed, or the share not reached). Two rounds suffice to begin: a batch is
        added only where the others came a batch and ``HELD_MIN_S`` after our share in every round
        timed, which members alike whose READYs differ by less than that never do; and each round
        waited for before costs a slow member's whole step (with eight, the pair beside a 10x slower
        one spent its first 22 of 60 s in lockstep)."""
        if len(self._others) < HELD_FIRST or share_at is None:
            return None
        return share_at + min(self._others)

    def fits(self, now: float, share_at: float | None, added: bool = False) -> bool:
        """Another batch of ours, begun ``now``, belongs in the round before the others' READYs
        (gradient mode beside a slower member, the module docstring): the first one added where it
        ends before they are due (by ``HELD_MIN_S``), so that members alike never add one; once
        one is (``added``: the others are a batch slower at least), any that begins before they
        are due. A round then waits for ours up to a batch after theirs: the faster member's
        time is worth more samples than the slower's, and with whole batches only the faster idles
        through the part of the slower step no whole batch fits in, half a batch a round."""
        due = self.others_due(share_at)
        end = now if added else now + self.compute_mean
        return due is not None and self.compute_mean > 0 and end + HELD_MIN_S <= due

    def step_began(self, at: float | None, lockstep: bool = False) -> None:
        """A ``step`` began at ``at`` (seconds), going in ``lockstep`` or not: the period since
        the last one's start counts as that one's kind. None: a step that measures no period
        (alone, local steps), and the next one starts anew."""
        if at is not None and self._began is not None:
            self.stepped(at - self._began[0], self._began[1])
        self._began = None if at is None else (at, lockstep)

    def stepped(self, seconds: float, lockstep: bool) -> None:
        """A ``step`` began ``seconds`` after the last one, which ``lockstep`` said of (a
        batch's period: compute, ``step``'s own work, and any wait for a round)."""
        self._periods[lockstep].append(seconds)
        if self.refuted:
            self._retry_in -= 1
            if self._retry_in <= 0:  # (try again: overlap's periods measured anew, lockstep's are recent)
                self.refuted = False
                self._periods[False].clear()

    def realized_gain(self) -> float | None:
        """How many times as often a batch came overlapping as in lockstep, measured: their
        median periods (None: too few of either yet)."""
        lock, over = self._periods[True], self._periods[False]
        if len(lock) < LOCKSTEP_PERIODS or len(over) < REALIZED_ROUNDS:
            return None
        return statistics.median(lock) / max(statistics.median(over), 1e-9)

    def cpu_sampled(self, times: tuple[float, float] | None) -> None:
        """The process's threads have run and waited runnable ``times`` seconds in all
        (``cpu_queue.cpu_times``; None: unknown here), sampled as each pseudo-gradient is formed
        (a round's whole cycle, inner steps and ring, between two samples): the share waited since
        the last sample goes into the moving mean."""
        if times is None:
            return
        if self._cpu is not None:
            ran, queued = times[0] - self._cpu[0], times[1] - self._cpu[1]
            if ran + queued > 0:
                share = queued / (ran + queued)
                if self.queued_mean is None and self._first_share is None:
                    if share < FIRST_TRUSTED:
                        self.queued_mean = share
                    else:
                        self._first_share = share
                elif self.queued_mean is None:
                    self.queued_mean = max(self._first_share, share)
                else:
                    self.queued_mean += QUEUED_WEIGHT * (share - self.queued_mean)
        self._cpu = times

    def cores_short(self) -> bool:
        """The machine has no core to spare for a ring beside the compute (the module docstring).
        From the first sample until a share is trusted (``FIRST_TRUSTED``): short (waiting is
        staleness 0's schedule, the safe one; the time before the first contribution, a cluster
        forming and its peers starting, says nothing of the cores, and one round's share can be low
        by the order the peers finished in). Where nothing can be measured: not short."""
        if self.queued_mean is None:
            return self._cpu is not None
        return self.queued_mean > QUEUED_LIMIT

    def overlap_gain(self) -> float | None:
        """How many times as often a batch comes when the next one is computed while the ring
        runs (None: no ring timed yet)."""
        if self.round_mean is None:
            return None
        c, r = self.compute_mean, self.round_mean
        return (c + r) / max(c, r, 1e-9)

    def lockstep(self, members: int) -> bool:
        """Overlapping does not pay (its gain is below the delay's cost: modelled, or once
        measured, realized), or is not known to yet among ``members`` >= 2: rounds go as at
        staleness 0 (a member waits for its round; a round waits for each member's batch in
        progress)."""
        gain = self.overlap_gain()
        if gain is None:
            return members > 1
        cost = PREDICTED_DELAY_COST if self.predicted else DELAY_COST
        if gain < cost or self.refuted:
            return True
        if members <= 1:  # (alone: no ring of others to wait for, nothing to measure against)
            return False
        if len(self._periods[True]) < LOCKSTEP_PERIODS:  # (lockstep's period, measured first)
            return True
        realized = self.realized_gain()
        if realized is None:
            return False
        if realized >= cost:
            self._backoff = RETRY_AFTER  # (it paid: a later refutation waits the least again)
            return False
        self.refuted, self._retry_in = True, self._backoff
        self._backoff = min(2 * self._backoff, RETRY_MAX)
        return True


def share(target_batch_size: int | None, members: int, batch: int) -> int:
    """The most samples one member contributes to a round: the target batch (None: members x
    ``batch``, DDP's global batch) over the members, in whole batches, at least one batch."""
    members = max(1, members)
    target = target_batch_size or members * batch
    return max(1, target // members // batch) * batch


def must_wait(*, staleness: int, local_steps: bool, finished: bool, accumulated: int, out: bool, share: int,
              lockstep: bool, cores_short: bool = False, by_time: bool = False, more: bool = False) -> bool:
    """Whether ``step`` waits: ``accumulated``: samples added and not taken yet; ``out``: our
    contribution is in a round; ``share``, ``lockstep`` and ``cores_short`` as above; ``more``:
    another batch fits before a slower member's READY (``Pacing.fits``, within the bound). ``by_time``:
    local steps with rounds by time (``round_window``), where ``cores_short`` is not heeded: a
    round lasts a window, and a member waiting for its round beside a slower one idled through
    the slower one's last step each round, the very wait rounds by time are for."""
    if finished:  # no round will take it: the run is over
        return False
    if local_steps:  # at staleness 0 (or short of cores) our pseudo-gradient is applied before step() returns
        return (staleness == 0 or (cores_short and not by_time)) and bool(accumulated or out)
    if staleness == 0:  # our batch is applied before step() returns
        return bool(accumulated or out)
    if more and not out:  # a slower member's READY is not due yet: compute another batch into ours
        return False
    if accumulated >= share:  # our share of the target batch waits for a round
        return True
    return lockstep and bool(accumulated or out)
