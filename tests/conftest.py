"""What every test runs under."""

import os

import pytest

# ``join`` writes the trained model into the current folder at the end of every run: the tests'
# runs (and the benchmarks' they start) write none, but those that test the model file
# (``test_join_outputs``, in a folder of their own). Set here, on import, before any test module
# copies the environment for its subprocesses.
os.environ["P2PTRAIN_NO_SAVE"] = "1"


@pytest.fixture(autouse=True)
def spare_cores(monkeypatch):
    """Peers read how long their threads waited for a CPU (``trainer.cpu_queue``) to decide, in
    local-steps mode at staleness >= 1, whether to wait for each outer update (``pacing``). Two
    peers in one test process wait a lot (measured: 40 % of the time, sleeping as their
    "compute"), and CI's load varies: tests see the machine as one with cores to spare, as off
    Linux, unless they give the peers a clock of their own (``test_trainer_local_steps``)."""
    from p2ptrain.trainer import contributions

    monkeypatch.setattr(contributions, "cpu_times", lambda pid="self": None)
