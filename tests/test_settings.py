"""Settings every peer must share (``p2ptrain.cluster.settings``): a peer that differs is refused
once, at the handshake, with one line; it never loops. The rule, then the library on loopback,
then ``join`` as a user runs it."""

import asyncio
import datetime
import logging
import os
import subprocess
import sys
import time

import pytest
import torch
import torch.nn.functional as F
from helpers import ports, reaped

from p2ptrain import AsyncPeer, SettingsError
from p2ptrain.cluster.settings import differences, refusal, shared

pytestmark = pytest.mark.timeout(60)


# -- the rule -------------------------------------------------------------------------------------

def test_each_shared_setting_that_differs_is_named_with_both_values():
    ours = shared(compression="none", staleness=0, seed=0)
    assert differences(ours, dict(ours)) == []
    theirs = shared(compression="int8+zstd:1", staleness=1, target_batch_size=256, seed=3)
    found = differences(ours, theirs)
    assert found == ["--compression 'int8+zstd:1' there, 'none' here", "--staleness 1 there, 0 here",
                     "--target-batch-size 256 there, 0 here", "--seed 3 there, 0 here"]
    line = refusal("p1", found)
    assert "\n" not in line and line.endswith("start every peer with the same --compression, --seed, --staleness, "
                                              "--target-batch-size")


def test_peers_that_divide_a_rounds_sum_otherwise_are_refused(monkeypatch):
    """``P2PTRAIN_OUTER_WHOLE`` changes the outer step (``LocalSteps.divisor``): two peers that
    differ in it would apply different updates, so it is a shared setting, stated by time only."""
    from p2ptrain.trainer.local_steps import outer_whole

    by_time = dict(compression="int8+zstd:1", staleness=1, sync_every="auto", outer_lr=0.8, outer_momentum=0.6)
    ours = shared(**by_time, outer_whole=outer_whole("auto"))
    monkeypatch.setenv("P2PTRAIN_OUTER_WHOLE", "1")
    theirs = shared(**by_time, outer_whole=outer_whole("auto"))
    assert differences(ours, theirs) == ["P2PTRAIN_OUTER_WHOLE 1 there, 0 here"]
    assert "outer_whole" not in shared(compression="none", staleness=0, outer_whole=outer_whole(None))


def test_what_a_peer_does_not_state_is_not_compared():
    ours = shared(compression="none", staleness=0, seed=0)
    assert differences(ours, None) == [] and differences(ours, "junk") == []  # an older peer
    assert differences(ours, {"compression": "none", "staleness": 0}) == []  # (a library peer: no seed)
    assert differences(ours, {"compression": "x" * 500}) == [f"--compression '{'x' * 39}... there, 'none' here"]


# -- the library ----------------------------------------------------------------------------------

def make():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


async def train(peer, steps):
    for _ in range(steps):
        x = torch.randn(8, 4)
        F.cross_entropy(peer.model(x), torch.zeros(8, dtype=torch.long)).backward()
        await peer.step(batch_size=8)


async def test_two_fresh_peers_with_other_compression_both_stop_at_once():
    addrs = [f"127.0.0.1:{p}" for p in ports(2)]
    peers = [AsyncPeer(*make(), listen=addr, peers=addrs, discovery=False, min_peers=2, step_timeout=20,
                       compression=codec) for addr, codec in zip(addrs, ("int8", "none"))]
    began = time.monotonic()
    async with peers[0], peers[1]:
        results = await asyncio.gather(*(train(p, 1) for p in peers), return_exceptions=True)
    assert all(isinstance(r, SettingsError) for r in results), results
    assert "--compression 'none' there, 'int8+zstd:1' here" in str(results[0])
    assert time.monotonic() - began < 10


async def test_a_training_peer_goes_on_and_says_once_what_a_joiner_with_another_seed_got_wrong(caplog):
    a_port, b_port = ports(2)
    a = AsyncPeer(*make(), listen=f"127.0.0.1:{a_port}", discovery=False, seed=0)
    b = AsyncPeer(*make(), listen=f"127.0.0.1:{b_port}", peers=[f"127.0.0.1:{a_port}"], discovery=False,
                  min_peers=2, step_timeout=20, seed=1)
    caplog.set_level(logging.INFO, logger="p2ptrain")
    async with a:
        await train(a, 3)  # a trains alone first: it is the cluster
        async with b:
            with pytest.raises(SettingsError, match="--seed 0 there, 1 here"):
                await train(b, 1)
        before = a.version
        await train(a, 3)
        assert a.version == before + 3 and a.members == 1
    said = [r.getMessage() for r in caplog.records if "runs with other settings" in r.getMessage()]
    assert len(said) == 1 and "--seed 1 there, 0 here" in said[0] and "keeps training" in said[0], said


def test_the_sync_peer_raises_it_too_for_another_staleness():
    from p2ptrain import Peer

    addrs = [f"127.0.0.1:{p}" for p in ports(2)]
    peers = [Peer(*make(), listen=addr, peers=addrs, discovery=False, min_peers=2, step_timeout=20,
                  staleness=staleness) for addr, staleness in zip(addrs, (0, 1))]
    with peers[0], peers[1]:
        x = torch.randn(8, 4)
        F.cross_entropy(peers[0].model(x), torch.zeros(8, dtype=torch.long)).backward()
        with pytest.raises(SettingsError, match="--staleness 1 there, 0 here"):
            peers[0].step(batch_size=8)


# -- join ------------------------------------------------------------------------------------------

@pytest.mark.timeout(150)
def test_join_peers_with_other_compression_exit_3_within_seconds_with_one_line():
    """(--min-peers 2: neither trains alone first; one that did would go on, and say so once.)
    Seconds from the moment both listen, not from the start: starting takes most of a minute on
    a loaded two-core machine."""
    mine = ports(2)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "-m", "p2ptrain", "join", "--no-discovery", "--port", str(port),
                               "--peers", f"127.0.0.1:{other}", "--task", "synthetic", "--model-size", "100k",
                               "--max-rounds", "100000", "--eval-every", "0", "--min-peers", "2", *codec],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for (port, other), codec in zip(((mine[0], mine[1]), (mine[1], mine[0])), (["--compression", "int8"], []))]
    with reaped(procs):
        outs = [p.communicate(timeout=120) for p in procs]
        ended = time.time()
    assert [p.returncode for p in procs] == [3, 3], [err[-800:] for _, err in outs]
    listening = []
    for _, err in outs:
        said = [line for line in err.splitlines() if "other settings" in line]
        assert len(said) == 1 and said[0].startswith("python -m p2ptrain join: ") and "--compression" in said[0], err[-800:]
        assert "ring failed" not in err and "Traceback" not in err
        stamp = next(line[:23] for line in err.splitlines() if "listening on port" in line)
        listening.append(datetime.datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp())
    assert ended - max(listening) < 15, ended - max(listening)
