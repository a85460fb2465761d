"""What ``join`` leaves behind: the trained model as a file that loads without p2ptrain, and the
records of the run (JSON lines or CSV, TensorBoard), each carrying the cluster's update count."""

import csv
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch
from helpers import ports

from p2ptrain.commands import cli
from p2ptrain.tasks import load_task, param_checksum

pytestmark = pytest.mark.timeout(120)


def join_alone(cwd, *args):
    env = {k: v for k, v in os.environ.items() if k != "P2PTRAIN_NO_SAVE"}  # (conftest: no model files)
    p = subprocess.run([sys.executable, "-m", "p2ptrain", "join", "--task", "synthetic", "--model-size", "100k",
                        "--no-discovery", "--port", str(ports(1)[0]), "--max-rounds", "6", "--eval-every", "3", *args],
                       cwd=cwd, env=env, capture_output=True, text=True, timeout=100)
    assert p.returncode == 0, p.stderr[-1500:]
    return p


def loaded_model(state):
    model = load_task("synthetic", {"model_size": "100k"}).model
    model.load_state_dict(state)  # (strict: every key, nothing more)
    return model


def test_a_run_without_checkpoints_leaves_the_trained_model_in_a_file_and_csv_records(tmp_path):
    p = join_alone(tmp_path, "--metrics", "run.csv")
    path = tmp_path / "synthetic-model.pt"
    assert "model saved to synthetic-model.pt" in p.stdout, p.stdout
    model = loaded_model(torch.load(path, weights_only=True))  # a plain state_dict: no p2ptrain needed
    rows = list(csv.DictReader(open(tmp_path / "run.csv")))
    summary = rows[-1]
    assert summary["event"] == "summary" and summary["version"] == "6"
    assert param_checksum(model) == summary["param_checksum"]  # the final parameters, not the initial ones
    rounds = [r for r in rows if r["event"] == ""]
    assert [int(r["version"]) for r in rounds] == [1, 2, 3, 4, 5, 6]
    assert all(float(r["loss"]) > 0 and int(r["samples"]) > 0 for r in rounds)
    validations = [r for r in rows if r["event"] == "validation"]
    assert [r["version"] for r in validations] == ["3", "6"] and all(float(r["validation_loss"]) > 0
                                                                      for r in validations)


def test_save_path_as_safetensors_and_json_records_carry_the_version(tmp_path):
    pytest.importorskip("safetensors")
    from safetensors.torch import load_file

    p = join_alone(tmp_path, "--save", "out.safetensors", "--metrics", "run.jsonl")
    assert "model saved to out.safetensors" in p.stdout
    records = [json.loads(line) for line in open(tmp_path / "run.jsonl")]
    model = loaded_model(load_file(tmp_path / "out.safetensors"))
    assert param_checksum(model) == records[-1]["param_checksum"] and records[-1]["model"] == "out.safetensors"
    assert [r["version"] for r in records if "event" not in r] == [1, 2, 3, 4, 5, 6]
    assert [(r["version"], r["validation_loss"] > 0) for r in records if r.get("event") == "validation"] == \
        [(3, True), (6, True)]
    assert not (tmp_path / "synthetic-model.pt").exists()


def test_no_save_writes_no_model_file(tmp_path):
    p = join_alone(tmp_path, "--no-save")
    assert "model not saved (--no-save)" in p.stdout and not list(tmp_path.iterdir())


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None, reason="tensorboard is not installed")
def test_tensorboard_event_files_hold_the_loss_at_each_update(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    join_alone(tmp_path, "--tensorboard", "tb", "--no-save")
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")][:6] == [1, 2, 3, 4, 5, 6]
    assert [e.step for e in events.Scalars("validation/loss")][:2] == [3, 6]


def test_tensorboard_without_its_package_is_one_line_before_anything_loads(capsys, monkeypatch, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    try:
        code = cli.main(["join", "--no-discovery", "--port", "0", "--tensorboard", str(tmp_path / "tb")])
    except SystemExit as exc:
        code = exc.code
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert "--tensorboard" in err[0] and "pip install tensorboard" in err[0], err
