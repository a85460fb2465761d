"""Weight prediction (staleness >= 1): batches are computed on the parameters moved on by the
last update, while every update, checksum, snapshot and checkpoint uses the true ones, so
the replicas stay bit-identical and a joiner downloads the true state."""

import time

import pytest
import torch
import torch.nn.functional as F
from test_trainer_staleness import close_all, joining_late, label, make_adam, open_peers, run_threads

from p2ptrain import ConfigError, Peer
from p2ptrain.trainer.pacing import Pacing
from p2ptrain.trainer.prediction import WeightPredictor
from p2ptrain.cluster.drift import param_sketch, sketch_checksum
from p2ptrain.cluster.snapshot import tensors_checksum

pytestmark = pytest.mark.timeout(90)


def test_the_predictor_moves_the_parameters_one_update_on_and_puts_the_true_ones_back_exactly():
    model = torch.nn.Linear(3, 2)
    params = list(model.parameters())
    predictor = WeightPredictor(params)
    predictor.predict()
    assert not predictor.predicted  # no update yet: nothing to repeat
    w0 = [p.detach().clone() for p in params]
    predictor.before_update()
    with torch.no_grad():
        for p in params:
            p.add_(0.25)  # an update
    w1 = [p.detach().clone() for p in params]
    predictor.predict()
    assert predictor.predicted
    for p, a, b in zip(params, w0, w1):
        torch.testing.assert_close(p, b + (b - a))  # w1 + delta
    state = predictor.true_state_dict(model)
    assert torch.equal(state["weight"], w1[0]) and torch.equal(state["bias"], w1[1])
    predictor.before_update()  # the next update starts from the true parameters, bit for bit
    assert all(torch.equal(p, b) for p, b in zip(params, w1))
    predictor.predict()
    predictor.forget()  # a state was loaded over the predicted parameters: they are true now
    assert not predictor.predicted and predictor.true_state_dict(model)["weight"] is not w1[0]


def test_several_updates_in_a_row_after_a_prediction_predict_from_the_last_of_them():
    """``before_update`` after a prediction takes the true copies as the parameters before the
    update (no copy); a second update in a row copies them: either way the prediction is the
    last update repeated, and the true parameters come back bit for bit."""
    params = [torch.randn(5, 4), torch.randn(7)]
    predictor = WeightPredictor(params)

    def update(scale):
        for p in params:
            p.mul_(0.9).add_(scale)

    predictor.before_update()
    update(0.1)
    w1 = [p.clone() for p in params]
    predictor.predict()
    for rounds in range(3):
        predictor.before_update()  # (after a prediction: the swap)
        assert all(torch.equal(p, w) for p, w in zip(params, w1))  # the true parameters
        update(0.2)
        for _ in range(rounds):  # updates in a row, no batch between them (the copy)
            predictor.before_update()
            update(0.3)
        before = [p.clone() for p in params]
        predictor.before_update()
        update(0.4)
        w1 = [p.clone() for p in params]
        predictor.predict()
        for p, a, b in zip(params, before, w1):
            assert torch.equal(p, b - (a - b))  # the last update repeated, bit for bit
    predictor.restore()
    assert all(torch.equal(p, w) for p, w in zip(params, w1))


def test_a_paused_predictor_leaves_the_true_parameters_and_predicts_again_only_after_a_tracked_update():
    params = [torch.randn(6)]
    predictor = WeightPredictor(params)
    predictor.before_update()
    params[0].add_(1.0)
    w1 = params[0].clone()
    predictor.predict()
    assert predictor.predicted
    predictor.pause()  # (lockstep now: the next batches are not late)
    assert not predictor.predicted and torch.equal(params[0], w1)
    params[0].add_(2.0)  # an update while paused: not one to repeat
    predictor.predict()
    assert not predictor.predicted  # (nothing tracked since the pause)
    predictor.before_update()
    params[0].add_(0.5)
    w2 = params[0].clone()
    predictor.predict()
    assert torch.equal(params[0], w2 + 0.5)


def test_peers_compute_on_predicted_parameters_and_stay_identical_and_a_joiner_gets_the_true_ones(monkeypatch):
    # (overlapping from the first timed round on: the rule, which here would keep to lockstep
    # and predict nothing, is ``test_trainer_pacing``'s)
    monkeypatch.setattr(Pacing, "lockstep", lambda self, members: self.overlap_gain() is None and members > 1)
    peers = open_peers([make_adam] * 3, start=2, staleness=1, compression="int8", weight_prediction=True,
                       reconcile_every=1)
    late = peers[2]
    apart = []  # steps at which the model held other parameters than its state_dict
    by_version: dict[int, set] = {}  # peer.param_checksum() after each step, by the updates applied

    def watch(peer, rank, until_t):
        g = torch.Generator().manual_seed(100 + rank)
        while time.monotonic() < until_t:
            x = torch.randn(32, 16, generator=g)
            F.cross_entropy(peer.model(x), label(x)).backward()
            time.sleep(0.01)
            peer.step(batch_size=32)
            true = peer.state_dict()["model"]
            if any(not torch.equal(p, true[n]) for n, p in peer.model.named_parameters()):
                apart.append(rank)
            # the replicas' checksum is of the true parameters (join's metrics; the model's own differs)
            checksum = peer.param_checksum()
            assert checksum == tensors_checksum((n, true[n]) for n, _ in peer.model.named_parameters())
            by_version.setdefault(peer.version, set()).add(checksum)

    try:
        end = time.monotonic() + 4.0
        run_threads([lambda: watch(peers[0], 0, end), lambda: watch(peers[1], 1, end), joining_late(late, 2, 1.5, end)])
        late.close()
    finally:
        close_all(peers)
    assert set(apart) == {0, 1}  # both computed on predicted parameters
    assert len(by_version) > 5 and all(len(sums) == 1 for sums in by_version.values())
    assert late.history[-1].members == 3 and late.version == peers[0].version == peers[1].version
    assert [p.cluster.reconciled for p in peers] == [0, 0, 0]  # the sketches agreed: true parameters
    assert all(p.cluster.reconciler.identical == p.cluster.reconciler.compared for p in peers)
    for p in peers[1:]:  # closed: the models are bit-identical ...
        for a, b in zip(peers[0].model.parameters(), p.model.parameters()):
            assert torch.equal(a, b)
    assert all(sketch_checksum(param_sketch(p.model.parameters())) == p.metrics.param_checksum != ""
               for p in peers)  # ... on the true parameters


def test_weight_prediction_needs_staleness():
    with pytest.raises(ConfigError, match="weight_prediction needs staleness >= 1"):
        Peer(*make_adam(), weight_prediction=True, discovery=False)
