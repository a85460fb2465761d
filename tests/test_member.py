"""The member role of the round machine (``p2ptrain.cluster.member``): what a member takes up,
refuses, or rejects as a protocol error, and what it does with a contribution, on the fake bus
of ``roundnet``."""

import pytest
from roundnet import Net, cluster

from p2ptrain.cluster import roundmsg as M
from p2ptrain.cluster.roundmsg import PutBack
from p2ptrain.errors import RemoteProtocolError


# -- validation ---------------------------------------------------------------------------------
def test_old_round_is_ignored_and_counted():
    net = cluster("ab", run=0.5)
    old = dict(net.sent("a", M.PROPOSE)[0])
    before = len(net.actions["b"])
    assert net.m["b"].on_message("a", {**old, "b": list(net.m["b"].promised)}, net.now) == []
    assert net.m["b"].counters["old_round"] == 1 and len(net.actions["b"]) == before


def test_view_naming_unknown_peer_or_not_us_is_refused_with_nack():
    net = Net("ab", auto=False)
    net.found()
    b = net.m["b"]
    out = b.on_message("a", {"t": M.PROPOSE, "r": 5, "b": [3, "a"], "view": ["a", "b", "zz"]}, net.now)
    assert [x.msg["t"] for x in out] == [M.NACK] and "not connected" in out[0].msg["reason"]
    assert out[0].msg["missing"] == ["zz"]
    out = b.on_message("a", {"t": M.PROPOSE, "r": 5, "b": [3, "a"], "view": ["a", "c"]}, net.now)
    assert [x.msg["t"] for x in out] == [M.NACK] and b.pending is None


def test_start_before_propose_is_a_protocol_error():
    net = Net("ab", auto=False)
    net.found()
    net.tick()
    net.settle()  # b has promised a's ballot
    with pytest.raises(RemoteProtocolError):
        net.m["b"].on_message("a", {"t": M.START, "r": 9, "b": [1, "a"], "view": ["a", "b"], "total": 3}, net.now)


def test_commit_of_an_unfinished_ring_is_a_protocol_error():
    net = Net("ab", auto=False)
    net.found()
    net.tick()
    net.settle()
    net.contribute("a")
    net.contribute("b")
    net.settle()
    with pytest.raises(RemoteProtocolError):
        net.m["b"].on_message("a", {"t": M.COMMIT, "r": 0, "b": [1, "a"]}, net.now)


def test_propose_from_a_peer_that_does_not_own_the_ballot():
    net = Net("ab", auto=False)
    net.found()
    with pytest.raises(RemoteProtocolError):
        net.m["b"].on_message("a", {"t": M.PROPOSE, "r": 0, "b": [1, "c"], "view": ["a", "b"]}, net.now)


# -- contributions and views --------------------------------------------------------------------
def test_late_contribution_is_put_back():
    net = cluster("abc", run=0.3)
    net.hold_a_round("ab")
    r = net.m["a"].lead.r
    net.run(41.0)  # aborted while c was computing (for 8 deadlines: c is live)
    assert [m["r"] for m in net.sent("a", M.ABORT)] == [r]
    net.contribute("c")  # (its batch for round r)
    assert net.of("c", PutBack)[-1].r == r


def test_a_member_counts_the_peers_its_leader_proposes_even_before_it_hears_they_are_synced():
    """A trainer that waits for --min-peers members before its first step must not wait for
    ever because its own table still holds unsynced a peer that an earlier abort dropped (it
    hears that peer's STATUS only when a round commits; seen with 4 peers on 2 cores: the
    leader proposed round after round and timed out on the member that would not step)."""
    net = Net("abcd", auto=False, min_peers=4)
    net.found()
    net.m["b"].table.unsynced("d")  # an abort's drop list, before d showed the leader its STATUS again
    assert net.m["b"].members() == 3 and net.m["b"].pending is None
    for _ in range(3):  # the leader, which knows d is synced, proposes a round to all four
        net.tick()
    assert len(net.m["b"].pending.view) == 4 and len(net.m["b"].table.live_synced()) == 3
    assert net.m["b"].members() == 4


def test_a_long_ring_does_not_put_off_a_members_first_wait_for_the_decision():
    """Told START, a member whose ring runs past the ring deadline says nothing (its ring has its
    own timeout), and once the ring ends it says it waits for the decision at the first deadline
    after START, not at a later mark."""
    from p2ptrain.cluster.roundmsg import Stall

    net = cluster("abc", run=0.5)
    net.auto = False
    net.tick()
    r = net.m["a"].lead.r
    for p in "abc":
        net.contribute(p)
    net.settle()
    net.hold("c", "a")  # (c's DONE will wait: the decision does not come)
    pending = net.m["c"].pending
    assert pending.told and pending.phase == M.RING
    deadline = net.m["c"]._deadline(M.RINGED, pending.view)
    net.now += 1.1 * deadline  # the ring runs on past a deadline
    net.handle("c", net.m["c"].on_tick(net.now))
    assert not [s for s in net.of("c", Stall) if s.r == r] and pending.mark == 1.0
    net.finish_ring("c")
    net.now += 0.4 * deadline  # 1.5 deadlines after START
    net.handle("c", net.m["c"].on_tick(net.now))
    assert [s.phase for s in net.of("c", Stall) if s.r == r] == ["decision"]


def test_the_exchange_a_member_times_leaves_out_the_wait_for_a_later_member():
    """Rounds by time (``--sync-every auto``) size their window from the exchange: a member that
    contributed early and waited 3 s for the last one did not see a 3 s exchange (a window grown
    on that wait makes the others wait longer in turn: the churn soak's windows reached 30 s)."""
    net = Net("abc", auto=False)
    net.found()
    net.tick()
    net.settle()
    net.ring_time = 0.2
    net.contribute("a")
    net.contribute("b")
    net.settle()
    net.run(3.0)  # c's window ends later
    net.contribute("c")
    net.settle()
    net.now += 0.2
    for p in "abc":
        net.finish_ring(p)
    net.settle()
    assert net.m["a"].history.version == 1
    for p in "abc":
        assert net.m[p].exchange_seconds() == pytest.approx(0.2, abs=0.05)
