"""``DistributedOptimizer``: a Horovod user's loop (wrap the optimizer, ``zero_grad``,
``backward``, ``step``, an LR scheduler built on it) trains a cluster with ``Peer``'s
mathematics, and every misuse is refused with a line that says what to do."""

import io
import logging
import pickle

import pytest
import torch
import torch.nn.functional as F
from helpers import ports
from test_trainer_staleness import close_all, run_threads

from p2ptrain import ConfigError, DistributedOptimizer
from p2ptrain.tasks import param_checksum

pytestmark = pytest.mark.timeout(60)


def make(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def batch(seed, n):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 8, generator=g), torch.randint(0, 3, (n,), generator=g)


def alone(seed=0, **options):
    model, inner = make(seed)
    return model, DistributedOptimizer(inner, model, listen="127.0.0.1:0", discovery=False, **options)


def test_two_peers_train_like_one_process_on_the_union_of_their_batches():
    steps, sizes = 4, (8, 4)  # unequal batches: each is weighted by its samples
    a, b = ports(2)
    pairs = [make(seed=0) for _ in range(2)]
    opts = [DistributedOptimizer(inner, model, listen=f"127.0.0.1:{port}", peers=[f"127.0.0.1:{other}"],
                                 discovery=False, min_peers=2, step_timeout=30)
            for (model, inner), port, other in zip(pairs, (a, b), (b, a))]
    schedulers = [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5) for opt in opts]

    def train(rank):
        (model, _), opt, sched = pairs[rank], opts[rank], schedulers[rank]
        for k in range(steps):
            x, y = batch(100 * rank + k, sizes[rank])
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step(batch_size=len(x))
            sched.step()  # staleness 0: one update per step

    try:
        for opt in opts:
            opt.__enter__()
        run_threads([lambda r=r: train(r) for r in range(2)])
    finally:
        close_all(opts)
    assert [opt.peer.version for opt in opts] == [steps, steps]
    assert param_checksum(pairs[0][0]) == param_checksum(pairs[1][0])  # bit-identical replicas

    model, inner = make(seed=0)  # one process, the union of both peers' batches, the same schedule
    sched = torch.optim.lr_scheduler.StepLR(inner, step_size=1, gamma=0.5)
    for k in range(steps):
        xs, ys = zip(*(batch(100 * r + k, sizes[r]) for r in range(2)))
        inner.zero_grad()
        F.cross_entropy(model(torch.cat(xs)), torch.cat(ys)).backward()
        inner.step()
        sched.step()
    for mine, theirs in zip(pairs[0][0].parameters(), model.parameters()):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)
    assert pairs[0][1].param_groups[0]["lr"] == pytest.approx(0.1 / 2**steps)  # the scheduler moved the real lr


def test_step_runs_the_closure_and_returns_its_loss():
    model, opt = alone()
    x, y = batch(0, 8)

    def closure():
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        return loss

    with opt:
        loss = opt.step(closure, batch_size=8)
        assert isinstance(loss, torch.Tensor) and opt.peer.version == 1


def test_a_checkpoint_of_optimizer_state_dict_resumes_parameters_and_lineage():
    model, opt = alone()
    with opt:
        for k in range(3):
            opt.zero_grad()
            F.cross_entropy(model(batch(k, 8)[0]), batch(k, 8)[1]).backward()
            opt.step(batch_size=8)
        saved = io.BytesIO()
        torch.save(opt.state_dict(), saved)
    saved.seek(0)
    model2, opt2 = alone(seed=7)
    opt2.load_state_dict(torch.load(saved, weights_only=True))
    assert param_checksum(model2) == param_checksum(model) and opt2.peer.version == 3


def test_a_plain_optimizer_checkpoint_loads_into_the_wrapped_optimizer():
    model, inner = make()
    inner.param_groups[0]["lr"] = 0.01
    plain = inner.state_dict()
    _, opt = alone()
    opt.load_state_dict(plain)
    assert opt.param_groups[0]["lr"] == 0.01


def test_misuse_is_refused_with_a_line_that_says_what_to_do():
    model, inner = make()
    with pytest.raises(ConfigError, match="wraps a torch.optim.Optimizer"):
        DistributedOptimizer(model, inner)  # arguments swapped
    other = torch.nn.Linear(2, 2)
    with pytest.raises(ConfigError, match="not the model's"):
        DistributedOptimizer(torch.optim.SGD(other.parameters(), lr=0.1), model)
    with pytest.raises(ConfigError, match="staleness"):
        DistributedOptimizer(inner, model, staleness=-1)  # Peer's own checks
    _, opt = alone()
    with pytest.raises(ConfigError, match="cannot gain parameters"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(1))]})
    with pytest.raises(TypeError, match="cannot be pickled"):
        pickle.dumps(opt)
    with opt:
        with pytest.raises(ConfigError, match="before entering"):
            opt.load_state_dict(inner.state_dict())


needs_cpu_grad_scaler = pytest.mark.skipif(not hasattr(torch.amp, "GradScaler"),
                                           reason="GradScaler on the CPU (torch.amp.GradScaler) needs torch 2.3 or newer")


@needs_cpu_grad_scaler
def test_amp_grad_scaler_steps_it_and_skips_a_step_whose_gradient_overflowed(monkeypatch):
    """The README's promise: ``scaler.step(optimizer, batch_size=...)``. An inf gradient (a scale
    too high) makes the scaler skip that peer's step and halve its scale; the cluster trains on,
    and both replicas end bit-identical."""
    params, scales, versions = run_with_grad_scaler(monkeypatch, overlap=False, compression="int8", overflow_at=3,
                                                    steps=8, scale=2.0**16, growth_interval=2000)
    assert versions == [8, 8]
    assert scales == [2.0**15, 2.0**16]  # (the skipped step halved rank 0's)
    assert torch.equal(params[0], params[1]) and bool(torch.isfinite(params[0]).all())


def run_with_grad_scaler(monkeypatch, *, overlap, compression, overflow_at=None, clip=False, steps=12,
                         scale=2.0**10, growth_interval=4):
    """Two peers, a GradScaler each (bf16 autocast, a scale that grows every 4 steps); rank 0's
    gradient overflows at its step ``overflow_at``; ``clip``: the loop unscales the gradients
    itself to clip them (``scaler.unscale_``). Returns the parameters, the scales and the
    versions of both."""
    from p2ptrain.collective import ring
    from p2ptrain.trainer import backward_feed as overlap_module, peer as peer_module

    monkeypatch.setattr(ring, "BUCKET_ELEMS", 32)  # (several buckets for this small model: overlapped)
    taken, filled = [], overlap_module.BackwardFeed.filled  # (batches that went in as the hooks wrote them)
    monkeypatch.setattr(overlap_module.BackwardFeed, "filled", lambda *a: taken.append(filled(*a)) or taken[-1])
    ids = iter(["00000000000000a1", "00000000000000b2"])  # (the ring's order, which int8 rounds by)
    monkeypatch.setattr(peer_module, "new_peer_id", lambda: next(ids))
    pairs = [make(seed=0) for _ in range(2)]
    a, b = ports(2)
    opts = [DistributedOptimizer(inner, model, listen=f"127.0.0.1:{port}", peers=[f"127.0.0.1:{other}"],
                                 discovery=False, min_peers=2, step_timeout=30, compression=compression,
                                 max_rounds=steps, overlap=overlap)
            for (model, inner), port, other in zip(pairs, (a, b), (b, a))]
    scalers = [torch.amp.GradScaler("cpu", init_scale=scale, growth_interval=growth_interval) for _ in range(2)]

    def train(rank):
        (model, _), opt, scaler = pairs[rank], opts[rank], scalers[rank]
        k = 0
        while not opt.peer.finished:
            x, y = batch(100 * rank + k, 8)
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = F.cross_entropy(model(x), y)
            if rank == 0 and k == overflow_at:  # (an overflow in backward itself: overlap's hooks read it)
                loss = loss * 3e38
            scaler.scale(loss).backward()
            if clip:
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            scaler.step(opt, batch_size=len(x))
            scaler.update()
            k += 1

    try:
        for opt in opts:
            opt.__enter__()
        run_threads([lambda r=r: train(r) for r in range(2)])
    finally:
        close_all([opt.peer for opt in opts])
    assert any(taken) == (overlap and not clip)  # (overlapped, bar the steps whose scale changed)
    return ([torch.cat([p.detach().flatten() for p in model.parameters()]) for model, _ in pairs],
            [s.get_scale() for s in scalers], [opt.peer.version for opt in opts])


@needs_cpu_grad_scaler
@pytest.mark.parametrize("compression, overflow_at, clip", [("none", 5, False), ("int8", None, False),
                                                          ("none", 5, True)], ids=["none", "int8", "unscale_"])
def test_amp_grad_scaler_with_overlap_ends_with_the_bits_of_the_run_without(monkeypatch, compression, overflow_at,
                                                                             clip):
    """Overlap reads the gradients during backward, before the scaler unscales them: the cluster
    averaged them 65536 times too large (measured: SGD, 30 steps: last losses 572 and 447 against
    0.27 and 0.35), and then refused GradScaler. The hooks now divide by the scale they guess (the
    last step's) and ``step`` confirms it, or adds the batch unscaled as without overlap where the
    scale changed (it grows every 4 steps here) or skips it where the scaler found an overflow: the
    same bits as the run without overlap (GradScaler's scales are powers of two). A loop that
    unscales them itself to clip them is not overlapped (the hooks cannot know the scale)."""
    without, scales, versions = run_with_grad_scaler(monkeypatch, overlap=False, compression=compression,
                                                     overflow_at=overflow_at, clip=clip)
    with_overlap, scales_o, versions_o = run_with_grad_scaler(monkeypatch, overlap=True, compression=compression,
                                                              overflow_at=overflow_at, clip=clip)
    assert versions == versions_o == [12, 12] and scales == scales_o
    assert scales[1] > 2.0**10 and (overflow_at is None or scales[0] < scales[1])  # (grown; rank 0's halved once)
    assert torch.equal(without[0], without[1]) and torch.equal(with_overlap[0], with_overlap[1])
    assert torch.equal(with_overlap[0], without[0])


@needs_cpu_grad_scaler
def test_amp_grad_scaler_with_overlap_and_int8_skips_an_overflow_and_trains_on(monkeypatch, caplog):
    """An overflow reaches the ring before ``step`` (here ``step`` comes 0.3 s late after one):
    the ring looks that each range it reads of a scaled batch is finite, so it withdraws that
    batch rather than carry the inf into the others' sums; their batches go into the next round,
    as without overlap, where the skipped step never reached a round: the same bits under int8
    too. Only the overflowing peer's scale is halved (and grows again from there)."""
    import time

    step = DistributedOptimizer.step

    def late_after_an_overflow(self, closure=None, *, batch_size=1):  # (the ring meets the inf before step)
        if float(getattr(self, "found_inf", 0.0)) > 0:
            time.sleep(0.3)
        return step(self, closure, batch_size=batch_size)

    monkeypatch.setattr(DistributedOptimizer, "step", late_after_an_overflow)
    caplog.set_level(logging.INFO, logger="p2ptrain")
    without, scales_w, _ = run_with_grad_scaler(monkeypatch, overlap=False, compression="int8", overflow_at=5)
    params, scales, versions = run_with_grad_scaler(monkeypatch, overlap=True, compression="int8", overflow_at=5)
    assert not any("holds a sum with NaN or inf" in r.getMessage() for r in caplog.records)
    assert any("an overflow under GradScaler" in r.getMessage() for r in caplog.records)  # (the ring met it)
    assert versions == [12, 12] and scales == scales_w and scales[0] < scales[1]  # (halved, growth started over)
    assert torch.equal(params[0], params[1]) and torch.equal(params[0], without[0])
