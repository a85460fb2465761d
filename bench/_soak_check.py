"""bench/soak.py's checks: what the peers' ``--metrics`` files and exits say about a soak run.

Pure (no process, no clock): ``read_metrics`` parses one file, ``check`` turns every incarnation's
records plus the faults injected into the figures of the table (``Figures``). One incarnation is one
process of ``join``: a peer killed with ``kill -9`` and started again is two.

What each figure is read from (``join --metrics``, commands/join_output.py):

- a round record per update applied here: ``version`` (the cluster's update count, the same on
  every peer), ``time``, ``samples`` (every member's in it), ``own_samples`` (this peer's),
  ``param_checksum`` (every ``--checksum-every`` updates, null when the parameters then held
  something else);
- the ``summary`` at exit: ``own_samples`` (every sample this process computed), ``dropped`` (those
  it reported dropped: staler than the bound, void at a state load, withdrawn as non-finite),
  ``unapplied`` (those no round took before it left), ``param_checksum`` and ``end``.

``lost`` of an incarnation that exited by itself is ``own_samples - sum(own_samples of its round
records) - dropped - unapplied``: computed, neither applied nor reported. A killed one wrote no
summary; what it had computed since its last round went with it, as kill -9 does, and is not
counted. ``split_rounds`` are updates whose ``samples`` differ from the sum of their members'
``own_samples`` where every member's record is there (a member that died before writing its record
leaves its round out of this check).

The faults' cost is read against the fault log (``events``: (unix time, what, host), ``what`` one of
``kill``, ``restart``, ``restart-fresh``, ``stop``, ``cont``, ``link``, ``up``, ``join``):
``capacity`` is the share of peer-seconds in which each peer could compute for the cluster (not
killed and not yet back in a round with the others, not stopped, not unplugged) of those of the
same run without faults (every host from ``t0``, or from its join, to the last update), the bound
on the throughput kept that the faults themselves set; ``waits`` is, per kind of event, the longest
wait for an update in the ``settle`` seconds after each; ``stalls`` blames each gap between updates
longer than ``STALL_FACTOR`` usual gaps (and ``STALL_MIN_S``) on the first event in it or just
before it (``LOOKBACK_S``: the round in flight at a fault may still commit), else the last before.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import math
import statistics
from collections import Counter, defaultdict

SAME_COMMIT_S = 2.0  # records of one version this close in time are one commit (else: another lineage's)
QUIET_S = 10.0  # a window this long, with no event in it or in as long before, is fault-free (``same_peers``)
ABSENT_UNTIL = {"kill": None, "stop": "cont", "link": "up"}  # a fault's absence ends at (None: back in a round)
STALL_FACTOR = 3.0  # a gap between updates this many times the median gap is a stall
STALL_MIN_S = 0.5  # (and at least this long)
LOOKBACK_S = 1.0  # a stall is blamed on an event this long before it began too


@dataclasses.dataclass
class Incarnation:
    host: int
    start: float                      # unix time it was started
    records: list                     # round records, as written
    summary: dict | None              # its summary record, None without one (killed, or it hung)
    exit_code: int | None             # None: it did not exit by the deadline (killed then: a hang)
    killed: bool = False              # by a kill -9 fault (its exit -9 and missing summary expected)
    hung: bool = False                # still running at the deadline
    silent: bool = False              # alive, under no fault, and no record for a while as others went on
    usage: list = dataclasses.field(default_factory=list)  # [(time, rss bytes, open fds)]


@dataclasses.dataclass
class Figures:
    faults: Counter                   # kind -> injected
    rounds: int                       # the cluster's updates committed (the highest version seen)
    samples_committed: int            # every member's samples in them
    alone: int                        # samples of updates a peer applied alone (members 1), from t0
    split_versions: int               # versions two lineages of 2+ members each committed (a split)
    lost: int                         # samples computed, neither applied nor reported dropped
    dropped: int                      # samples reported dropped
    lost_by: list                     # (host, lost) of each incarnation that lost some
    split_rounds: int                 # updates whose samples != their members' own samples
    checksum_versions: int            # versions with >= 2 checksums to compare
    checksum_disagree: list           # versions where they differ
    end_checksums: set                # the summaries' checksums at the cluster's end
    longest_stall: float              # longest seconds between two consecutive updates
    stall_at: float                   # when it began (unix time)
    min_rounds_after_fault: int       # fewest updates in the window after any fault
    rate: float                       # committed samples per second, from t0 to the last update
    bad_exits: list                   # (host, code) of incarnations that failed (not killed by us)
    hangs: list                       # hosts of incarnations still running at the deadline
    stuck: list                       # hosts of incarnations silent under no fault (bench/soak.py's SILENT)
    usage: list                       # (host, rss start, rss end, fds start, fds end) of long-lived ones
    capacity: float = 1.0             # peer-seconds present over those without faults (``capacity``)
    waits: dict = dataclasses.field(default_factory=dict)  # event what -> [longest wait for an update after each]
    stalls: dict = dataclasses.field(default_factory=dict)  # cause -> [gaps, s past the median gap, longest]
    quiet_rates: dict = dataclasses.field(default_factory=dict)  # peers -> samples/s in quiet windows (``same_peers``)
    kept_same_peers: float | None = None  # committed over what the quiet rates give (``same_peers``)


def read_metrics(text: str) -> tuple[list, dict | None]:
    """A ``--metrics`` JSON-lines file: its round records and its summary (None: none). A last
    line cut short by a kill is skipped."""
    records, summary = [], None
    for line in text.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if rec.get("event") == "summary":
            summary = rec
        elif "event" not in rec and rec.get("version") is not None:
            records.append(rec)
    return records, summary


def process_up(text: str) -> float | None:
    """When a peer's process began training (its metrics file's ``training`` event: Python, torch
    and the task loaded, listening); None before that."""
    for line in text.splitlines():
        if '"training"' in line:
            try:
                return json.loads(line)["time"]
            except (ValueError, KeyError):
                return None
    return None


def in_cluster(inc: Incarnation) -> list:
    """Its round records of two or more members: the cluster's lineage. A peer alone (one started
    with ``--min-peers 1`` trains alone until it reaches the others, a peer cut off) numbers its own
    updates on its own parameters, which the cluster's state replaces when it joins."""
    return [r for r in inc.records if (r.get("members") or 0) >= 2]


def longest_stall(times: dict, start: float, end: float) -> tuple[float, float]:
    """The longest gap between consecutive updates committed in ``[start, end]`` (and from
    ``start`` to the first): (seconds, when it began)."""
    ts = sorted(t for t in times.values() if start <= t <= end)
    best, at, prev = 0.0, start, start
    for t in ts:
        if t - prev > best:
            best, at = t - prev, prev
        prev = t
    return best, at


def absences(incs: list[Incarnation], events) -> dict[int, list[tuple[float, float]]]:
    """host -> the spans (from, to) in which it computed nothing for the cluster: from a kill -9
    to its next incarnation's first round with the others, from SIGSTOP to SIGCONT, from its
    link down to up; ``to`` is infinite where the end never came."""
    out: dict[int, list] = defaultdict(list)
    events = sorted(events)
    for i, (t, what, host) in enumerate(events):
        if what not in ABSENT_UNTIL:
            continue
        if what == "kill":
            later = sorted((inc for inc in incs if inc.host == host and inc.start >= t), key=lambda inc: inc.start)
            back = next((r["time"] for inc in later for r in in_cluster(inc) if r["time"] >= t), math.inf)
        else:
            back = next((u for u, w, h in events[i + 1:] if h == host and w == ABSENT_UNTIL[what]), math.inf)
        out[host].append((t, back))
    return dict(out)


def capacity(incs: list[Incarnation], events, t0: float, end: float) -> float:
    """The peer-seconds in ``[t0, end]`` in which peers could compute for the cluster over those of
    the same run without faults: every host from ``t0`` (a joiner from its first start) to ``end``,
    less its ``absences`` (overlapping ones once). 1.0 where there is no span."""
    starts: dict[int, float] = {}
    for inc in incs:
        starts[inc.host] = min(starts.get(inc.host, math.inf), inc.start)
    full = absent = 0.0
    gone = absences(incs, events)
    for host, start in starts.items():
        lo = max(t0, start)
        full += max(0.0, end - lo)
        reach = lo
        for a, b in sorted(gone.get(host, [])):
            a, b = max(a, reach), min(b, end)
            if b > a:
                absent += b - a
                reach = b
    return (full - absent) / full if full > 0 else 1.0


def same_peers(commits: list, starts: list, events, t0: float, end: float,
               window: float = QUIET_S) -> tuple[dict, float | None]:
    """The throughput kept against the same run's fault-free rate with the same peers. ``commits``:
    (time, members, samples); ``starts``: each host's first start. A quiet window (``window`` s
    with no event in it or in the ``window`` s before, every host started by then in its updates)
    gives the rate of that many peers; the expected samples are, second by second, the rate of the
    hosts started by then (a killed, stopped or unplugged one still counts: the fault's cost; a
    count with no quiet window takes the nearest). On a box whose cores the peers share, eight
    peers make fewer samples/s than five, so a baseline of the first peers alone asks the run with
    joiners for more than its cores give. Returns ({peers: samples/s}, kept or None)."""
    commits, events = sorted(c for c in commits if t0 <= c[0] <= end), sorted(t for t, _, _ in events)
    ts = [c[0] for c in commits]
    up = lambda t: sum(1 for s in starts if s <= t)  # noqa: E731
    got: dict = defaultdict(lambda: [0, 0.0])
    w = t0
    while w + window <= end:
        i, j, k = bisect.bisect_left(ts, w), bisect.bisect_left(ts, w + window), bisect.bisect_left(events, w - window)
        if j > i and not (k < len(events) and events[k] < w + window) \
                and all(c[1] == up(w) for c in commits[i:j]):
            got[up(w)][0] += sum(c[2] for c in commits[i:j])
            got[up(w)][1] += window
        w += window
    rates = {n: s / secs for n, (s, secs) in sorted(got.items())}
    if not rates or not commits:
        return rates, None
    expected = sum(rates[min(rates, key=lambda n: (abs(n - up(t)), n))] * min(1.0, end - t)
                   for t in (t0 + x for x in range(math.ceil(end - t0))))
    return rates, sum(c[2] for c in commits) / expected if expected else None


def waits_after(times: dict, events, window: float) -> dict[str, list[float]]:
    """Event what -> for each such event at t, the longest wait for an update in ``[t, t + window]``:
    from t to the next update, or a gap between updates that begins in the window (a paused peer
    stalls the round after the one in flight). An event with no update after it is left out."""
    ts = sorted(times.values())
    out: dict[str, list] = defaultdict(list)
    for t, what, _ in sorted(events):
        i = bisect.bisect_right(ts, t)
        if i == len(ts):
            continue
        wait, prev = ts[i] - t, ts[i]
        for u in ts[i + 1:]:
            if prev >= t + window:
                break
            wait, prev = max(wait, u - prev), u
        out[what].append(wait)
    return dict(out)


def stalls_by_cause(times: dict, events, t0: float, end: float) -> dict[str, list]:
    """Each gap between updates (from ``t0``) over ``STALL_FACTOR`` times the median gap and
    ``STALL_MIN_S``, blamed on the first event in it or ``LOOKBACK_S`` before it, else the last
    one before it (``none``: no event yet): cause -> [gaps, seconds past the median gap, the longest]."""
    ts = [t0] + sorted(t for t in times.values() if t0 <= t <= end)
    gaps = [(a, b) for a, b in zip(ts, ts[1:])]
    if not gaps:
        return {}
    usual = statistics.median(b - a for a, b in gaps)
    events = sorted(events)
    out: dict[str, list] = {}
    for a, b in gaps:
        if b - a <= max(STALL_FACTOR * usual, STALL_MIN_S):
            continue
        inside = [w for t, w, _ in events if a - LOOKBACK_S <= t < b]
        before = [w for t, w, _ in events if t < a]
        cause = inside[0] if inside else (before[-1] if before else "none")
        row = out.setdefault(cause, [0, 0.0, 0.0])
        row[0], row[1], row[2] = row[0] + 1, row[1] + (b - a - usual), max(row[2], b - a)
    return out


def check(incs: list[Incarnation], faults: list[tuple[float, str]], t0: float, settle: float,
          events=()) -> Figures:
    """The figures of a run. ``faults``: (time injected, kind); ``t0``: when every first peer was
    a member; ``settle``: the window after a fault in which updates are counted; ``events``: the
    fault log (the module's docstring)."""
    # A version's records, grouped into commits: one lineage commits a version once, all its
    # members within moments; two sides of a split (or two fresh peers that met before they met the
    # cluster) commit the same number apart, each on its own parameters.
    commits: dict[tuple, list] = defaultdict(list)
    by_version: dict[int, list] = defaultdict(list)
    alone = 0
    for inc in incs:
        alone += sum(r["own_samples"] for r in inc.records if (r.get("members") or 0) < 2 and r["time"] >= t0)
        for r in in_cluster(inc):
            by_version[r["version"]].append((r["time"], inc.host, r))
    for v, recs in by_version.items():
        recs.sort(key=lambda x: x[0])
        start = recs[0][0]
        for t, host, r in recs:
            if t - start > SAME_COMMIT_S:
                start = t
            commits[(v, start)].append((host, r))
    # Each commit's time, keyed by (version, start): two lineages number their versions alike (a
    # side of two peers cut off may run far ahead of the cluster), so a version's earliest record
    # can be the other side's, and would hide this commit from the stalls and the waits.
    times = {k: k[1] for k in commits}
    # More records than the commit had members: two sides of a split committed this version in the
    # same moments (each of 2+ members, numbered alike from where they parted): not one commit.
    concurrent = {k for k, rs in commits.items() if len(rs) > max(r.get("members") or 0 for _, r in rs)}
    samples_of = {k: max(r["samples"] for _, r in rs) for k, rs in commits.items()}
    own_of = {k: sum(r["own_samples"] for _, r in rs) for k, rs in commits.items()}
    members_of = {k: max(r.get("members") or 0 for _, r in rs) for k, rs in commits.items()}
    recorded = {k: len(rs) for k, rs in commits.items()}
    sums = {k: {(h, r["param_checksum"]) for h, r in rs if r.get("param_checksum")} for k, rs in commits.items()}
    split_versions = sum(1 for v, n in Counter(v for v, _ in commits).items()
                         if n > 1 or any(k[0] == v for k in concurrent))
    split = sum(1 for v, s in samples_of.items()
                if v not in concurrent and recorded[v] >= members_of[v] and s != own_of[v])
    compared = {v: {c for _, c in hs} for v, hs in sums.items() if len(hs) >= 2 and v not in concurrent}
    disagree = sorted({k[0] for k, cs in compared.items() if len(cs) > 1})
    lost_by, lost, dropped = [], 0, 0
    for inc in incs:
        if inc.summary is None:
            continue
        s = inc.summary
        gap = s["own_samples"] - sum(r["own_samples"] for r in inc.records) - s["dropped"] - s.get("unapplied", 0)
        dropped += s["dropped"]
        if gap:
            lost += gap
            lost_by.append((inc.host, gap))
    last = max(times.values(), default=t0)
    stall, stall_at = longest_stall(times, t0, last)
    after = [sum(1 for t in times.values() if ft < t <= ft + settle) for ft, _ in faults]
    ends = {inc.summary["param_checksum"] for inc in incs
            if inc.summary and inc.summary.get("end") and not inc.summary["end"].get("behind")}
    committed = sum(s for k, s in samples_of.items() if k[1] >= t0)
    usage = []
    for inc in incs:
        # from its first round with the others (start-up aside) to the last update (not its exit's:
        # connections closed then)
        ours = in_cluster(inc)
        during = [u for u in inc.usage if ours and ours[0]["time"] <= u[0] <= last]
        if not inc.killed and len(during) >= 2:
            first, lst = _settled(during), during[-1]
            usage.append((inc.host, first[1], lst[1], first[2], lst[2]))
    first_start: dict = {}
    for inc in incs:
        first_start[inc.host] = min(inc.start, first_start.get(inc.host, inc.start))
    quiet_rates, kept_same_peers = same_peers([(k[1], members_of[k], samples_of[k]) for k in commits
                                               if k not in concurrent], list(first_start.values()), events, t0, last)
    return Figures(
        faults=Counter(kind for _, kind in faults), rounds=max((v for v, _ in commits), default=0),
        samples_committed=committed, alone=alone, split_versions=split_versions, lost=lost, dropped=dropped, lost_by=lost_by, split_rounds=split,
        checksum_versions=len(compared), checksum_disagree=disagree, end_checksums=ends,
        longest_stall=stall, stall_at=stall_at, min_rounds_after_fault=min(after, default=0),
        rate=committed / (last - t0) if last > t0 else 0.0,
        bad_exits=[(i.host, i.exit_code) for i in incs if not i.killed and not i.hung and i.exit_code != 0],
        hangs=[i.host for i in incs if i.hung], stuck=[i.host for i in incs if i.silent], usage=usage,
        capacity=capacity(incs, events, t0, last), waits=waits_after(times, events, settle),
        stalls=stalls_by_cause(times, events, t0, last), quiet_rates=quiet_rates, kept_same_peers=kept_same_peers)


def _settled(usage: list) -> tuple:
    """The first sample past the first tenth of the samples' span (the first rounds' growth aside)."""
    t_first, t_last = usage[0][0], usage[-1][0]
    return next(u for u in usage if u[0] >= t_first + 0.1 * (t_last - t_first))


def problems(f: Figures) -> list[str]:
    """Every finding, one line each (empty: the run held)."""
    out = []
    if f.lost:
        out.append(f"{f.lost} samples lost (computed, neither applied nor reported dropped): {f.lost_by}")
    if f.split_rounds:
        out.append(f"{f.split_rounds} updates whose samples differ from their members' own samples")
    if f.checksum_disagree:
        out.append(f"parameter checksums differ at versions {f.checksum_disagree[:10]}")
    if len(f.end_checksums) > 1:
        out.append(f"the peers ended with {len(f.end_checksums)} different checksums")
    if f.hangs:
        out.append(f"peers on hosts {f.hangs} still ran at the deadline (hang)")
    if f.stuck:
        out.append(f"peers on hosts {f.stuck} stopped recording updates under no fault while the others went on")
    if f.bad_exits:
        out.append(f"peers exited with failures (host, code): {f.bad_exits}")
    if f.faults and f.min_rounds_after_fault == 0:
        out.append("no update committed in the window after some fault")
    return out
