"""Reconciliation: replicas whose optimizer arithmetic differs (as a CUDA and a CPU replica's
does) compare parameter sketches every few updates; a drift within ``drift.TOLERANCE`` is left
alone (no download), one beyond it loads the leader's parameters; replicas that agree say so."""

import pytest
import torch
import torch.nn.functional as F
from test_trainer_staleness import close_all, label, make_adam, open_peers, run_threads, train_loop

from p2ptrain import ConfigError, Peer
from p2ptrain.cluster.drift import TOLERANCE

pytestmark = pytest.mark.timeout(120)


def other_kind_adamw(params, lr):
    """AdamW whose arithmetic rounds differently, a stand-in for another device kind that CI can
    run on a CPU: torch's fused kernel (one pass, its own operation order) against the default
    foreach one. Measured here, as two replicas applying the same averaged gradients: a relative
    L2 difference of 1.6e-8 after 10 steps and 1.2e-7 after 1,000 (CUDA against CPU: 2.7e-8 and
    8.3e-8). The same state (``exp_avg``, ``exp_avg_sq``, ``step``) as the default."""
    try:
        return torch.optim.AdamW(params, lr=lr, fused=True)
    except (RuntimeError, TypeError) as exc:  # torch < 2.4 has no fused AdamW on a CPU
        pytest.skip(f"no fused AdamW on a CPU here: {exc}")


def make_adamw(kind=torch.optim.AdamW):
    torch.manual_seed(0)  # every peer starts from the same parameters
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
    return model, kind(model.parameters(), lr=1e-3)


def loop(peer, rank, steps, nudge_at=None, nudged=None, nudge=None):
    """Train until the cluster's update ``steps``; after update ``nudge_at`` a member (not the
    leader: its parameters are the reference) changes its first layer with ``nudge``, between
    steps."""
    g = torch.Generator().manual_seed(100 + rank)
    while peer.version < steps:  # (the cluster's updates, not our steps)
        x = torch.randn(32, 16, generator=g)
        F.cross_entropy(peer.model(x), label(x)).backward()
        peer.step(batch_size=32)
        if nudge_at is not None and peer.version >= nudge_at and not nudged and not peer.cluster.machine.is_leader:
            nudged.append((rank, peer.version))
            with torch.no_grad():
                nudge(next(peer.model.parameters()))


def relative_l2(a, b):
    """The exact relative L2 difference of two models' parameters, the largest of any tensor."""
    with torch.no_grad():
        return max(float((p - q).norm() / q.norm()) for p, q in zip(a.parameters(), b.parameters()))


def one_ulp_up(w):
    w.copy_(torch.nextafter(w, torch.full_like(w, float("inf"))))


def by_version(peer):
    return {m.version: m.param_checksum for m in peer.history if m.param_checksum}


def test_replicas_of_different_arithmetic_stay_within_tolerance_for_1000_rounds_without_a_load():
    """The headline case: two device kinds. 1,000 synchronous rounds, compared every 10: the
    replicas drift at rounding level, are seen to differ, and nothing is downloaded after the
    join (no state load, no parameter correction)."""
    peers = open_peers([make_adamw, lambda: make_adamw(other_kind_adamw)], staleness=0, reconcile_every=10)
    try:
        run_threads([lambda r=r: loop(peers[r], r, 1000) for r in range(2)])
    finally:
        close_all(peers)
    drift = relative_l2(peers[0].model, peers[1].model)
    member = max(peers, key=lambda p: p.peer_id)  # (the leader is the smallest id; it compares nothing)
    print(f"after 1000 rounds: relative L2 {drift:.2e}; member compared {member.cluster.reconciler.compared} "
          f"times, largest estimated drift {member.cluster.reconciler.drift_max:.2e}")
    assert 0 < drift < TOLERANCE / 10  # they differ (the arithmetic does), by rounding only
    assert [len(p.cluster.loads) for p in peers] == [0, 0]
    assert [p.cluster.reconciled for p in peers] == [0, 0] and [p.corrected for p in peers] == [0, 0]
    assert member.cluster.reconciler.compared >= 90  # (every 10 updates; a few at the end may miss)
    assert member.cluster.reconciler.identical < member.cluster.reconciler.compared  # seen to differ
    assert 0 < member.cluster.reconciler.drift_max < TOLERANCE / 10


@pytest.mark.parametrize("staleness", [0, 1])
def test_a_drift_beyond_the_tolerance_loads_the_leaders_parameters(staleness, caplog):
    """The tolerance check can fail: a member whose first layer moves by 1e-3 of itself is
    corrected with the leader's parameters (not its optimizer state), keeps its place in the
    rounds and every sample, and is bit-identical to the leader again."""
    peers = open_peers([make_adam] * 2, staleness=staleness, reconcile_every=1)
    nudged = []  # (rank, version) of the one nudge
    try:
        # (100 updates: at staleness 1 they take ~0.5 s here, and under a loaded CI machine the
        # drifter's download of the leader's parameters once took longer than 22 updates)
        with caplog.at_level("WARNING", logger="p2ptrain.cluster.cluster"):
            run_threads([lambda r=r: loop(peers[r], r, 100, nudge_at=8, nudged=nudged,
                                          nudge=lambda w: w.mul_(1 + 1e-3)) for r in range(2)])
    finally:
        close_all(peers)
    assert len(nudged) == 1
    drifter, at = nudged[0]
    assert peers[drifter].cluster.reconciled >= 1 and peers[1 - drifter].cluster.reconciled == 0
    assert peers[drifter].corrected >= 1
    assert peers[drifter].cluster.reconciler.drift_max > TOLERANCE
    assert peers[drifter].cluster.loads == []  # not a resync: it kept its place in the rounds ...
    assert peers[drifter].dropped == 0  # ... and every sample it computed
    for a, b in zip(peers[0].model.parameters(), peers[1].model.parameters()):
        assert torch.equal(a, b)  # bit-identical again
    mine, theirs = by_version(peers[0]), by_version(peers[1])
    before = [v for v in mine if v < at]
    assert before and all(mine[v] == theirs[v] != "" for v in before)  # equal up to the nudge
    assert any(mine[v] != theirs[v] for v in mine.keys() & theirs.keys())  # seen to differ
    assert mine[100] == theirs[100] != ""  # and equal again at the end
    assert not [r for r in caplog.records if "again" in r.getMessage()]  # corrected for good: no warning


def test_a_member_that_steps_otherwise_drifts_again_and_is_told_why(caplog):
    """Peers started together with another learning rate each (the README said --lr may differ):
    every reload is followed by a drift as large, for the whole run. The member says once, as a
    warning, what to make equal; a single nudge (above) is corrected for good and says nothing."""
    def slower():
        model, _ = make_adam()
        return model, torch.optim.Adam(model.parameters(), lr=1e-3)

    peers = open_peers([make_adam, slower], staleness=0, reconcile_every=2)
    try:
        with caplog.at_level("WARNING", logger="p2ptrain.cluster.cluster"):
            run_threads([lambda r=r: loop(peers[r], r, 40) for r in range(2)])
    finally:
        close_all(peers)
    member = next(p for p in peers if p.cluster.reconciled)
    assert member.cluster.reconciled >= 2
    said = [r.getMessage() for r in caplog.records if "drifted past the tolerance again" in r.getMessage()]
    assert len(said) == 1 and "same optimizer settings (--lr)" in said[0], said


def test_a_drift_within_the_tolerance_is_seen_and_left_alone():
    """One ulp on every weight of a layer: not identical any more, far within the tolerance,
    so nothing is downloaded."""
    peers = open_peers([make_adam] * 2, staleness=0, reconcile_every=2)
    nudged = []
    try:
        run_threads([lambda r=r: loop(peers[r], r, 40, nudge_at=8, nudged=nudged, nudge=one_ulp_up)
                     for r in range(2)])
    finally:
        close_all(peers)
    drifter = peers[nudged[0][0]]
    assert drifter.cluster.reconciled == 0 and drifter.corrected == 0 and drifter.cluster.loads == []
    assert drifter.cluster.reconciler.identical < drifter.cluster.reconciler.compared
    assert 0 < drifter.cluster.reconciler.drift_max < TOLERANCE


def test_replicas_that_agree_compare_and_say_they_are_identical():
    peers = open_peers([make_adam] * 2, staleness=0, reconcile_every=1)
    try:
        run_threads([lambda r=r: loop(peers[r], r, 20) for r in range(2)])
    finally:
        close_all(peers)
    assert [p.cluster.reconciled for p in peers] == [0, 0] and [len(p.cluster.loads) for p in peers] == [0, 0]
    assert by_version(peers[0]) == by_version(peers[1]) and len(by_version(peers[0])) >= 10
    member = max(peers, key=lambda p: p.peer_id)  # (the leader is the smallest id; it compares nothing)
    assert member.cluster.reconciler.compared >= 10
    assert member.cluster.reconciler.identical == member.cluster.reconciler.compared  # bit-identical, and said so
    for a, b in zip(peers[0].model.parameters(), peers[1].model.parameters()):
        assert torch.equal(a, b)


def test_reconcile_every_is_checked():
    with pytest.raises(ConfigError, match="reconcile_every"):
        Peer(*make_adam(), reconcile_every=-1, discovery=False)


def test_a_sketch_read_late_goes_out_in_order_and_compares_alike(monkeypatch):
    """On CUDA a sketch's numbers reach the host by a copy that ends after the update that
    started it (``drift.start_sketch``); the trainer reads it at the next update at the latest.
    Here (CPU) every read says it is not ready until then: comparisons still happen at the
    right points (bit-identical peers: identical every time), and every update's metrics are
    published once, in order, the compared ones with their sketch's checksum."""
    from p2ptrain.cluster import drift
    from p2ptrain.trainer import updates

    class Late:
        def __init__(self, read):
            self.read = read

        def ready(self):
            return False  # (a device copy still in flight)

        def result(self):
            return self.read.result()

    started = []
    monkeypatch.setattr(updates, "start_sketch", lambda ts: started.append(Late(drift.start_sketch(ts))) or started[-1])
    peers = open_peers([make_adam] * 2, staleness=0, reconcile_every=2)
    try:
        run_threads([lambda r=r: train_loop(peers[r], r, steps=12) for r in range(2)])
    finally:
        close_all(peers)
    assert started
    for p in peers:
        versions = [m.version for m in p.history]
        assert versions == sorted(set(versions)) and versions[-1] == p.version, versions
        assert all(m.param_checksum for m in p.history if m.version % 2 == 0 and m.members == 2)
    compared = [p.cluster.reconciler for p in peers]
    assert sum(r.compared for r in compared) >= 3 and all(r.identical == r.compared for r in compared)
