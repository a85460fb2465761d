"""What every test runs under: cores to spare (``spare_cores``), no traffic off this machine,
and Ctrl-C as at a terminal.

The network guard (tests/netguard.py) refuses, in this process and in every Python process a
test starts, a connection or datagram to an address that is neither loopback nor inside a
network namespace the tests built, and fails the test that made it with one line saying so,
even when the code under test caught the error or a child process made it.
"""

import os
import signal
import sys
import tempfile
from pathlib import Path

import pytest

import netguard

_TESTS = Path(__file__).resolve().parent
if str(_TESTS.parent / "bench") not in sys.path:
    sys.path.insert(0, str(_TESTS.parent / "bench"))
import netns  # noqa: E402  (bench/ is a folder of scripts; its live_subnets() is the guard's registry)

_LOG: list[str] = []  # this process's refusal log (children append to it through $P2PTRAIN_NETGUARD_LOG)


def pytest_configure(config):
    # A shell starts its background jobs (``pytest &``) with SIGINT ignored, and an ignored signal
    # stays ignored in every process they start: Python then installs no KeyboardInterrupt
    # handler, and the tests that press Ctrl-C in an example saw it trained on to the end. The
    # processes the tests start get SIGINT as a user's terminal gives it.
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    # xdist (3.6 on) hands out the files with the most tests first unless told not to, which put
    # the long files of a few tests each (FIRST, below) at the end of the run.
    config.option.loadscopereorder = False
    guard = netguard.install()
    fd, path = tempfile.mkstemp(prefix="p2ptrain-netguard-", suffix=".log")
    os.close(fd)
    _LOG.append(path)
    os.environ[netguard.LOG_ENV] = path
    os.environ[netguard.HOME_ENV] = str(guard.home or "")
    os.environ[netguard.NS_PREFIX_ENV] = f"{netns.NS_PREFIX}-"
    site = str(_TESTS / "netguard_site")
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if site not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([site, *filter(None, paths)])


def pytest_unconfigure(config):
    for path in _LOG:
        try:
            os.unlink(path)
        except OSError:
            pass


def _refusals_during():
    """Run one phase of a test; if it (or a process it started) sent where tests must not, fail it."""
    path = _LOG[-1]  # (not the environment's: a test may point its own refusals elsewhere)
    before = os.path.getsize(path)
    try:
        return (yield)
    finally:
        with open(path) as f:
            f.seek(before)
            refused = [line.strip() for line in f if line.strip()]
        if refused:
            more = f" (and {len(refused) - 1} more)" if len(refused) > 1 else ""
            raise pytest.fail.Exception(f"{refused[0]}{more}", pytrace=False) from None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    return (yield from _refusals_during())


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    return (yield from _refusals_during())


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item):
    return (yield from _refusals_during())

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
    from p2ptrain.trainer import state

    monkeypatch.setattr(state, "cpu_times", lambda pid="self": None)


# The files that take longest, first (per file, from ``pytest --durations=0`` of a whole run):
# ``--dist loadfile`` hands whole files to the two workers in collection order, so a long file
# left to the end runs alone while the other worker sits idle.
FIRST = ("test_faults.py", "test_join.py", "test_bench.py", "test_bench_lan.py", "test_fuzz.py", "test_heap.py",
         "test_trainer_api.py", "test_soak.py", "test_join_outputs.py", "test_trainer_staleness.py",
         "test_integrations_ddp.py", "test_trainer_local_steps.py", "test_group.py", "test_peer.py",
         "test_limits.py", "test_join_early.py", "test_discovery.py", "test_unused_parameters.py", "test_doctor.py",
         "test_settings.py", "test_bench_cluster_timing.py", "test_integrations_lightning.py",
         "test_integrations_transformers.py", "test_tls.py", "test_codecs.py", "test_trainer_reconcile.py",
         "test_trainer_end.py", "test_examples.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(FIRST)))  # (stable: the rest keep their order)
