"""AsyncPeer at staleness 0: the same mathematics as one process training on the union of
the peers' batches. This is the proof that the update is right."""

import asyncio
import subprocess

import pytest
import torch
import torch.nn.functional as F
from helpers import async_peers_on_loopback, finish, ports
from netns_util import make_lan, requires_netns  # noqa: F401  (make_lan is a fixture)

from p2ptrain.errors import ClosedError, ConfigError
from p2ptrain.trainer.peer import AsyncPeer

pytestmark = pytest.mark.timeout(60)


def model_and_optimizer():
    torch.manual_seed(0)  # every peer starts from the same parameters
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def batches(rank, rounds):
    g = torch.Generator().manual_seed(100 + rank)
    size = 4 + 3 * rank  # peers with different batch sizes count for their samples
    return [(torch.randn(size, 8, generator=g), torch.randint(0, 3, (size,), generator=g)) for _ in range(rounds)]


@pytest.mark.parametrize("n", [2, 3])
async def test_staleness_0_equals_one_process_on_the_union(n):
    rounds = 4
    data = [batches(r, rounds) for r in range(n)]
    async with async_peers_on_loopback([model_and_optimizer() for _ in range(n)]) as peers:
        async def train(rank):
            peer = peers[rank]
            for x, y in data[rank]:
                F.cross_entropy(peer.model(x), y).backward()
                await peer.step(batch_size=len(x))

        await asyncio.gather(*[train(r) for r in range(n)])

    reference, opt = model_and_optimizer()
    for k in range(rounds):
        x = torch.cat([data[r][k][0] for r in range(n)])
        y = torch.cat([data[r][k][1] for r in range(n)])
        opt.zero_grad()
        F.cross_entropy(reference(x), y).backward()
        opt.step()
    for p in peers:
        assert p.version == rounds
        for mine, ref in zip(p.model.parameters(), reference.parameters()):
            torch.testing.assert_close(mine, ref, rtol=1e-5, atol=1e-6)
    for a, b in zip(peers[0].model.parameters(), peers[1].model.parameters()):
        assert torch.equal(a, b)  # replicas bit-identical


@pytest.mark.parametrize("wrap, prefix", [(lambda m: torch.compile(m, backend="eager"), "_orig_mod."),
                                          (torch.nn.DataParallel, "module.")], ids=["compile", "DataParallel"])
async def test_a_compiled_peer_trains_beside_one_that_is_not(wrap, prefix):
    """``torch.compile`` (a CUDA peer) adds ``_orig_mod.`` to every name, ``nn.DataParallel`` (a
    desktop's two GPUs) ``module.``; a peer that does not wrap its model (MPS, CPU) was refused as
    "another model". Both now sum as one process would."""
    rounds, n = 3, 2
    data = [batches(r, rounds) for r in range(n)]
    made = [model_and_optimizer() for _ in range(n)]
    made[1] = (wrap(made[1][0]), made[1][1])
    assert next(iter(made[1][0].state_dict())).startswith(prefix)
    async with async_peers_on_loopback(made) as peers:
        async def train(rank):
            for x, y in data[rank]:
                F.cross_entropy(peers[rank].model(x), y).backward()
                await peers[rank].step(batch_size=len(x))

        await asyncio.gather(*[train(r) for r in range(n)])
        states = [p.state_dict()["model"] for p in peers]

    reference, opt = model_and_optimizer()
    for k in range(rounds):
        opt.zero_grad()
        F.cross_entropy(reference(torch.cat([d[k][0] for d in data])), torch.cat([d[k][1] for d in data])).backward()
        opt.step()
    for a, b, ref in zip(peers[0].model.parameters(), peers[1].model.parameters(), reference.parameters()):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, ref, rtol=1e-5, atol=1e-6)
    assert list(states[0]) == list(states[1]) == list(reference.state_dict())  # the model's own names


def test_a_compiled_models_state_loads_into_a_model_that_is_not_and_back():
    """Checkpoints travel between a compiled run and one that is not, either way, including a
    state whose names carry the compiled wrapper's prefix."""
    model, opt = model_and_optimizer()
    compiled = torch.compile(model, backend="eager")
    state = AsyncPeer(compiled, opt, discovery=False).state_dict()
    shifted = {**state, "model": {name: t + 1 for name, t in state["model"].items()}, "version": 3}
    plain, plain_opt = model_and_optimizer()
    peer = AsyncPeer(plain, plain_opt, discovery=False)
    peer.load_state_dict(shifted)
    assert all(torch.equal(p, q + 1) for p, q in zip(plain.parameters(), model.parameters())) and peer.version == 3
    again, again_opt = model_and_optimizer()
    prefixed = {**state, "model": compiled.state_dict()}
    AsyncPeer(torch.compile(again, backend="eager"), again_opt, discovery=False).load_state_dict(
        {**prefixed, "model": {k: v * 2 for k, v in prefixed["model"].items()}})
    assert all(torch.equal(p, q * 2) for p, q in zip(again.parameters(), model.parameters()))


async def test_a_peer_that_left_leaves_no_task_on_its_loop():
    model, opt = model_and_optimizer()
    peer = AsyncPeer(model, opt, listen="127.0.0.1:0", min_peers=1, secret="s", discovery=False,
                     peers=["127.0.0.1:9"])  # (an address to propose: the proposer runs)
    async with peer:
        for x, y in batches(0, 2):
            F.cross_entropy(model(x), y).backward()
            await peer.step(batch_size=len(x))
    loop = peer._lifetime.loop  # the cluster's loop, stopped now: what still pends there never ends
    assert [t for t in asyncio.all_tasks(loop) if not t.done()] == []


async def test_an_opening_cut_short_closes_what_it_opened(monkeypatch, caplog):
    """``asyncio.wait_for(peer.__aenter__(), t)``, or Ctrl-C, while the peer opens (here: a --peers
    name slow to resolve): the loop thread was stopped under the opening, which left the
    peer's port listening and asyncio's "Task was destroyed but it is pending!"."""
    import gc
    import socket

    from p2ptrain.net import discovery

    async def slow(entries):
        await asyncio.sleep(30)

    monkeypatch.setattr(discovery, "resolve_static_peers", slow)
    model, opt = model_and_optimizer()
    peer = AsyncPeer(model, opt, listen="127.0.0.1:0", secret="s", discovery=False, peers=["slow.example:7000"])
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(peer.__aenter__(), 0.5)
    gc.collect()  # (a task left pending on the stopped loop is said as it is collected)
    assert not [r for r in caplog.records if "destroyed but it is pending" in r.getMessage()]
    assert peer.cluster.mesh._closed  # closed, not only dropped with its thread
    port = peer.cluster.port
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", port))  # the port is free again: its listener was closed
    with pytest.raises(ClosedError):  # (and the peer is done: a new one joins)
        await peer.__aenter__()


async def test_an_opening_cut_short_finishes_closing_what_it_opened_however_long_that_takes(monkeypatch):
    """The waiter's cancel reaches the opening through its future; the opening then closes what
    it opened, which takes some awaits (a goodbye, the links). A second cancel, sent after the
    first to make sure, cut that closing short: under load the peer's mesh stayed open."""
    from p2ptrain.cluster.cluster import Cluster
    from p2ptrain.net import discovery

    async def slow(entries):
        await asyncio.sleep(30)

    close = Cluster.close

    async def slow_close(self):
        await asyncio.sleep(0.3)  # (a goodbye that takes a while)
        await close(self)

    monkeypatch.setattr(discovery, "resolve_static_peers", slow)
    monkeypatch.setattr(Cluster, "close", slow_close)
    model, opt = model_and_optimizer()
    peer = AsyncPeer(model, opt, listen="127.0.0.1:0", secret="s", discovery=False, peers=["slow.example:7000"])
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(peer.__aenter__(), 0.5)
    assert peer.cluster.mesh._closed


async def test_a_waiter_interrupted_as_the_opening_ends_leaves_the_peer_it_opened(monkeypatch):
    """Ctrl-C in ``join`` just as its peer finished opening: the waiter saw CancelledError, the
    opening had succeeded on the loop thread, and its thread was stopped with the cluster
    running ("Task was destroyed but it is pending!" for its actor, ticker, pings)."""
    from p2ptrain.trainer import peer as peer_module

    wrap = asyncio.wrap_future

    async def interrupted_once_opened(future):
        monkeypatch.setattr(peer_module.asyncio, "wrap_future", wrap)
        await asyncio.get_running_loop().run_in_executor(None, future.result)  # the opening succeeded...
        raise asyncio.CancelledError  # ... and its waiter was interrupted before it heard so

    model, opt = model_and_optimizer()
    peer = AsyncPeer(model, opt, listen="127.0.0.1:0", secret="s", discovery=False)
    monkeypatch.setattr(peer_module.asyncio, "wrap_future", interrupted_once_opened)
    with pytest.raises(asyncio.CancelledError):
        await peer.__aenter__()
    assert peer.cluster.mesh._closed and peer.discovery._closed  # it left: nothing runs on


def test_bad_options_are_refused_clearly():
    model, opt = model_and_optimizer()
    with pytest.raises(ConfigError, match="target_batch_size needs staleness >= 1"):
        AsyncPeer(model, opt, target_batch_size=64)
    with pytest.raises(ConfigError, match="target_batch_size must be an int >= 1"):
        AsyncPeer(model, opt, target_batch_size=0, staleness=1)
    for bad, match in [({"staleness": -1}, "staleness must be"), ({"min_peers": 0}, "min_peers must be"),
                       ({"compression": "int9"}, "int9"), ({"listen": "nonsense"}, "host:port"),
                       ({"clip_grad_norm": 0}, "clip_grad_norm")]:
        with pytest.raises(ConfigError, match=match):
            AsyncPeer(model, opt, **bad)


def test_a_model_and_optimizer_that_do_not_belong_together_are_refused_at_once():
    """Not at the first step, and never by training nothing: an optimizer over another module's
    parameters stepped tensors without gradients (none moved), and one holding a tensor outside
    the model would step it on gradients no peer averages."""
    model, opt = model_and_optimizer()
    other, other_opt = model_and_optimizer()
    extra = torch.zeros(3, requires_grad=True)
    lazy = torch.nn.Sequential(torch.nn.LazyLinear(4), torch.nn.Linear(4, 2))  # (torch's error at numel() before)
    # (a complex gradient lost its imaginary part in the sum: two peers stepped on its real part alone)
    spectral = torch.nn.Linear(2, 2, bias=False)
    spectral.weight = torch.nn.Parameter(torch.randn(2, 2, dtype=torch.complex64))
    for args, match in [(("model", opt), "model must be a torch.nn.Module, got str"),
                        ((model, "sgd"), "optimizer must be a torch.optim.Optimizer over the model's parameters"),
                        ((model, other_opt), r"steps \d+ tensor\(s\) that are not the model's parameters"),
                        ((model, torch.optim.SGD([*model.parameters(), extra], lr=0.1)), "steps 1 tensor"),
                        ((lazy, torch.optim.SGD(lazy.parameters(), lr=0.1)), "lazy parameters .* run one forward"),
                        ((spectral, torch.optim.SGD(spectral.parameters(), lr=0.1)),
                         "parameter 'weight' is complex64: peers average real tensors only; .*view_as_real")]:
        with pytest.raises(ConfigError, match=match):
            AsyncPeer(*args, discovery=False)
    AsyncPeer(model, torch.optim.SGD([next(model.parameters())], lr=0.1), discovery=False)  # a part is the user's choice


def test_a_state_that_does_not_fit_is_refused_before_anything_loads():
    """torch's own loads copy every tensor that fits and then raise: a state with one wrong
    shape left the others loaded and a bare RuntimeError (a KeyError or TypeError for others)."""
    model, opt = model_and_optimizer()
    peer = AsyncPeer(model, opt, discovery=False)
    good = peer.state_dict()
    before = [p.detach().clone() for p in model.parameters()]
    shifted = {name: t + 1 for name, t in good["model"].items()}
    lone = torch.zeros(1, requires_grad=True)
    for state, match in [("ckpt.pt", "got a str without 'model' and 'optimizer'"),
                         ({"x": 1}, "got a dict without"),
                         ({**good, "model": {**shifted, "2.bias": torch.zeros(4)}}, r"'2.bias' is torch.Size\(\[4\]\)"),
                         ({**good, "model": {**shifted, "extra": torch.zeros(1)}}, "'extra' is in the state only"),
                         ({**good, "optimizer": torch.optim.SGD([lone], lr=1).state_dict()}, "other parameter groups"),
                         ({**good, "version": -5}, "version -5 is not an int"),
                         ({**good, "sync": ["x", b"", 0, 0]}, "'sync' entry is malformed")]:
        with pytest.raises(ConfigError, match=match):
            peer.load_state_dict(state)
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))  # nothing loaded
    peer.load_state_dict({**good, "model": shifted, "version": 7})
    assert all(torch.equal(p, q + 1) for p, q in zip(model.parameters(), before)) and peer.version == 7


def test_async_example_trains_with_two_processes():
    import os
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    base = ports(2)[0]
    cmd = [sys.executable, os.path.join(repo, "examples", "async_loop.py"), "--min-peers", "2", "--updates", "30",
           "--no-discovery"]
    env = dict(os.environ, OMP_NUM_THREADS="1")  # a torch thread each, as on two machines (not two spinning pools)
    procs = [subprocess.Popen(cmd + ["--listen", f"127.0.0.1:{base + r}", "--peers", f"127.0.0.1:{base + 1 - r}"],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    outs = finish(procs, timeout=50)
    assert [p.returncode for p in procs] == [0, 0], [e[-1000:] for _, e in outs]
    for out, _ in outs:
        last = out.strip().splitlines()[-1]
        assert "rounds applied 30" in last, out



@requires_netns
def test_peers_on_three_hosts_find_each_other_by_discovery_alone(make_lan):  # noqa: F811 (a fixture)
    import os
    import sys

    lan = make_lan(3, ["1gbit"] * 3)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cmd = [sys.executable, os.path.join(repo, "examples", "async_loop.py"), "--listen", "0.0.0.0:7100",
           "--min-peers", "3", "--updates", "20", "--secret", "lab-secret"]  # no --peers: beacons only
    env = dict(os.environ, PYTHONPATH=repo, OMP_NUM_THREADS="1")  # a torch thread per host: they share the cores
    procs = [lan.popen(i, cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(3)]
    outs = finish(procs, timeout=60)
    assert [p.returncode for p in procs] == [0, 0, 0], [e[-1500:] for _, e in outs]
    for out, _ in outs:
        assert "rounds applied 20" in out.strip().splitlines()[-1], out
