"""``max_rounds`` after a resume whose peers bring different checkpoints: the cluster's state is
the newest checkpoint's, and the run ends ``max_rounds`` updates after it on every peer, whichever
peer coordinates (each counted from its own checkpoint, the coordinator's limit won: one peer
trained 43 updates, the other 1)."""

import copy
import logging

import pytest
from test_trainer_end import until_finished
from test_trainer_staleness import close_all, make_adam, open_peers, run_threads

from p2ptrain import Peer

pytestmark = pytest.mark.timeout(120)


def trained_alone(updates: int) -> dict:
    """The state of a peer that trained ``updates`` updates alone (a checkpoint's)."""
    peer = Peer(*make_adam(), listen="127.0.0.1:0", discovery=False, min_peers=1, max_rounds=updates)
    try:
        peer.start()
        until_finished(peer, 0)
        return copy.deepcopy(peer.state_dict())
    finally:
        peer.close()


@pytest.mark.parametrize("coordinator", ["behind", "ahead"])
def test_resumed_peers_with_different_checkpoints_end_after_the_same_updates(coordinator, caplog):
    caplog.set_level(logging.INFO, logger="p2ptrain.cluster")
    behind, ahead = trained_alone(3), trained_alone(12)
    peers = open_peers([make_adam] * 2, start=0, max_rounds=6)
    for peer, state, ident in zip(peers, (behind, ahead), ("1" * 16, "2" * 16)[:: 1 if coordinator == "behind" else -1]):
        peer.load_state_dict(state)
        peer._peer.peer_id = ident  # (the smallest id coordinates)
    try:
        for p in peers:
            p.start()
        run_threads([lambda r=r: until_finished(peers[r], r, delay=0.005) for r in range(2)])
    finally:
        close_all(peers)
    ends = [p.cluster.finished for p in peers]
    assert [e.version for e in ends] == [18, 18], ends  # 6 more than the newest checkpoint's 12, on both
    assert [p.version for p in peers] == [18, 18]
    # said in one line, by the peer behind, as it loads the newer state
    said = [r.getMessage() for r in caplog.records if "past this peer's end" in r.getMessage()]
    assert said == ["the cluster's state is at version 12, past this peer's end (version 9): the run ends at "
                    "version 18 (--max-rounds 6 after it)"], said
