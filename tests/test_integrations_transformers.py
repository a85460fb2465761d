"""``p2ptrain.integrations.transformers``: a real ``transformers.Trainer`` script on two peers
over loopback, against the same script under torch DDP on gloo (the same batches per rank)."""

import pytest
import torch

pytest.importorskip("transformers", reason="needs transformers (pip install \"p2ptrain[transformers]\")")
pytest.importorskip("accelerate", reason="needs accelerate (pip install \"p2ptrain[transformers]\")")

from helpers import run_ranks  # noqa: E402

from p2ptrain.errors import ConfigError  # noqa: E402

def flat(state: dict) -> torch.Tensor:
    return torch.cat([v.double().flatten() for v in state.values() if v.is_floating_point()])


def assert_like_ddp(p2p: dict, ddp: dict, tol: float = 1e-5) -> None:
    """Within float tolerance of DDP (the two average in a different order: DDP divides each
    gradient by the world size before summing, p2ptrain sums samples' gradients, then divides)."""
    a, b = flat(p2p), flat(ddp)
    assert (a - b).norm() / b.norm() < tol, float((a - b).norm() / b.norm())


@pytest.mark.timeout(150)
def test_trainer_on_two_peers_is_ddp_and_resumes(tmp_path):
    (r0, r1) = run_ranks("hf", "p2p,ddp", tmp_path, 5)
    for k, v in r0["p2p"]["state"].items():
        assert torch.equal(v, r1["p2p"]["state"][k]), k  # replicas bit-identical
    assert r0["p2p"]["updates"] == r1["p2p"]["updates"] == 6  # one update per Trainer step
    import integration_runs

    initial = flat(integration_runs.hf_model().state_dict())
    assert not torch.equal(flat(r0["p2p"]["state"]), initial)
    assert_like_ddp(r0["p2p"]["state"], r0["ddp"]["state"])
    # Resumed from the checkpoint at step 3 (another model's weights at first): the same end, bit for bit.
    for k, v in r0["p2p"]["state"].items():
        assert torch.equal(v, r0["p2p"]["resumed"][k]), k
        assert torch.equal(v, r1["p2p"]["resumed"][k]), k
    # Each peer checkpointed to its own folder; the optimizer's file is the peer's state.
    saved = torch.load(tmp_path / "p2p" / "peer-1" / "checkpoint-3" / "optimizer.pt", weights_only=True)
    assert saved["version"] == 3 and set(saved["model"]) == set(r0["p2p"]["state"])


def test_data_shares_are_ddps_batches():
    from p2ptrain.integrations.transformers import PeerShardSampler

    seq = range(20)
    shares = [list(PeerShardSampler(seq, 3, rank, 2, shuffle=False)) for rank in range(2)]
    assert shares[0] == [0, 1, 2, 6, 7, 8, 12, 13, 14, 18, 19, 0]  # batch i to rank i % 2, the last round filled
    assert shares[1] == [3, 4, 5, 9, 10, 11, 15, 16, 17, 1, 2, 3]
    shuffled = [PeerShardSampler(seq, 2, rank, 2, shuffle=True, seed=5) for rank in range(2)]
    for s in shuffled:
        s.set_epoch(1)
    a, b = (list(s) for s in shuffled)
    assert len(a) == len(b) == 10 and sorted(a + b) == list(seq)  # disjoint, all of it
    shuffled[0].set_epoch(2)
    assert list(shuffled[0]) != a  # a new order each epoch


def test_refusals_say_what_to_do(tmp_path):
    import integration_runs as runs

    from p2ptrain.integrations.transformers import P2PTrainer

    with pytest.raises(ConfigError, match="fp16 is refused.*bf16"):
        P2PTrainer(model=runs.hf_model(), args=runs.hf_args(str(tmp_path), fp16=True), train_dataset=runs.hf_dataset())
    with pytest.raises(ConfigError, match="data_rank must be an int in 0..1"):
        P2PTrainer(model=runs.hf_model(), args=runs.hf_args(str(tmp_path)), data_rank=2, data_shares=2)
    with pytest.raises(ConfigError, match="clip_grad_norm.*args.max_grad_norm"):
        P2PTrainer(model=runs.hf_model(), args=runs.hf_args(str(tmp_path)), peer=dict(clip_grad_norm=1.0))
