"""join's training thread runs below its network threads (Linux), and only while it trains."""

import os
import sys
import threading

import pytest

from p2ptrain.commands import priority
from p2ptrain.errors import ConfigError

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="nice is per thread on Linux only")]


def _nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def _in_a_thread(fn):
    """``fn()`` on a fresh thread (its nice value is that thread's alone); its result."""
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("r", fn()))
    t.start()
    t.join(10)
    return out["r"]


def test_the_training_thread_is_below_the_threads_started_before_it(monkeypatch):
    monkeypatch.delenv(priority.ENV, raising=False)

    def train():
        base = _nice()
        network = {}
        started = threading.Event()
        release = threading.Event()

        def network_thread():  # (started before training: the cluster's threads)
            network["nice"] = _nice()
            started.set()
            release.wait(5)
            network["after"] = _nice()

        t = threading.Thread(target=network_thread)
        t.start()
        started.wait(5)
        with priority.training_below_network():
            inside = _nice()
            release.set()
            t.join(5)
        return base, inside, network, _nice()

    base, inside, network, after = _in_a_thread(train)
    assert inside == min(19, base + priority.TRAINING_NICE)
    assert network == {"nice": base, "after": base}  # (the network thread keeps its priority)
    if os.geteuid() == 0:  # (put back where the OS lets us: root here)
        assert after == base


def test_the_switch_turns_it_off(monkeypatch):
    monkeypatch.setenv(priority.ENV, "0")

    def train():
        base = _nice()
        with priority.training_below_network():
            return base, _nice()

    base, inside = _in_a_thread(train)
    assert inside == base


def test_a_bad_switch_is_a_one_line_error(monkeypatch):
    monkeypatch.setenv(priority.ENV, "yes")
    with pytest.raises(ConfigError, match="P2PTRAIN_NETWORK_FIRST='yes': expected 0 or 1"):
        priority.network_first_enabled()


def test_join_trains_below_its_network_threads(tmp_path):
    import subprocess

    out = subprocess.run([sys.executable, "-m", "p2ptrain", "join", "--log-level", "debug", "--no-discovery",
                          "--task", "synthetic", "--model-size", "20k", "--max-rounds", "2",
                          "--checkpoint-dir", str(tmp_path)],
                         env={k: v for k, v in os.environ.items() if k != priority.ENV},
                         capture_output=True, text=True, timeout=50)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "training thread at nice" in out.stderr
