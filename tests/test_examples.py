"""The library examples as a user runs them (on loopback): Ctrl-C leaves the cluster politely,
in one line, exits 0, and the custom loop's checkpoint is saved (it printed a KeyboardInterrupt
traceback and exited 130; the sync loop's interrupt could land in the middle of an optimizer step)."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import ports, reaped

pytestmark = pytest.mark.timeout(90)
REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("example", ["custom_loop.py", "async_loop.py"])
def test_ctrl_c_in_an_example_leaves_in_one_line_and_exits_0(tmp_path, example):
    checkpoint = tmp_path / "ckpt.pt"
    args = [sys.executable, str(REPO / "examples" / example), "--no-discovery", "--listen",
            f"127.0.0.1:{ports(1)[0]}", "--updates", "100000", "--secret", "s"]
    if example == "custom_loop.py":
        args += ["--checkpoint", str(checkpoint)]
    p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    with reaped(p):
        first = p.stdout.readline()  # (the first step's line: it trains)
        assert first.startswith("step"), (first, p.stderr.read() if p.poll() is not None else "")
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err[-1500:]
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err[-1500:]
    if example == "custom_loop.py":
        assert "stopped by Ctrl-C at update" in out and f"saved to {checkpoint}" in out, out
        state = torch.load(checkpoint, weights_only=True)
        assert state["version"] >= 1 and set(state["model"]) == {"0.weight", "0.bias", "2.weight", "2.bias"}
