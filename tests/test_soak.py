"""The churn soak (bench/soak.py): peers on an emulated LAN killed, paused, unplugged and joined
while they train, and what the users rely on through it: no sample silently lost, every replica's
parameters the same, no peer hung or stuck, training going on after every fault. Also the soak's
own checks (bench/_soak_check.py), on made-up records, so a finding cannot pass unseen."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections import Counter

import pytest
from netns_util import REPO, requires_netns

import _soak_check  # (bench/, put on sys.path by netns_util)


def _rec(version, t, samples, own, members=2, checksum=None):
    return {"version": version, "time": t, "samples": samples, "own_samples": own, "members": members,
            "param_checksum": checksum}


def _summary(own, dropped=0, unapplied=0, checksum="c"):
    return {"own_samples": own, "dropped": dropped, "unapplied": unapplied, "param_checksum": checksum,
            "end": {"round": 3, "version": 3, "behind": False}}


def _pair(own_a=64, dropped_a=0, checksum_b="x"):
    a = _soak_check.Incarnation(0, 0.0, [_rec(1, 1.0, 64, 32, checksum="x"), _rec(2, 2.0, 64, 32)],
                                _summary(own_a, dropped_a), 0)
    b = _soak_check.Incarnation(1, 0.0, [_rec(1, 1.1, 64, 32, checksum=checksum_b), _rec(2, 2.1, 64, 32)],
                                _summary(64), 0)
    return [a, b]


def test_checks_pass_a_clean_run():
    f = _soak_check.check(_pair(), [(1.5, "stop")], t0=0.5, settle=10.0)
    assert _soak_check.problems(f) == []
    assert (f.rounds, f.samples_committed, f.lost, f.checksum_versions) == (2, 128, 0, 1)
    assert f.longest_stall == pytest.approx(1.0)  # (the earliest record of each version counts)
    assert f.faults == Counter(stop=1) and f.min_rounds_after_fault == 1


def test_checks_find_lost_samples_and_diverged_parameters():
    f = _soak_check.check(_pair(own_a=96, checksum_b="y"), [], t0=0.5, settle=10.0)
    found = "\n".join(_soak_check.problems(f))
    assert f.lost == 32 and "32 samples lost" in found
    assert f.checksum_disagree == [1] and "checksums differ" in found
    assert _soak_check.check(_pair(own_a=96, dropped_a=32), [], 0.5, 10.0).lost == 0  # (reported: not lost)


def test_checks_leave_a_peer_alone_out_of_the_cluster_lineage():
    incs = _pair()
    incs[1].records.insert(0, _rec(1, 0.9, 32, 32, members=1, checksum="alone"))
    f = _soak_check.check(incs, [], t0=0.5, settle=10.0)
    assert f.checksum_disagree == [] and f.alone == 32
    # two sides of a split commit the same version apart, each on its own parameters: not a divergence
    incs += [_soak_check.Incarnation(h, 0.0, [_rec(1, 30.0, 64, 32, checksum="side")], None, -9, killed=True)
             for h in (2, 3)]
    f = _soak_check.check(incs, [], t0=0.5, settle=10.0)
    assert f.checksum_disagree == [] and f.split_versions == 1 and f.split_rounds == 0
    # ... or in the same moments, numbered alike: more records than a commit has members
    incs += [_soak_check.Incarnation(h, 0.0, [_rec(1, 1.2, 64, 32, checksum="other")], None, -9, killed=True)
             for h in (4, 5)]
    f = _soak_check.check(incs, [], t0=0.5, settle=10.0)
    assert f.checksum_disagree == [] and f.split_versions == 1 and f.split_rounds == 0
    assert _soak_check.read_metrics('{"event": "training", "version": 0}\n{"version": 1, "time": 1, "sa') == ([], None)


def _inc(host, start, *times, killed=False):
    """An incarnation on ``host`` started at ``start`` whose round records (2 members) are at ``times``."""
    return _soak_check.Incarnation(host, start, [_rec(i + 1, t, 64, 32) for i, t in enumerate(times)], None, None,
                                   killed=killed)


# (what, incarnations, fault log, capacity over [t0 0, end 100])
CAPACITY = [
    ("no faults", [_inc(0, -5), _inc(1, -5)], [], 1.0),
    ("SIGSTOP 10-30 of two peers' 200 s", [_inc(0, -5), _inc(1, -5)], [(10, "stop", 0), (30, "cont", 0)], 0.9),
    ("a link down 10 s, a kill 2 s before the restart and 8 s to its first round",
     [_inc(0, -5, 40, killed=True), _inc(0, 52, 60, 61), _inc(1, -5)],
     [(10, "link", 1), (20, "up", 1), (50, "kill", 0), (52, "restart", 0)], 0.9),
    ("a joiner counts from its join", [_inc(0, -5), _inc(1, -5), _inc(2, 50)],
     [(50, "join", 2), (60, "stop", 2), (70, "cont", 2)], 240 / 250),
    ("a pause never ended, a kill never back: absent to the end", [_inc(0, -5, 10, killed=True), _inc(1, -5),
                                                                    _inc(2, -5)],
     [(50, "kill", 0), (51, "restart", 0), (80, "stop", 1)], (300 - 50 - 20) / 300),
    ("a second fault of the same host counts on its own", [_inc(0, -5), _inc(1, -5)],
     [(10, "stop", 0), (20, "cont", 0), (30, "link", 0), (35, "up", 0), (40, "link", 1), (45, "up", 1)], 0.9),
]


@pytest.mark.parametrize("what,incs,events,expected", CAPACITY, ids=[c[0] for c in CAPACITY])
def test_capacity_counts_the_peer_seconds_each_fault_took(what, incs, events, expected):
    assert _soak_check.capacity(incs, events, t0=0.0, end=100.0) == pytest.approx(expected)


def test_resume_and_stalls_are_read_against_the_fault_log():
    times = {v: float(t) for v, t in enumerate([1, 2, 3, 4, 5, 15, 16, 17, 18, 26, 27], start=1)}
    events = [(2.5, "stop", 0), (5.5, "link", 1), (7, "stop", 2), (9, "up", 1), (12, "cont", 2), (19, "join", 3),
              (30, "kill", 0)]
    # the longest wait in the 10 s after each: to the next update, or a gap that begins in them
    assert _soak_check.waits_after(times, events, 10.0) == {"stop": [10.0, 8.0], "link": [9.5], "up": [8.0],
                                                             "cont": [8.0], "join": [7.0]}  # (the kill: no update after)
    # the gaps 5-15 and 18-26 (median 1): the first event in one, else the last before it
    assert _soak_check.stalls_by_cause(times, events, t0=0.0, end=27.0) == {"link": [1, 9.0, 10.0],
                                                                            "join": [1, 7.0, 8.0]}
    assert _soak_check.stalls_by_cause({1: 1.0, 2: 2.0, 3: 9.0}, [], t0=0.0, end=9.0) == {"none": [1, 6.0, 7.0]}
    # a pause just before the round in flight committed stalled the next one: its stall, not the SIGCONT's
    assert _soak_check.stalls_by_cause({1: 1.0, 2: 2.0, 3: 3.0, 4: 9.0}, [(2.6, "stop", 0), (5, "cont", 0)],
                                       t0=0.0, end=9.0) == {"stop": [1, 5.0, 6.0]}
    f = _soak_check.check([_inc(0, -5, *times.values()), _inc(1, -5, *times.values())], [], 0.0, 10.0,
                          events=[(2.5, "stop", 0), (5.5, "link", 1), (8, "cont", 0), (12, "up", 1)])
    assert f.capacity == pytest.approx((54 - 5.5 - 6.5) / 54) and f.stalls == {"link": [1, 9.0, 10.0], "up": [1, 7.0, 8.0]}


def test_a_peer_process_is_up_at_its_training_event():
    """The soak tells a restarted peer's wait for a round once its process is up from its start
    (Python and torch loading on a 2-core box shared by eight peers)."""
    text = "\n".join(json.dumps(r) for r in [{"event": "training", "time": 12.5, "version": 0},
                                              {"time": 13.0, "version": 1, "members": 2}])
    assert _soak_check.process_up(text) == 12.5
    assert _soak_check.process_up('{"time": 13.0, "version": 1}\n{"event": "trai') is None


def test_throughput_kept_with_the_same_peers_reads_the_runs_own_quiet_windows():
    """Two peers make 100 samples/s, three (a joiner from 40 s) 80: the run keeps all of it though
    it makes less than the first two did; a kill at 70-75 s costs its samples and its quiet window."""
    commits = [(t + 0.5, 2, 100) for t in range(40)] + [(t + 0.5, 3, 80) for t in range(40, 100) if not 70 <= t < 75]
    rates, kept = _soak_check.same_peers(commits, [-5.0, -5.0, 40.0], [(40.0, "join", 2), (70.0, "kill", 1)],
                                         0.0, 100.0)
    assert rates == {2: 100.0, 3: 80.0}
    assert kept == pytest.approx((4000 + 55 * 80) / (4000 + 60 * 80))
    assert _soak_check.same_peers([], [0.0], [], 0.0, 10.0) == ({}, None)


def test_a_side_cut_off_that_numbers_its_versions_ahead_hides_no_commit_of_the_cluster():
    """Two peers cut off together train on as a side of two and number their updates like the
    cluster, ahead of it; the cluster commits the same numbers later. Each commit counts where it
    happened: taking a version's earliest record, the cluster's commits of 4-6 vanished behind
    the side's and a 4 s stall appeared between 3 and 7 that the cluster never had."""
    main = [_soak_check.Incarnation(h, 0.0, [_rec(v, float(v) + h / 100, 96, 32, members=3) for v in range(1, 9)],
                                    _summary(256), 0) for h in range(3)]
    side = [_soak_check.Incarnation(h, 0.0, [_rec(v, v / 10 - 0.2 + h / 100, 64, 32) for v in (4, 5, 6)],
                                    _summary(96), 0) for h in (3, 4)]
    f = _soak_check.check(main + side, [(3.5, "link")], t0=0.0, settle=2.0)
    assert f.longest_stall == pytest.approx(1.0) and f.min_rounds_after_fault == 2 and f.rounds == 8
    assert f.split_versions == 3 and f.lost == 0


@requires_netns
@pytest.mark.slow
@pytest.mark.timeout(150)
def test_soak_short_run_loses_nothing_and_keeps_training(tmp_path):
    out = tmp_path / "soak.json"
    cmd = [sys.executable, str(REPO / "bench" / "soak.py"), "--peers", "4", "--seconds", "35", "--faults", "4",
           "--joiners", "1", "--stop", "2,4", "--link", "1,3", "--settle", "12", "--grace", "30", "--no-baseline",
           "--step-delay", "0.02", "--json", str(out)]  # (its peers leave the tests beside it a core)
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        text = p.communicate(timeout=130)[0]
    finally:
        if p.poll() is None:  # (SIGTERM first: soak.py then kills its peers and removes its namespaces)
            os.killpg(p.pid, signal.SIGTERM)
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    assert out.exists(), text[-3000:]
    f = json.loads(out.read_text())["faulty"]
    assert sum(f["faults"].values()) >= 3, text[-3000:]
    assert f["lost"] == 0 and f["split_rounds"] == 0, text[-3000:]
    assert f["checksum_versions"] > 0 and f["checksum_disagree"] == [] and len(f["end_checksums"]) == 1, text[-3000:]
    assert f["hangs"] == [] and f["stuck"] == [] and f["bad_exits"] == [], text[-3000:]
    assert f["min_rounds_after_fault"] > 0, text[-3000:]
    assert p.returncode == 0, text[-3000:]
