"""``p2ptrain.integrations.lightning``: a real ``lightning.Trainer`` with ``P2PStrategy`` on two
peers over loopback, against the same module under Lightning's DDP strategy on gloo."""

import pytest
import torch

pytest.importorskip("lightning", reason="needs lightning (pip install \"p2ptrain[lightning]\")")

from helpers import run_ranks  # noqa: E402

from p2ptrain.errors import ConfigError  # noqa: E402


@pytest.mark.timeout(150)
def test_strategy_on_two_peers_is_ddp_and_resumes(tmp_path):
    (r0, r1) = run_ranks("lightning", "p2p,ddp", tmp_path, 5)
    p2p, ddp = r0["p2p"]["state"], r0["ddp"]["state"]
    assert r0["p2p"]["updates"] == r1["p2p"]["updates"] == 6  # one update per Lightning step
    for k, v in p2p.items():
        assert torch.equal(v, r1["p2p"]["state"][k]), k  # replicas bit-identical, BatchNorm's buffers too
        if "running" not in k:
            # Clipping after averaging, the data split by DistributedSampler, AdamW and the scheduler:
            # DDP's result, bit for bit (DDP's ranks keep their own BatchNorm statistics).
            assert torch.equal(v, ddp[k]), k
    assert not torch.equal(ddp["net.1.running_mean"], r1["ddp"]["state"]["net.1.running_mean"])
    # Both peers resumed from rank 0's checkpoint at step 3 (the first epoch's end): the same end, bit for bit.
    for k, v in p2p.items():
        assert torch.equal(v, r0["p2p"]["resumed"][k]) and torch.equal(v, r1["p2p"]["resumed"][k]), k


def test_refusals_say_what_to_do():
    from p2ptrain.integrations.lightning import P2PStrategy

    with pytest.raises(ConfigError, match="data_rank must be an int in 0..2"):
        P2PStrategy(data_rank=3, data_shares=3)
    with pytest.raises(ConfigError, match="clip_grad_norm.*gradient_clip_val"):
        P2PStrategy(peer=dict(clip_grad_norm=1.0))
