"""The benchmarks run end to end on a tiny configuration, so that they cannot rot."""

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = [pytest.mark.timeout(240)]


def run(*args):
    env = dict(os.environ, PYTHONPATH=REPO)
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=220)


def test_allreduce_bench_quick_compares_with_gloo():
    p = run("bench/allreduce.py", "--quick", "--codecs", "none,int8")
    assert p.returncode == 0, p.stdout[-1500:] + p.stderr[-1500:]
    lines = [l for l in p.stdout.splitlines() if l.startswith("| 2 ")]
    assert any("gloo" in l for l in lines) and sum("p2ptrain" in l for l in lines) == 2
    assert all("True" in l for l in lines if "p2ptrain" in l)  # bit-identical on every peer


def test_codecs_bench_quick():
    p = run("bench/codecs.py", "--quick")
    assert p.returncode == 0, p.stderr[-1500:]
    for codec in ("none", "fp16", "bf16", "int8", "topk:0.01"):
        assert codec in p.stdout


def test_train_bench_quick_runs_ddp_p2ptrain_and_alone_with_equal_fp32_losses():
    p = run("bench/train.py", "--quick", "--reps", "1")
    assert p.returncode == 0, p.stdout[-1500:] + p.stderr[-1500:]
    rows = {l.split("|")[2].strip(): l.split("|")[-2].strip() for l in p.stdout.splitlines() if l.startswith("| 2 ")}
    assert set(rows) == {"ddp", "p2ptrain", "alone"}
    assert rows["ddp"] == rows["p2ptrain"]  # staleness 0, fp32: DDP's mathematics, the same loss


def test_train_bench_traces_where_a_step_goes(tmp_path):
    """``--trace``: each p2ptrain worker writes a Chrome trace with its batches, steps, rounds,
    the ring's chunks and the optimizer's steps, so a step's time can be taken apart."""
    import json

    p = run("bench/train.py", "--quick", "--reps", "1", "--modes", "p2ptrain", "--trace", str(tmp_path))
    assert p.returncode == 0, p.stdout[-1500:] + p.stderr[-1500:]
    for rank in (0, 1):
        events = json.loads((tmp_path / "n2-none" / f"rank{rank}.json").read_text())["traceEvents"]
        names = {e["name"].split(" ")[0] for e in events if e["ph"] == "X"}
        assert {"batch", "step", "round", "send", "receive", "optimizer"} <= names, names


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
