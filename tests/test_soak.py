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
    assert _soak_check.read_metrics('{"event": "training", "version": 0}\n{"version": 1, "time": 1, "sa') == ([], None)


@requires_netns
@pytest.mark.slow
@pytest.mark.timeout(150)
def test_soak_short_run_loses_nothing_and_keeps_training(tmp_path):
    out = tmp_path / "soak.json"
    cmd = [sys.executable, str(REPO / "bench" / "soak.py"), "--peers", "4", "--seconds", "35", "--faults", "4",
           "--joiners", "1", "--stop", "2,4", "--link", "1,3", "--settle", "12", "--grace", "30", "--no-baseline",
           "--json", str(out)]
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
