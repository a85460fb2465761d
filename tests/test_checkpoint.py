"""Checkpoints: what a trainer saves comes back whole, old ones are pruned, a bad file is
named and skipped, and a writer killed with SIGKILL at any moment leaves a good one."""

import errno
import logging
import os
import pickle
import random
import signal
import subprocess
import sys
import time
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
import torch

from p2ptrain.trainer.checkpoint import (
    FORMAT_KEY,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    load_latest,
    save_checkpoint,
)
from p2ptrain.errors import CheckpointError, ConfigError

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parents[1]


def trained(opt_name: str, steps: int = 3):
    """A small model with a buffer (BatchNorm) and its optimizer after a few steps."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 3))
    opt = (torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9) if opt_name == "sgd"
           else torch.optim.Adam(model.parameters(), lr=0.01))
    for _ in range(steps):
        step(model, opt)
    return model, opt


def step(model, opt):
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 6, generator=gen), torch.randint(0, 3, (16,), generator=gen)
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()


def trainer_state(model, opt, round: int = 7) -> dict:
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "round": round, "version": round,
            "digest": bytes(range(16)).hex(), "fingerprint": [[n, list(p.shape), str(p.dtype)]
                                                        for n, p in model.named_parameters()],
            "config": {"task": "synthetic", "batch_size": 16, "lr": 0.1}, "samples": 112}


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return type(a) is type(b) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


@pytest.mark.parametrize("opt_name", ["sgd", "adam"])
def test_resuming_from_a_checkpoint_continues_bit_for_bit(tmp_path, opt_name):
    model, opt = trained(opt_name)
    state = trainer_state(model, opt)
    path = save_checkpoint(tmp_path, state, round=7)
    assert path == tmp_path / "ckpt-r00000007.pt"
    loaded = load_checkpoint(path)
    assert same(state, loaded)  # every key and type: nested lists, int keys of optimizer state
    assert FORMAT_KEY not in loaded
    assert opt.state_dict()["state"][0]["momentum_buffer" if opt_name == "sgd" else "exp_avg_sq"].abs().sum() > 0

    fresh_model, fresh_opt = trained(opt_name, steps=0)
    fresh_model.load_state_dict(loaded["model"])
    fresh_opt.load_state_dict(loaded["optimizer"])
    step(model, opt)
    step(fresh_model, fresh_opt)
    for a, b in zip(model.state_dict().values(), fresh_model.state_dict().values()):
        assert torch.equal(a, b)


def test_every_type_a_safe_load_accepts_round_trips(tmp_path):
    state = {"od": OrderedDict(a=1), "list": [1, 2.5, "x", None, True], "tuple": (1, (2, 3)), "big": 2 ** 70,
             "size": torch.Size([2, 3]), "param": torch.nn.Parameter(torch.ones(2)),
             "int8": torch.arange(4, dtype=torch.int8), "bf16": torch.ones(3, dtype=torch.bfloat16), 3: "int key"}
    assert same(state, load_checkpoint(save_checkpoint(tmp_path, state, 1)))


@pytest.mark.parametrize("bad, where", [
    ({"config": {"lr": np.float64(0.1)}}, "state['config']['lr'] is a numpy.float64"),
    ({"p": __import__("collections").namedtuple("P", "a")(1)}, "state['p'] is a"),
    ({"f": len}, "state['f'] is a builtins.builtin_function_or_method"),
    # (this torch loads these; torch 2.2 or 2.4 does not: a checkpoint moves to a Mac's older torch)
    ({"digest": b"\x00\xff"}, "state['digest'] is a builtins.bytes, which a safe load (weights_only) refuses, in "
                               "torch 2.2 at least"),
    ({"ids": {1, 2}}, "state['ids'] is a builtins.set"),
    ({"z": [bytearray(b"a")]}, "state['z'][0] is a builtins.bytearray"),
    ({"c": 1j}, "state['c'] is a builtins.complex"),
    ({"n": __import__("collections").Counter("ab")}, "state['n'] is a collections.Counter"),
    ({"where": torch.device("cpu")}, "state['where'] is a torch.device"),
    ({"dtype": torch.bfloat16}, "state['dtype'] is a torch.dtype"),
])
def test_a_state_a_safe_load_would_refuse_is_not_written(tmp_path, bad, where):
    with pytest.raises(ConfigError, match=__import__("re").escape(where)):
        save_checkpoint(tmp_path, bad, 1)
    assert list(tmp_path.iterdir()) == []


def test_bad_arguments(tmp_path):
    for kwargs in ({"round": -1}, {"round": 1.0}, {"round": True}, {"round": 1, "keep": 0}):
        with pytest.raises(ConfigError):
            save_checkpoint(tmp_path, {}, **kwargs)
    with pytest.raises(ConfigError, match="state\\['round'\\] is 4"):
        save_checkpoint(tmp_path, {"round": 4}, 5)
    with pytest.raises(ConfigError, match="must be a dict"):
        save_checkpoint(tmp_path, [1], 5)


def test_keep_prunes_the_oldest(tmp_path):
    for r in range(1, 7):
        save_checkpoint(tmp_path / "a", {"round": r}, r, keep=3)
    assert [r for r, _ in list_checkpoints(tmp_path / "a")] == [4, 5, 6]
    save_checkpoint(tmp_path / "a", {"round": 7}, 7, keep=1)
    assert sorted(os.listdir(tmp_path / "a")) == ["ckpt-r00000007.pt"]
    assert latest_checkpoint(tmp_path / "a") == tmp_path / "a" / "ckpt-r00000007.pt"
    assert latest_checkpoint(tmp_path / "missing") is None and load_latest(tmp_path / "missing") is None


def test_saving_an_older_round_keeps_it_and_warns(tmp_path, caplog):
    for r in (10, 11):
        save_checkpoint(tmp_path, {}, r, keep=2)
    with caplog.at_level(logging.WARNING, logger="p2ptrain.trainer.checkpoint"):
        path = save_checkpoint(tmp_path, {}, 3, keep=2)
    assert path.exists() and [r for r, _ in list_checkpoints(tmp_path)] == [3, 11]
    assert "later round" in caplog.text


def test_a_truncated_or_garbage_file_is_named_and_skipped(tmp_path, caplog):
    save_checkpoint(tmp_path, {"round": 1, "w": torch.ones(1000)}, 1)
    p2 = save_checkpoint(tmp_path, {"round": 2, "w": torch.ones(1000)}, 2)
    p2.write_bytes(p2.read_bytes()[: p2.stat().st_size // 2])
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(p2)
    assert str(p2) in str(info.value) and "\n" not in str(info.value) and "delete it" in str(info.value)

    garbage = tmp_path / "ckpt-r00000003.pt"
    garbage.write_bytes(os.urandom(5000))
    with pytest.raises(CheckpointError, match="ckpt-r00000003.pt"):
        load_checkpoint(garbage)
    with caplog.at_level(logging.WARNING, logger="p2ptrain.trainer.checkpoint"):
        path, state = load_latest(tmp_path)
    assert path.name == "ckpt-r00000001.pt" and state["round"] == 1
    assert "ckpt-r00000003.pt" in caplog.text and "ckpt-r00000002.pt" in caplog.text
    assert garbage.exists() and p2.exists()  # left for a human to look at
    (tmp_path / "ckpt-r00000001.pt").write_bytes(b"\0" * 100)  # none loads now: no start over
    with pytest.raises(CheckpointError, match=r"none of the 3 checkpoint\(s\) in .* loads, the newest because "
                                              r"checkpoint .*ckpt-r00000003.pt.*use another directory"):
        load_latest(tmp_path)
    assert len(list(tmp_path.iterdir())) == 3


def test_a_file_that_is_not_a_p2ptrain_checkpoint(tmp_path):
    torch.save(torch.ones(3), tmp_path / "plain.pt")
    with pytest.raises(CheckpointError, match="not a p2ptrain checkpoint"):
        load_checkpoint(tmp_path / "plain.pt")
    newer = tmp_path / "newer.pt"
    torch.save({FORMAT_KEY: 99}, newer)
    with pytest.raises(CheckpointError, match="upgrade p2ptrain"):
        load_checkpoint(newer)
    with pytest.raises(CheckpointError, match="no checkpoint file"):
        load_checkpoint(tmp_path / "absent.pt")


class _Exploit:
    def __reduce__(self):
        return (os.mkdir, (self.target,))


def test_a_malicious_pickle_is_refused_not_run(tmp_path):
    exploit = _Exploit()
    exploit.target = str(tmp_path / "pwned")
    evil = tmp_path / "ckpt-r00000001.pt"
    torch.save({FORMAT_KEY: 1, "x": exploit}, evil)
    with pytest.raises(CheckpointError, match="ckpt-r00000001.pt"):
        load_checkpoint(evil)
    evil.write_bytes(pickle.dumps(exploit, protocol=2))  # a bare pickle, not torch's zip layout
    with pytest.raises(CheckpointError):
        load_checkpoint(evil)
    assert not (tmp_path / "pwned").exists()


def test_a_checkpoint_an_older_torchs_safe_load_refuses_says_so(tmp_path, monkeypatch):
    """torch 2.4's safe loader refuses what a newer torch wrote with bytes in it (measured: a
    join checkpoint of torch 2.13 read on torch 2.4.1); it was called truncated or corrupt."""
    import pickle

    path = save_checkpoint(tmp_path, {"x": 1}, round=1)

    def refuse(*args, **kwargs):
        raise pickle.UnpicklingError("Weights only load failed. This file can still be loaded, ...\n\tWeightsUnpickler "
                                     "error: Unsupported global: GLOBAL _codecs.encode was not an allowed global")

    monkeypatch.setattr(torch, "load", refuse)
    with pytest.raises(CheckpointError, match=r"cannot be read safely by this torch .*_codecs.encode\): install the "
                                              r"torch that wrote it, or a newer one"):
        load_checkpoint(path)

    def refuse_as_torch_2_2(*args, **kwargs):  # (one line, the reason at its end)
        raise pickle.UnpicklingError("Weights only load failed. Re-running `torch.load` with `weights_only` set to "
                                     "`False` will likely succeed, but it can result in arbitrary code execution."
                                     "Do it only if you get the file from a trusted source. WeightsUnpickler error: "
                                     "Unsupported class _codecs.encode")

    monkeypatch.setattr(torch, "load", refuse_as_torch_2_2)
    with pytest.raises(CheckpointError, match=r"this torch .* \(WeightsUnpickler error: Unsupported class "
                                              r"_codecs.encode\): install"):
        load_checkpoint(path)


def test_temp_leftovers_are_ignored_and_cleaned(tmp_path):
    save_checkpoint(tmp_path, {}, 1)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          timeout=30, check=True)
    dead_pid = int(dead.stdout)
    stray = tmp_path / f".ckpt-r00000009.pt.tmp-{dead_pid}-0badf00d"
    stray.write_bytes(b"half a checkpoint")
    live = tmp_path / f".ckpt-r00000008.pt.tmp-{os.getppid()}-00c0ffee"  # a live writer, maybe on another save
    live.write_bytes(b"in progress")
    old = tmp_path / f".ckpt-r00000007.pt.tmp-{os.getppid()}-0000dead"
    old.write_bytes(b"a day old")
    os.utime(old, (time.time() - 86400, time.time() - 86400))
    assert latest_checkpoint(tmp_path).name == "ckpt-r00000001.pt"
    assert load_latest(tmp_path)[0].name == "ckpt-r00000001.pt"

    save_checkpoint(tmp_path, {}, 2)
    assert not stray.exists() and not old.exists()
    assert live.exists()


def test_a_failing_disk_raises_checkpoint_error_and_leaves_no_temp(tmp_path, monkeypatch):
    save_checkpoint(tmp_path, {"round": 1}, 1)

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(CheckpointError) as info:
        save_checkpoint(tmp_path, {"round": 2}, 2)
    message = str(info.value)
    assert "ckpt-r00000002.pt" in message and "No space left" in message and "free some disk space" in message
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == ["ckpt-r00000001.pt"]
    assert load_latest(tmp_path)[1] == {"round": 1}

    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(CheckpointError, match="a-file"):
        save_checkpoint(blocker / "ckpts", {}, 1)


def test_a_disk_that_fills_while_torch_writes_raises_checkpoint_error(tmp_path, monkeypatch):
    """torch's zip writer turns the disk's ENOSPC into ``RuntimeError: [enforce fail ...]
    unexpected pos`` as it closes the archive; ``join`` ended in that traceback (a real full
    tmpfs, by hand). It is the disk's error, said as one."""
    import builtins
    import io

    from p2ptrain.trainer import checkpoint as module

    class Filling(io.RawIOBase):
        def __init__(self, f):
            self.f = f

        def writable(self):
            return True

        def write(self, data):
            if self.f.tell() + len(data) > 4096:
                raise OSError(errno.ENOSPC, "No space left on device")
            return self.f.write(data)

        def fileno(self):
            return self.f.fileno()

        def close(self):
            self.f.close()
            super().close()

    monkeypatch.setattr(module, "open", lambda path, mode: Filling(builtins.open(path, mode)), raising=False)
    with pytest.raises(CheckpointError, match="No space left on device.*free some disk space"):
        save_checkpoint(tmp_path, {"model": {"w": torch.zeros(100_000)}}, 1)
    assert os.listdir(tmp_path) == []  # no temporary file left


# The writer: imports torch once, then forks a child per "start ROUND" line that saves a
# ~5 MB state every round until it is killed; "reap PID" waits for a killed child.
WRITER = r"""
import os, sys
import torch
from p2ptrain.trainer.checkpoint import save_checkpoint
directory, numel = sys.argv[1], int(sys.argv[2])
for line in sys.stdin:
    cmd, arg = line.split()
    if cmd == "start":
        pid = os.fork()
        if pid == 0:
            try:
                for r in range(int(arg), int(arg) + 2000):  # bounded: about 30 s
                    state = {"model": {"w": torch.full((numel,), float(r))}, "round": r,
                             "digest": r.to_bytes(8, "little").hex(),
                             "fingerprint": [["w", [numel], "torch.float32"]], "samples": 16 * r}
                    save_checkpoint(directory, state, r, keep=2)
            finally:
                os._exit(0)
        print(pid, flush=True)
    elif cmd == "reap":
        _, status = os.waitpid(int(arg), 0)
        print(status, flush=True)
"""


def test_kill_9_never_leaves_a_corrupt_checkpoint(tmp_path):
    numel = 5 * 2**20 // 4  # 5 MiB of float32
    rng = random.Random(1234)
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path), str(numel)], cwd=REPO,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True)
    child = None  # the running (not yet reaped) child: a reaped pid may belong to anyone by now
    kills = mid_write = 0
    try:
        start = 0
        while kills < 5 or (mid_write < 2 and kills < 12):  # most kills land mid-save; make sure some did
            writer.stdin.write(f"start {start}\n")
            writer.stdin.flush()
            child = int(writer.stdout.readline())
            deadline = time.monotonic() + 30
            while (latest := latest_checkpoint(tmp_path)) is None or int(latest.name[6:14]) < start:
                assert time.monotonic() < deadline, "the writer saved nothing in 30 s"
                time.sleep(0.005)
            time.sleep(rng.uniform(0, 0.1))
            os.kill(child, signal.SIGKILL)
            kills += 1
            writer.stdin.write(f"reap {child}\n")
            writer.stdin.flush()
            status = int(writer.stdout.readline())
            child = None
            assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL

            mid_write += any(n.startswith(".ckpt-") for n in os.listdir(tmp_path))
            path, state = load_latest(tmp_path)
            r = state["round"]
            assert path.name == f"ckpt-r{r:08d}.pt" and path == latest_checkpoint(tmp_path)
            assert r >= start
            assert state["model"]["w"].shape == (numel,) and bool((state["model"]["w"] == float(r)).all())
            assert state["digest"] == r.to_bytes(8, "little").hex() and state["samples"] == 16 * r
            start = r + 1
    finally:
        if child is not None:
            os.kill(child, signal.SIGKILL)
        try:
            os.killpg(writer.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        writer.wait()
    save_checkpoint(tmp_path, {"round": start}, start, keep=2)
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")], "stray temp files survived the next save"
    assert mid_write >= 1, f"none of {kills} kills landed mid-save: the test proved nothing"
