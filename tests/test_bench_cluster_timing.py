"""bench/cluster_timing.py runs end to end on a tiny configuration (so it cannot rot), and it
finds the coordinator the way the logs say it is."""

import json
import os
import sys
from pathlib import Path

import pytest
from helpers import run_group
from netns_util import requires_netns

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

import cluster_timing

pytestmark = pytest.mark.timeout(150)


@requires_netns
def test_tiny_run_reports_discovery_and_a_snapshot_download_within_the_link(tmp_path):
    out_json = tmp_path / "timing.json"
    p = run_group([sys.executable, "bench/cluster_timing.py", "--parts", "discovery,snapshot", "--hosts", "2",
                   "--reps", "1", "--snapshot-mb", "12", "--json", str(out_json)], 120, cwd=REPO,
                  env=dict(os.environ, PYTHONPATH=str(REPO)))
    out, err = p.stdout, p.stderr
    assert p.returncode == 0, out[-2000:] + err[-2000:]
    doc = json.loads(out_json.read_text())
    (disc,) = doc["discovery"]
    assert disc["n"] == 2 and 0 < disc["up_s"] <= disc["ring_s"] < 120
    (run,) = doc["snapshot"]["runs"]
    assert run["bytes"] >= 12e6 and run["asks"] >= 1
    assert 0 < run["ask_to_loaded_s"] < run["launch_to_loaded_s"]
    # The state crossed the capped link, not a shortcut: every byte leaves after the ask, so the
    # rate from the ask on is bounded by the link (plus the token buckets' 2 ms bursts). The rate
    # between the first and last part is not: parts queued in the socket buffer while the first
    # was handled arrive at once (one CI run read 144 MB/s there on a 125 MB/s link).
    assert 0 < run["overall_Bps"] < 1.1 * 1e9 / 8
    assert run["wire_Bps"] > 0
    assert "| discovery, N=2" in out and "snapshot, 12 MB at 1 Gbit/s" in out and "raw TCP" in out


class _Alive:
    def poll(self):
        return None


def test_the_coordinator_is_the_peer_that_took_the_lead_last_and_kept_it(tmp_path):
    """Every peer coordinates itself until it meets the others: one that handed the lead over is
    not the coordinator, even if it said "coordinating" later than the one that leads now."""
    run = cluster_timing.JoinRun(None, tmp_path, "t")
    run.procs = {"a": _Alive(), "b": _Alive(), "c": _Alive()}
    logs = {"a": ["00,100 coordinating from epoch 1: asking 0 peer(s)"],
            "b": ["00,200 coordinating from epoch 1: asking 0 peer(s)",
                  "00,300 no longer coordinating: handing the lead over to a"],
            "c": []}
    for name, lines in logs.items():
        run.path(name, "log").write_text("".join(f"2030-01-01 10:00:{x[:6]} INFO p2ptrain.cluster.cluster: {x[7:]}\n"
                                                 for x in lines))
    assert run.coordinator() == "a"
    run.path("c", "log").write_text("2030-01-01 10:00:00,400 INFO x: coordinating from epoch 2: asking 2\n")
    with pytest.raises(cluster_timing.Failed, match="one coordinator"):
        run.coordinator()
