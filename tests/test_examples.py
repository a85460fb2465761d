"""The loops in ``examples/`` run as their docstrings say: two processes on loopback train
together, stop at the same update, and the custom loop resumes from its checkpoint."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import finish

pytestmark = pytest.mark.timeout(240)

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def run_pair(example: str, *args: str, per_peer=lambda i: ()) -> list[str]:
    """Both peers' output; each must exit 0."""
    ports = free_ports(2)
    procs = [subprocess.Popen([sys.executable, str(EXAMPLES / example), "--listen", f"127.0.0.1:{ports[i]}",
                               "--peers", f"127.0.0.1:{ports[1 - i]}", "--no-discovery", "--min-peers", "2",
                               "--secret", "s", "--data-seed", str(i + 1), *args, *per_peer(i)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
    outputs = [out for out, _ in finish(procs, timeout=180)]
    for p, out in zip(procs, outputs):
        assert p.returncode == 0, out[-2000:]
    return outputs


@pytest.mark.parametrize("example", ["custom_loop.py", "async_loop.py"])
def test_the_example_loops_train_together_and_stop_at_the_same_update(example):
    outputs = run_pair(example, "--updates", "12", "--compression", "int8")
    for out in outputs:
        if example == "custom_loop.py":
            assert "done: 12 updates; last round 11: 2 members, 64 samples" in out, out[-2000:]
        else:
            assert "rounds applied 12" in out, out[-2000:]


def test_the_custom_loop_resumes_from_its_checkpoint(tmp_path):
    def checkpoint(i):
        return "--checkpoint", str(tmp_path / f"peer{i}.pt")
    run_pair("custom_loop.py", "--updates", "6", per_peer=checkpoint)
    outputs = run_pair("custom_loop.py", "--updates", "10", "--staleness", "1", per_peer=checkpoint)
    for out in outputs:
        assert "resumed at update 6," in out and "done: 10 updates" in out, out[-2000:]
