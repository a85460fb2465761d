"""Local-steps mode (DiLoCo, ``sync_every``) with real peers on loopback: H = 1 with an outer
SGD of lr 1 and no momentum is gradient mode with plain SGD; H = 8..32 with int8 reaches
synchronous training's loss in the same samples; replicas end identical; a joiner gets the
outer state; bad keywords are one clear error."""

import time

import pytest
import torch

from p2ptrain import Peer
from p2ptrain.cluster import roundmsg as M
from p2ptrain.errors import ConfigError
from p2ptrain.trainer.local_steps import LocalSteps

from test_trainer_staleness import (close_all, eval_loss, joining_late, make_adam, make_other_start, open_peers,
                                    run_threads, train_at_speeds, train_loop)

pytestmark = pytest.mark.timeout(120)


def make_sgd():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def test_the_outer_step_is_torch_sgd_with_nesterov_and_progress_made_since_a_contribution_is_kept():
    p = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    local = LocalSteps([p], every=1, lr=0.7, momentum=0.9)
    ref = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    sgd = torch.optim.SGD([ref], lr=0.7, momentum=0.9, nesterov=True)
    for g in ([0.5, -1.0], [0.25, 0.5]):
        with torch.no_grad():
            p.sub_(torch.tensor(g))  # an inner step of -g
        delta, samples = local.contribute()
        assert torch.allclose(delta[0], torch.tensor(g))
        with torch.no_grad():
            p.add_(torch.tensor([0.01, 0.02]))  # progress after the contribution, before the round lands
        local.apply(delta[0].clone())
        ref.grad = torch.tensor(g)
        sgd.step()
        assert torch.allclose(local.outer[0], ref.detach())  # the outer parameters: SGD's, exactly as torch
        assert torch.allclose(p.detach(), ref.detach() + torch.tensor([0.01, 0.02]))  # progress kept on top
        with torch.no_grad():
            p.sub_(torch.tensor([0.01, 0.02]))  # (the next contribution would carry it; cancel it here)


def test_inner_steps_that_diverge_are_left_out_and_start_again_from_the_outer_parameters(caplog):
    """A NaN batch made the parameters NaN, so every pseudo-gradient after it was NaN: int8 could
    not carry one, and each round failed in turn (two peers: version 1 after 60 s). Now the
    contribution is refused where it is formed, and the model and its optimizer start again."""
    p = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    adam = torch.optim.Adam([p], lr=0.1)
    local = LocalSteps([p], every=2, lr=0.7, momentum=0.9, inner=adam)
    p.grad = torch.tensor([float("nan"), 1.0])
    adam.step()  # (NaN in the parameters and in Adam's moments)
    local.stepped(16)
    with caplog.at_level("WARNING", logger="p2ptrain.trainer.peer"):
        delta, samples = local.contribute()
    assert delta is None and samples == 16 and "the inner steps diverged" in caplog.text
    assert torch.equal(p.detach(), torch.tensor([1.0, 2.0])) and not adam.state  # started again
    with torch.no_grad():
        p.sub_(torch.tensor([0.5, 0.5]))
    local.stepped(16)
    delta, samples = local.contribute()  # the next steps contribute as ever
    assert torch.equal(delta[0], torch.tensor([0.5, 0.5])) and samples == 16


def train_pair(steps, compute_s=0.0, **options):
    peers = open_peers([options.pop("maker", make_sgd)] * 2, **options)
    try:
        run_threads([lambda r=r: train_loop(peers[r], r, steps=steps, compute_s=compute_s) for r in range(2)])
    finally:
        close_all(peers)
    return peers


def test_one_inner_step_with_outer_sgd_of_lr_1_and_no_momentum_is_gradient_mode():
    """The same batches, the same start: H = 1, outer lr 1, momentum 0 gives gradient mode's
    parameters with plain SGD, up to float32 rounding of (w - (w - lr g))."""
    grad_mode = train_pair(20, staleness=0)
    local = train_pair(20, staleness=0, sync_every=1, outer_lr=1.0, outer_momentum=0.0)
    assert grad_mode[0].version == local[0].version == 20
    for a, b in zip(grad_mode[0].model.parameters(), local[0].model.parameters()):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6), (a - b).abs().max()
    for a, b in zip(local[0].model.parameters(), local[1].model.parameters()):
        assert torch.equal(a, b)  # the replicas end on the same outer parameters


@pytest.mark.parametrize("every, staleness", [(8, 1), (32, 0)])
def test_local_steps_with_int8_reach_synchronous_loss_in_the_same_samples(every, staleness):
    """2 peers x 160 batches of 32 from the same start, Adam inner steps: H local steps with
    int8 pseudo-gradients end within 15 % of synchronous fp32's held-out loss, in 1/H of the
    rounds. At staleness 1 the ring overlaps the next inner steps (and the steps after the last
    contribution are not sent: at H = 32 that can be a fifth of this run, so H = 32 runs
    staleness 0, where every contribution is exactly 32 steps). Outer lr 0.8, momentum 0.6:
    in 5 to 20 rounds DiLoCo's 0.7 and 0.9 (tuned for H = 500 over thousands of rounds)
    overshoot (simulated in-process: 0.68 at H = 8 against synchronous 0.55; 0.8/0.6: 0.55)."""
    steps = 160
    sync = train_pair(steps, maker=make_adam, staleness=0)
    reference = eval_loss(sync[0].model)
    # (a batch takes 10 ms, longer than a ring here: contributions come every H steps, not more)
    peers = train_pair(steps, compute_s=0.01, maker=make_adam, staleness=staleness, compression="int8",
                       sync_every=every, outer_lr=0.8, outer_momentum=0.6)
    loss = eval_loss(peers[0].model)
    assert loss < 1.15 * reference, (every, loss, reference)
    assert peers[0].version <= steps // every + 1
    for a, b in zip(peers[0].model.parameters(), peers[1].model.parameters()):
        assert torch.equal(a, b)


def test_a_4x_slower_peer_does_not_hold_the_fast_one_which_takes_more_inner_steps_per_round():
    """Staleness 1, H = 4: rounds wait for the slow peer's 4 inner steps while the fast one steps
    on (never blocked in step), so the fast one contributes about 4x the samples per round;
    nothing is lost, replicas end identical and their checksums agreed after every round."""
    fast_s, slow_s = 0.01, 0.04
    peers = open_peers([make_adam] * 2, staleness=1, compression="int8", sync_every=4)
    try:
        logs, counts = train_at_speeds(peers, 3.0, (fast_s, slow_s))
    finally:
        close_all(peers)
    fast, slow = peers
    assert counts[0] > 2.5 * counts[1] > 0, counts
    assert max(seconds for seconds, _ in logs[0]) < 4 * slow_s  # step() never waits for the slow one's 4 steps
    own = [(m.local_samples, m.samples - m.local_samples) for m in fast.history if m.samples > m.local_samples > 0]
    assert own and sum(a for a, _ in own) > 2 * sum(b for _, b in own), own  # the fast one's samples weigh more
    assert fast.version == slow.version >= 3 and fast.dropped == slow.dropped == 0
    assert [p.cluster.reconciled for p in peers] == [0, 0]  # outer checksums agreed
    for a, b in zip(fast.model.parameters(), slow.model.parameters()):
        assert torch.equal(a, b)


def test_a_joiner_gets_the_outer_state_and_ends_identical():
    """A third peer, started later from other parameters, loads the outer parameters and
    momentum from the snapshot (not a member's local parameters), and all end bit-identical.
    The run ends with the cluster (``max_rounds``): peers that close one after another each
    send their unsent inner steps, so their own last versions could differ by a round."""
    peers = open_peers([make_adam, make_adam, make_other_start], start=2, staleness=1, sync_every=4, max_rounds=60)
    late = peers[2]
    try:
        end = time.monotonic() + 60.0  # (a bound: the loops end when the cluster's run does)
        run_threads([lambda: train_loop(peers[0], 0, until_t=end, compute_s=0.01),
                     lambda: train_loop(peers[1], 1, until_t=end, compute_s=0.01), joining_late(late, 2, 1.0, end)])
        assert all(p.finished for p in peers)
    finally:
        close_all(peers)
    assert late.cluster.loads and any(m.members == 3 for m in late.history)
    assert late.version == peers[0].version == peers[1].version == 60
    assert late._peer._state.local.velocity_state().abs().sum() > 0  # the momentum came with the state
    assert [p.cluster.reconciled for p in peers] == [0, 0, 0]
    for p in peers[1:]:
        for a, b in zip(peers[0].model.parameters(), p.model.parameters()):
            assert torch.equal(a, b)


def test_bad_local_steps_keywords_are_one_clear_error():
    model, opt = make_sgd()
    for kwargs, text in (({"sync_every": 0}, "sync_every must be an int >= 1"),
                         ({"sync_every": 4, "outer_lr": 0}, "outer_lr must be a number > 0"),
                         ({"sync_every": 4, "outer_momentum": 1.0}, r"outer_momentum must be a number in \[0, 1\)"),
                         ({"sync_every": 4, "staleness": 1, "target_batch_size": 64}, "target_batch_size bounds"),
                         ({"sync_every": 4, "staleness": 1, "weight_prediction": True}, "weight_prediction is for"),
                         # (an outer step's setting without sync_every was ignored: gradient mode, silently)
                         ({"outer_lr": 0.5}, "outer_lr and outer_momentum are for local-steps mode: give sync_every"),
                         ({"outer_momentum": 0.0}, "are for local-steps mode")):
        with pytest.raises(ConfigError, match=text):
            Peer(model, opt, discovery=False, **kwargs)


@pytest.mark.parametrize("staleness", [0, 1])
def test_a_peer_leaving_normally_contributes_its_unsent_inner_steps(staleness):
    """H = 8 and 27 or 29 inner steps: on a normal close the 3 and 5 steps made since the last
    contribution go in one more round (weighted by their samples), as gradient mode flushes its
    last batches; every sample either peer computed is in an update, and replicas end identical.
    (Before, they were dropped: 24 of 27 and of 29 steps applied.)"""
    steps = (27, 29)
    peers = open_peers([make_adam] * 2, staleness=staleness, compression="int8", sync_every=8)
    try:
        run_threads([lambda r=r: train_loop(peers[r], r, steps=steps[r], compute_s=0.005) for r in range(2)])
    finally:
        close_all(peers)
    for p, n in zip(peers, steps):
        assert sum(m.local_samples for m in p.history) == 32 * n, [m.local_samples for m in p.history]
        assert p.dropped == 0
    assert peers[0].version == peers[1].version
    for a, b in zip(peers[0].model.parameters(), peers[1].model.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("staleness", [0, 1])
def test_a_peer_alone_leaves_at_once_with_every_inner_step_applied(staleness):
    """One peer (min_peers 1), H = 4, 10 quick steps, then close. Leaving, it gave each round an
    empty contribution at once, counted that as samples still out, and waited out the 10 s flush
    through ~100,000 rounds of nothing; at staleness 1 its first contribution was still unsent
    when the last steps came, and those 6 steps' samples vanished (counted nowhere)."""
    from helpers import ports

    model, opt = make_adam()
    peer = Peer(model, opt, listen=f"127.0.0.1:{ports(1)[0]}", discovery=False, min_peers=1, secret="s",
                staleness=staleness, sync_every=4)
    peer.start()
    try:
        g = torch.Generator().manual_seed(3)
        for _ in range(10):
            x = torch.randn(8, 16, generator=g)
            torch.nn.functional.cross_entropy(model(x), x[:, :4].argmax(1)).backward()
            peer.step(batch_size=8)
    finally:
        began = time.monotonic()
        peer.close()
    assert time.monotonic() - began < 3.0
    assert sum(m.local_samples for m in peer.history) == 80 and peer.unapplied == 0 and peer.dropped == 0
    assert peer.cluster.rounds.total < 50


def test_inner_steps_a_state_load_voids_are_counted_as_dropped():
    """A joiner at staleness 2 takes inner steps from its own start while it loads the cluster's
    state; the load voids them, as it voids gradients in gradient mode, and counts them in
    ``dropped``: every sample it stepped is in an update, dropped or unapplied. (Before, the
    load's reset of the outer state forgot them: run by hand in join's fault tests, a joiner
    had 2,032 of 36,384 samples in none of the three.)"""
    peers = open_peers([make_adam, make_adam, make_other_start], start=2, staleness=2, sync_every=4, max_rounds=40)
    late, stepped = peers[2], []
    try:
        end = time.monotonic() + 60.0

        def join_late():
            time.sleep(1.0)
            late.start()
            stepped.append(train_loop(late, 2, until_t=end, compute_s=0.002))
        run_threads([lambda: train_loop(peers[0], 0, until_t=end, compute_s=0.01),
                     lambda: train_loop(peers[1], 1, until_t=end, compute_s=0.01), join_late])
    finally:
        close_all(peers)
    assert late.cluster.loads
    applied = sum(m.local_samples for m in late.history)
    assert applied + late.dropped + late.unapplied == 32 * stepped[0], (applied, late.dropped, late.unapplied)


class QueuedClock:
    """``cpu_times`` on a machine that runs ``queued`` seconds waited for a CPU per second run."""

    def __init__(self, queued: float):
        self.queued, self.times = queued, (0.0, 0.0)

    def __call__(self, pid="self"):
        self.times = (self.times[0] + 1.0, self.times[1] + self.queued)
        return self.times


@pytest.mark.parametrize("queued", [0.0, 1.0], ids=["cores-to-spare", "cores-short"])
def test_where_the_cores_are_short_a_peer_waits_for_its_outer_update_instead_of_stepping_on(queued, monkeypatch):
    """Staleness 1, H = 4, quick steps: with cores to spare a peer steps on while the ring runs
    (its next contribution holds more than 4 steps); where its threads wait for a CPU half the
    time, stepping on would only slow the ring, so it waits for each outer update as at
    staleness 0, and each contribution is its 4 steps, from the first (the leaving flush aside).
    Replicas end identical either way."""
    from p2ptrain.trainer import pacing, state as state_module

    monkeypatch.setattr(state_module, "cpu_times", QueuedClock(queued))
    stepped_on = []  # (each step() that went on while this peer's pseudo-gradient waited for a round or was in one)

    def must_wait(**state):
        wait = pacing.must_wait(**state)
        if (state["out"] or state["accumulated"]) and not wait:
            stepped_on.append(state["cores_short"])
        return wait

    monkeypatch.setattr(state_module, "must_wait", must_wait)
    peers = train_pair(60, maker=make_adam, staleness=1, sync_every=4)
    held = [m.local_samples // 32 for m in peers[0].history]
    left = (peers[0].dropped + peers[0].unapplied) // 32  # (a leaving flush the other had left before: counted)
    assert sum(held) + left == 60, (held, left)
    if queued:
        assert peers[0]._peer._state.pacing.cores_short()
        assert not stepped_on
        assert all(steps == 4 for steps in held[:-1]), held  # (not the last round: the leaving flush)
    else:
        assert not peers[0]._peer._state.pacing.cores_short()
        assert stepped_on, held
    for a, b in zip(peers[0].model.parameters(), peers[1].model.parameters()):
        assert torch.equal(a, b)


def test_an_inner_step_tells_the_cluster_nothing_until_its_pseudo_gradient_is_ready(monkeypatch):
    """Each cross-thread call wakes the cluster's loop thread (0.9 ms a step with four peers on 2
    cores): in local-steps mode step() makes one per pseudo-gradient, not one per inner step,
    and the rounds and the replicas are as before."""
    from p2ptrain.trainer import peer as peer_module

    told = []
    real = peer_module.AsyncPeer._notify

    def notify(self, tell=None):
        if tell is None:  # (a contribution: not the other calls, which pass what to tell)
            told.append(self.peer_id)
        return real(self, tell)

    monkeypatch.setattr(peer_module.AsyncPeer, "_notify", notify)
    peers = train_pair(40, compute_s=0.002, staleness=0, sync_every=4)
    assert peers[0].version == 10
    for p in peers:
        assert told.count(p._peer.peer_id) <= 10 + 2, told.count(p._peer.peer_id)  # (10 pseudo-gradients)
    for a, b in zip(peers[0].model.parameters(), peers[1].model.parameters()):
        assert torch.equal(a, b)


def test_rounds_by_time_each_peer_takes_the_inner_steps_that_fit_in_the_window(monkeypatch):
    """``sync_every="250ms"``, staleness 1, a peer 4x slower: a round every window (not every H
    steps of the slow one), each peer contributing the steps it had time for (the fast about 4x
    the slow one's samples), the fast one never blocked in step, replicas identical, with the
    fastest member's change counted whole (``P2PTRAIN_OUTER_WHOLE=1``: each round's spread of
    samples reaches both peers' outer step)."""
    fast_s, slow_s, seconds, window = 0.01, 0.04, 3.0, 0.25
    monkeypatch.setenv("P2PTRAIN_OUTER_WHOLE", "1")
    divided = {}  # (total, spread) of each round applied, at either peer: what its sum was divided by
    divisor = LocalSteps.divisor
    monkeypatch.setattr(LocalSteps, "divisor", lambda self, total, spread: divided.setdefault(
        (total, spread), divisor(self, total, spread)))
    peers = open_peers([make_adam] * 2, staleness=1, compression="int8", sync_every="250ms")
    try:
        logs, counts = train_at_speeds(peers, seconds, (fast_s, slow_s))
    finally:
        close_all(peers)
    fast, slow = peers
    both = [(m.local_samples, m.samples - m.local_samples) for m in fast.history if m.samples > m.local_samples > 0]
    assert len(both) >= 3, both  # rounds with both peers in them
    ratio = sum(a for a, _ in both) / sum(b for _, b in both)
    assert 2.0 < ratio < 8.0, both  # each the steps that fit in its window: about fast_s / slow_s
    # a round every window (plus the slow one's step in progress and the ring): not every H steps
    assert 3 <= fast.version <= seconds / window + 2, fast.version
    assert max(s for s, _ in logs[0]) < 4 * slow_s  # the fast one never waits for the slow one's steps
    assert fast.version == slow.version and fast.dropped == slow.dropped == 0
    for a, b in zip(fast.model.parameters(), slow.model.parameters()):
        assert torch.equal(a, b)
    # each round's spread of samples reached both peers' outer step (``LocalSteps.divisor``)
    spreads = {(m.samples, (max(m.local_samples, m.samples - m.local_samples),
                            m.local_samples ** 2 + (m.samples - m.local_samples) ** 2)) for m in fast.history
               if m.samples > m.local_samples > 0}
    assert spreads and spreads <= set(divided), (spreads, divided)
    # (the mean scaled: > 1x, but 1x where a round holds equal shares, as one on a loaded machine can)
    assert all(divided[s] == s[1][1] / s[1][0] <= s[0] for s in spreads)
    assert any(s[1][1] / s[1][0] < s[0] for s in spreads)


def test_by_time_a_rounds_mean_keeps_its_fastest_members_change_whole():
    """A member 10x slower by time: the fast one's 10 inner steps and the slow one's 1, each of
    the same change ``d``. The samples-weighted mean moves the outer parameters 9.18 d (the
    fast peer alone: 10 d); divided by ``squares / largest`` (``LocalSteps.divisor``) they move
    10 d, the fastest member's change whole. Members alike divide by the total, bit for bit."""
    d = torch.tensor([0.01, -0.02, 0.03])

    def outer_move(shares: list[int], whole: bool) -> torch.Tensor:
        p = torch.nn.Parameter(torch.zeros(3))
        local = LocalSteps([p], every=None, lr=1.0, momentum=0.0, window_s=1.0)
        local.whole = whole
        summed = sum(n * (n // 64) * d for n in shares)  # (each member: samples x its change, batch 64)
        total, spread = sum(shares), M.spread_of(shares)
        local.apply(summed / local.divisor(total, tuple(spread)))
        return -local.outer[0]

    assert torch.allclose(outer_move([640, 64], whole=True), 10 * d, atol=1e-7)
    assert torch.allclose(outer_move([640, 64], whole=False), (6400 + 64) / 704 * d, atol=1e-7)
    assert torch.allclose(outer_move([640, 320, 64], whole=True), 10 * d, atol=1e-7)
    local = LocalSteps([torch.nn.Parameter(torch.zeros(3))], every=None, lr=1.0, momentum=0.0, window_s=1.0)
    local.whole = True
    for shares in ([64, 64], [704, 704, 704], [1, 1, 1, 1, 1]):  # members alike: exactly the total
        assert local.divisor(sum(shares), tuple(M.spread_of(shares))) == float(sum(shares))
    assert local.divisor(704, None) == 704.0  # (not known: the plain mean)


def test_the_fastest_members_change_counts_whole_by_time_where_asked_and_never_for_a_count(monkeypatch):
    """The plain mean by default (``LocalSteps.divisor``'s measurements); by time
    ``P2PTRAIN_OUTER_WHOLE=1`` counts the fastest member's change whole; by count every member
    takes the same steps: the plain mean, as DiLoCo, whatever the switch says."""
    from p2ptrain.trainer.local_steps import local_steps

    p = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([p], lr=0.1)
    spread = (640, 640 ** 2 + 64 ** 2)
    for every in ("2s", "auto", 16):
        assert not local_steps([p], every, 0.8, 0.6, opt).whole
        assert local_steps([p], every, 0.8, 0.6, opt).divisor(704, spread) == 704.0
    monkeypatch.setenv("P2PTRAIN_OUTER_WHOLE", "1")
    assert local_steps([p], "2s", 0.8, 0.6, opt).whole and local_steps([p], "auto", 0.8, 0.6, opt).whole
    assert local_steps([p], "auto", 0.8, 0.6, opt).divisor(704, spread) == spread[1] / 640
    assert not local_steps([p], 16, 0.7, 0.9, opt).whole


@pytest.mark.parametrize("compiled", [True, False])
def test_look_ahead_moves_local_progress_onto_the_next_steps_momentum_and_never_the_outer_parameters(
        compiled, monkeypatch):
    """With ``lookahead`` the outer parameters and momentum are exactly those without it; the
    model and ``base`` are moved by ``-lr mu^2 v``, so the next pseudo-gradient is the inner
    progress alone."""
    def run(lookahead):
        p = torch.nn.Parameter(torch.tensor([1.0, 2.0, 3.0]))
        local = LocalSteps([p], every=1, lr=0.7, momentum=0.9)
        if not compiled:
            monkeypatch.setattr(local, "_kernels", None)
        local.lookahead = lookahead
        for step in (0.5, 0.25):
            with torch.no_grad():
                p.sub_(step)
            local.stepped(8)
            delta, _ = local.contribute()
            local.apply(torch.cat([d.reshape(-1) for d in delta]))
        return p.detach().clone(), local
    p0, plain = run(False)
    p1, ahead = run(True)
    assert torch.equal(plain._outer, ahead._outer) and torch.equal(plain._velocity, ahead._velocity)
    shift = -0.7 * 0.81 * ahead._velocity
    assert torch.allclose(p1, p0 + shift, atol=1e-6) and torch.allclose(ahead._base, plain._base + shift, atol=1e-6)
    with torch.no_grad():
        p1_param = ahead.params[0]
        p1_param.sub_(0.125)  # one more inner step
    ahead.stepped(8)
    delta, _ = ahead.contribute()
    assert torch.allclose(delta[0], torch.full((3,), 0.125), atol=1e-6)  # inner progress only


def test_look_ahead_is_on_for_rounds_by_time_and_off_for_a_count(monkeypatch):
    """Rounds by time correct the update that lands a round late (``LocalSteps._look_ahead``,
    measured in its docstring); a count keeps DiLoCo's outer step as published;
    ``P2PTRAIN_LOOKAHEAD`` overrides either way."""
    from p2ptrain.trainer.local_steps import local_steps

    p = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.SGD([p], lr=0.1)
    assert local_steps([p], "2s", 0.8, 0.6, opt).lookahead and local_steps([p], "auto", 0.8, 0.6, opt).lookahead
    assert not local_steps([p], 16, 0.7, 0.9, opt).lookahead
    monkeypatch.setenv("P2PTRAIN_LOOKAHEAD", "0")
    assert not local_steps([p], "auto", 0.8, 0.6, opt).lookahead
    monkeypatch.setenv("P2PTRAIN_LOOKAHEAD", "1")
    assert local_steps([p], 16, 0.7, 0.9, opt).lookahead
