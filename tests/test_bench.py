"""The benchmarks run end to end on a tiny configuration, so that they cannot rot."""

import os
import subprocess
import sys
import time

import pytest
from helpers import run_group

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = [pytest.mark.timeout(240)]


def run(*args):
    env = dict(os.environ, PYTHONPATH=REPO)
    return run_group([sys.executable, *args], timeout=220, cwd=REPO, env=env)


def test_allreduce_bench_quick_compares_with_gloo_and_traces_when_each_step_arrived(tmp_path):
    p = run("bench/allreduce.py", "--quick", "--codecs", "none,int8", "--trace", str(tmp_path))
    assert p.returncode == 0, p.stdout[-1500:] + p.stderr[-1500:]
    lines = [l for l in p.stdout.splitlines() if l.startswith("| 2 ")]
    assert any("gloo" in l for l in lines) and sum("p2ptrain" in l for l in lines) == 2
    assert all("True" in l for l in lines if "p2ptrain" in l)  # bit-identical on every peer
    # bench/trace_spans.py --steps: per call, when each rank's link brought each of its 2 steps
    p = run("bench/trace_spans.py", "--steps", str(tmp_path / "n2-rank0.json"), str(tmp_path / "n2-rank1.json"))
    assert p.returncode == 0, p.stderr[-1500:]
    calls = [l for l in p.stdout.splitlines() if l.startswith("call ")]
    rows = [l for l in p.stdout.splitlines() if "steps arrived by" in l]
    assert len(rows) == 2 * len(calls)
    steps = [len(r.split("steps arrived by")[1].split()) for r in rows]  # (a barrier's one value: one step)
    assert set(steps) <= {1, 2} and steps.count(2) >= 2 * 2 * 3  # (2 codecs, 3 calls each: warm-up, 2 reps)


def test_codecs_bench_quick():
    p = run("bench/codecs.py", "--quick")
    assert p.returncode == 0, p.stderr[-1500:]
    for codec in ("none", "fp16", "bf16", "int8", "topk:0.01"):
        assert codec in p.stdout


def test_train_bench_quick_runs_ddp_p2ptrain_and_alone_with_equal_fp32_losses_and_traces_where_a_step_goes(tmp_path):
    """One quick run of every mode (a start-up of torch per worker is most of its time):
    DDP and p2ptrain end at the same fp32 loss, and ``--trace`` has each p2ptrain worker write
    a Chrome trace with its batches, steps, rounds, the ring's chunks and the optimizer's steps,
    so a step's time can be taken apart."""
    import json

    p = run("bench/train.py", "--quick", "--reps", "1", "--trace", str(tmp_path))
    assert p.returncode == 0, p.stdout[-1500:] + p.stderr[-1500:]
    rows = {l.split("|")[2].strip(): l.split("|")[-2].strip() for l in p.stdout.splitlines() if l.startswith("| 2 ")}
    assert set(rows) == {"ddp", "p2ptrain", "alone"}
    assert rows["ddp"] == rows["p2ptrain"]  # staleness 0, fp32: DDP's mathematics, the same loss
    for rank in (0, 1):
        events = json.loads((tmp_path / "n2-p2ptrain-none" / f"rank{rank}.json").read_text())["traceEvents"]
        names = {e["name"].split(" ")[0] for e in events if e["ph"] == "X"}
        assert {"batch", "step", "round", "send", "receive", "optimizer"} <= names, names
    # bench/trace_spans.py: where the time went, a row per span with its count (rounds as one row)
    trace = tmp_path / "n2-p2ptrain-none" / "rank0.json"
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X"]
    p = run("bench/trace_spans.py", str(trace))
    assert p.returncode == 0, p.stderr[-1500:]
    counts = {row.split("|")[1].strip(): int(row.split("|")[2]) for row in p.stdout.splitlines()[2:]}
    assert counts["round"] == sum(e["name"].startswith("round ") for e in events) > 0
    assert counts["send"] == sum(e["name"] == "send" for e in events) > 0


def test_local_steps_sim_runs_the_librarys_outer_step():
    p = run("bench/local_steps_sim.py", "--model-size", "100k", "--sync-every", "4", "--delays", "0,5",
            "--seeds", "1", "--target", "2.0", "--max-steps", "40")
    assert p.returncode == 0, p.stdout[-1500:] + p.stderr[-1500:]
    rows = [l for l in p.stdout.splitlines() if l.startswith("| synchronous") or l.startswith("| H = 4")]
    assert len(rows) == 3  # synchronous, then H = 4 at delays 0 and 5
    p = run("bench/local_steps_sim.py", "--model-size", "100k", "--n", "2", "--periods", "1,3", "--rounds-by",
            "samples,time", "--sync-every", "4", "--delays", "1", "--seeds", "1", "--target", "2.0",
            "--max-steps", "40")
    assert p.returncode == 0, p.stdout[-1500:] + p.stderr[-1500:]
    assert "rounds by samples" in p.stdout and "rounds by time" in p.stdout
    assert run("bench/local_steps_sim.py", "--n", "2", "--periods", "3,1").returncode == 2  # (worker 0 the fastest)


def test_a_benchmark_stopped_on_its_timeout_leaves_no_worker_behind():
    # A parent as the benchmarks are: a worker in its own session (out of the parent's group,
    # as lan.py's and gloo_allreduce.py's are), killed in ``finally``; one left in its group.
    code = ("import os, subprocess, sys, time; sys.path.insert(0, 'bench'); import _common; "
            "_common.finally_on_sigterm(); "
            "own = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], start_new_session=True); "
            "grouped = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
            "print(own.pid, grouped.pid, flush=True)\n"
            "try:\n    time.sleep(60)\nfinally:\n    own.kill(); own.wait()")
    with pytest.raises(subprocess.TimeoutExpired) as stopped:
        run_group([sys.executable, "-c", code], timeout=3, cwd=REPO)
    pids = [int(p) for p in stopped.value.stdout.split()]
    assert len(pids) == 2
    deadline = time.monotonic() + 10  # (the one in the group is reaped by init, a moment later)
    while _alive(pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pids)


def _alive(pids):
    alive = []
    for pid in pids:
        try:
            os.kill(pid, 0)
            alive.append(pid)
        except ProcessLookupError:
            pass
    return alive


def test_uneven_bench_quick_reads_a_slow_pair_against_the_fast_peer_alone_and_passes_new_modes_through():
    """One quick run: the fast peer alone, the slow one alone, a pair per ``--runs`` entry (rounds
    by time here, a setting the bench passes through to the library), the fast peer alone stepping
    on 3 batches at a time (``--control``) and the synchronous fp32 reference, each row with its
    figures."""
    p = run("bench/uneven.py", "--quick", "--slow", "3", "--runs", "--staleness 1 --sync-every 1s", "--also", "2",
            "--control")
    assert p.returncode == 0, p.stdout[-1500:] + p.stderr[-1500:]
    lines = [l for l in p.stdout.splitlines() if l.startswith("| 2 ")]
    rows = {l.split("|")[2].strip(): [c.strip() for c in l.split("|")[3:-1]] for l in lines if l.count("|") > 6}
    also = {l.split("|")[2].strip(): l.split("|")[4].strip() for l in lines if l.count("|") == 5}
    # (--also: a second table, the time to each other loss)
    control = "fast alone, 3 batches a step"  # (--control: larger updates without the slower machine)
    assert set(also) == {"fast alone (1 peer)", "--staleness 1 --sync-every 1s", control, "sync fp32"}, also
    assert also["--staleness 1 --sync-every 1s"].endswith("x)") and also[control].endswith("x)"), also
    assert set(rows) == {"fast alone (1 peer)", "slow alone", "--staleness 1 --sync-every 1s", control,
                         "sync fp32"}, rows
    assert int(rows[control][-1]) < int(rows["fast alone (1 peer)"][-1])  # (updates: a step per 3 batches)
    assert rows["fast alone (1 peer)"][1].endswith(" s")  # (its time to the loss: every pair is read against it)
    pair = rows["--staleness 1 --sync-every 1s"]  # (rounds by time, passed through to the library)
    assert pair[0].startswith("3x (") and float(pair[3]) > 0 and float(pair[4]) > 0  # samples/s, vs sum alone
    assert float(rows["sync fp32"][5]) > 0  # its loss at S samples: the pairs' loss @ S is read against it


def test_uneven_bench_reads_time_to_loss_on_the_smoothed_losses_not_on_one_lucky_snapshot():
    """A single snapshot below the target (the optimizer's noise) is not the crossing; the running
    mean's crossing is, interpolated between two snapshots, and the final loss is the last five's mean."""
    sys.path.insert(0, os.path.join(REPO, "bench"))
    import uneven

    assert uneven.smoothed([5.0, 4.0, 3.0, 2.0, 1.0, 0.0]) == [5.0, 4.0, 3.0, 2.0, 1.0, 0.0]  # (a straight line)
    losses = [1.0, 0.9, 0.8, 0.5, 0.8, 0.7, 0.6, 0.5, 0.4, 0.4, 0.4]  # (0.5 at 3 s: a dip)

    class Losses:
        def loss(self, path):
            return losses[int(path)]

    res = uneven.Result("run", 2, t0=100.0, end=110.0, snaps=[[100.0 + i, str(i)] for i in range(len(losses))],
                        timelines=[[[100.0, 0], [110.0, 1000]]])
    out = uneven.read_run(Losses(), res, target=0.55, samples=500, also=(0.85, 0.1))
    assert out["times_to"]["0.1"] is None and 1 < out["times_to"]["0.85"] < 2  # (--also: never; and earlier)
    smooth = uneven.smoothed(losses)
    k = next(i for i, v in enumerate(smooth) if v < 0.55)
    assert k > 3  # (the raw losses cross at the dip)
    assert smooth[k - 1] >= 0.55 > smooth[k]
    assert k - 1 < out["time_to_target"] <= k
    assert out["final_loss"] == pytest.approx(sum(losses[-5:]) / 5)
    assert out["loss_at_samples"] == pytest.approx(smooth[5])  # (500 of 1,000 samples at 5 s of 10)
    # --json keeps each snapshot: seconds into the run, its raw loss, the cluster's samples by then
    assert out["curve"] == [[pytest.approx(i), v, pytest.approx(100 * i)] for i, v in enumerate(losses)]
