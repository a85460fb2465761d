"""The leader role of the round machine (``p2ptrain.cluster.leader``): refusals under partial
connectivity and who is left out, taking the lead when a leader goes, rivals and ballots,
min_peers, and answering a READY sent again, on the fake bus of ``roundnet``."""

import math

import pytest
from roundnet import GENESIS, Net, cluster

from p2ptrain.cluster import roundmsg as M
from p2ptrain.cluster.leader import BETWEEN, COLLECTING, QUERYING, RUNNING, _Lead
from p2ptrain.cluster.rounds import RoundConfig, RoundMachine
from p2ptrain.cluster.roundmsg import Log, Waiting
from p2ptrain.cluster.refusals import LEAVE_OUT, REFUSAL_BACKOFF


# -- partial connectivity: a member has no link to a peer the leader sees -----------------------
def proposals(net, leader="a"):
    return [tuple(m["view"]) for m in net.sent(leader, M.PROPOSE)]


def test_refused_for_a_peer_it_cannot_reach_next_view_leaves_that_peer_out_and_commits():
    net = cluster("abcd", run=0.5)
    n = len(proposals(net))
    net.cut("b", "d")  # a, c see both; b and d never get a link to each other
    net.run(1.0)
    nacks = net.sent("b", M.NACK)  # the first time a link may be re-forming: b is dropped a moment
    assert len(nacks) == 2 and all(x["missing"] == ["d"] for x in nacks)
    views = proposals(net)[n:]
    refused = [i for i, v in enumerate(views) if v == ("a", "b", "c", "d")][1]
    k = len(net.applied("a"))
    assert views[refused + 1] == ("a", "b", "c")  # the second time: at once, without d
    net.run(0.3)
    assert [x[1] for x in net.applied("a")[k:] if x[1] == ("a", "b", "c")]
    logs = [x.text for x in net.of("a", Log) if x.level == "info" and "leaving" in x.text]
    assert logs == ["leaving d out of the rounds for 2 s: b is not connected to d"]
    net.check_safety()
    net.check_same_outcomes()


def test_left_out_peer_is_back_in_the_view_once_its_time_out_is_over():
    net = cluster("abcd", run=0.5)
    net.cut("b", "d")
    net.run(1.0)  # (refused twice: d is left out)
    net.reconnect("b", "d")
    net.run(0.5)
    assert {v for v in proposals(net)[-5:]} == {("a", "b", "c")}  # still left out
    net.run(2.5)
    assert proposals(net)[-1] == ("a", "b", "c", "d")
    assert net.applied("d")[-1][1] == ("a", "b", "c", "d")
    assert "d" not in net.m["a"].leader.refusals._left_out  # it took part again: a later refusal starts from 2 s
    net.check_safety()
    net.check_nothing_lost()


def test_refusals_do_not_loop_the_rest_keep_training():
    """The leader kept proposing a view a member refused, every 0.3 s for 14 minutes: now each
    refusal after the first leaves the peer out twice as long (2, 4, 8, 16 s), and rounds go on
    without it."""
    net = cluster("abcd", run=0.5)
    k = len(net.applied("a"))
    net.cut("b", "d")
    net.run(20.0)
    outs = [x.text.split(": ")[0] for x in net.of("a", Log) if "leaving" in x.text]
    assert outs == [f"leaving d out of the rounds for {s} s" for s in (2, 4, 8, 16)]
    loads = len(net.resyncs["d"])
    net.run(10.0)
    assert len(net.resyncs["d"]) == loads  # left out, d does not load state again and again meanwhile
    assert len(net.sent("b", M.NACK)) == 5 and len(net.sent("a", M.ABORT)) == 5
    assert len(net.applied("a")) - k > 250  # (a round per 0.1 s tick)
    net.reconnect("b", "d")
    net.run(32.0)  # (the last time out: 30 s at most)
    assert net.applied("d")[-1][1] == ("a", "b", "c", "d")
    net.check_safety()
    net.check_nothing_lost()


@pytest.mark.parametrize("first", ["b", "c"])
def test_a_replugged_peer_that_reaches_one_of_two_members_is_left_out_not_the_member(first):
    """Three peers, c replugged: its link to a is back, its link to b not yet. a's views name
    both; b refuses naming c, c refuses naming b, whichever first: as many missing as reached,
    so c, not in the last round, is left out, and b, which has trained all along, does not
    fall behind and load state."""
    net = cluster("abc", run=0.5)
    net.cut("a", "c").cut("b", "c")
    net.run(3.0)  # c goes on alone
    loads = len(net.resyncs["b"])
    net.reconnect("a", "c")
    if first == "c":  # c's refusal decides: on the bus b's comes first, so a is handed c's directly
        a = net.m["a"]
        a.leader.refusals._missing_at["b"] = net.now  # (named missing a moment ago: this refusal is the second)
        a.lead.phase, a.lead.view, a.lead.waiting = COLLECTING, ("a", "b", "c"), {"a", "b", "c"}
        nack = {"t": M.NACK, "r": a.lead.r, "b": list(a.lead.b), "reason": "no link", "missing": ["b"]}
        net.handle("a", a.on_message("c", nack, net.now))
    net.run(2.0)
    assert "b" not in net.m["a"].leader.refusals._left_out and net.m["a"].leader.refusals.is_left_out("c", net.now)
    assert net.applied("b")[-1][1] == ("a", "b") and len(net.resyncs["b"]) == loads
    net.reconnect("b", "c")
    net.run(LEAVE_OUT + 2.0)
    assert net.applied("b")[-1][1] == ("a", "b", "c") and len(net.resyncs["b"]) == loads
    net.check_safety()


def test_member_that_reaches_fewer_peers_than_it_misses_is_the_one_left_out():
    net = cluster("abcd", run=0.5)
    net.cut("b", "c")
    net.cut("b", "d")
    net.run(0.5)
    assert net.applied("a")[-1][1] == ("a", "c", "d")
    assert [x.text for x in net.of("a", Log) if "leaving" in x.text] == \
        ["leaving b out of the rounds for 2 s: b is not connected to c, d"]


def test_refusal_without_missing_from_an_older_peer_drops_it_and_backs_off():
    net = cluster("abc", run=0.3)
    net.hold_a_round("")  # a proposed and waits for READY
    L = net.m["a"].lead
    net.handle("a", net.m["a"].on_message("b", {"t": M.NACK, "r": L.r, "b": list(L.b), "reason": "x"}, net.now))
    assert net.sent("a", M.ABORT)[-1]["drop"] == ["b"] and net.m["a"].leader.refusals._left_out == {}
    assert net.m["a"].leader.refusals._refused_until == net.now + REFUSAL_BACKOFF


# -- taking the lead: a leader goes, rivals for a moment ----------------------------------------
def test_leader_goodbye_next_takes_over_at_the_next_tick():
    net = cluster("abc", run=0.3)
    n = len(net.applied("b"))
    net.handle("a", net.m["a"].leave(net.now))
    net.crashed.add("a")
    net.settle()
    net.tick()
    assert net.m["b"].is_leader
    net.run(0.5)
    assert net.applied("b")[n:] and net.applied("b")[-1][1] == ("b", "c")


def test_coordinator_dies_next_smallest_takes_over_numbering_continues():
    net = cluster("abc", run=0.3)
    before = {p: dict(net.outcome[p]) for p in "bc"}
    last = max(net.m["b"].round, net.m["c"].round)
    net.crash("a")
    net.run(15.0)
    assert net.m["b"].is_leader
    assert net.m["b"].promised[0] > 1  # a fresh epoch
    new = [x for x in net.applied("b") if x[0] > last]
    assert new and all(v == ("b", "c") for _, v, _ in new)
    for p in "bc":  # no round number reused with another outcome
        for r, o in before[p].items():
            assert net.outcome[p][r] == o
    assert len({x[0] for x in net.applied("b")}) == len(net.applied("b"))
    net.check_safety()
    net.check_same_outcomes()


@pytest.mark.parametrize("got_commit", ["", "b", "bc"])
def test_coordinator_dies_while_members_are_in_doubt(got_commit):
    """a commits round r and dies having told only some members: the survivors agree."""
    net = Net("abc", auto=False)
    net.found()
    net.commit_unheard("a", [p for p in "bc" if p not in got_commit])
    assert net.m["a"].round == 0 and net.m["a"].version == 1
    net.crash("a")
    net.auto = True
    for p in "bc":
        net.handle(p, net.m[p].on_peer_lost("a", net.now))
    net.run(3.0)
    assert net.m["b"].is_leader
    expect = ("commit", ("a", "b", "c"), 33) if got_commit else "abort"  # a survivor knew: commit
    assert net.outcome["b"][0] == net.outcome["c"][0] == expect
    assert net.m["b"].history.digest == net.m["c"].history.digest
    assert [x for x in net.applied("c") if x[0] > 0 and x[1] == ("b", "c")]  # and training goes on
    net.check_safety()


def test_two_coordinators_for_a_moment_smaller_id_wins():
    """b does not know a yet and leads; both propose round r: exactly one round r commits."""
    net = Net("abc")
    net.found()
    net.cut("a", "b")  # b (and a) believe the other is gone; c sees both
    net.tick()
    assert net.m["a"].is_leader
    net.reconnect("a", "b")
    net.run(3.0)
    assert net.m["a"].is_leader and not net.m["b"].is_leader and not net.m["c"].is_leader
    net.check_safety()
    net.check_same_outcomes()
    for p in "abc":
        assert len({x[0] for x in net.applied(p)}) == len(net.applied(p))


def test_two_coordinators_both_propose_round_r_exactly_one_commits():
    """a and b each believe they are the smallest synced peer; both take over at epoch 1 and
    both propose round 0 to c. c follows the better ballot (1, a): a's round 0 is the only one."""
    net = Net("abc", auto=False)
    net.found()
    net.m["a"].table.unsynced("b")
    net.m["b"].table.unsynced("a")
    net.hold("a", "b").hold("b", "a").hold("a", "c")
    net.tick()
    assert net.m["a"].is_leader and net.m["b"].is_leader
    net.settle()  # c answers b's QUERY first; b proposes round 0 with view [b, c]
    assert [(m["r"], m["view"]) for m in net.sent("b", M.PROPOSE)] == [(0, ["b", "c"])]
    net.release("a", "c").settle()  # a's ballot beats b's: c follows a; a proposes round 0 too
    assert [(m["r"], m["view"]) for m in net.sent("a", M.PROPOSE)] == [(0, ["a", "c"])]
    assert net.m["c"].promised == (1, "a")
    net.release("a", "b").release("b", "a")
    net.auto = True
    net.run(6.0)
    assert not net.m["b"].is_leader and net.m["a"].is_leader
    firsts = {p: [x for x in net.applied(p) if x[0] == 0] for p in "abc"}
    assert firsts["a"] == firsts["c"] == [(0, ("a", "c"), 22)] and firsts["b"] == []
    net.check_safety()
    net.check_same_outcomes()


@pytest.mark.parametrize("how", ["lost", "goodbye", "silent"])
def test_rival_that_stepped_us_down_is_lost_we_take_over_at_once(how):
    """b leads for a moment, c follows a (a better ballot): b backs off from a, which it does not
    see as synced. a is then lost: b takes over at the next tick, not when the back-off ends."""
    net = Net("abc", auto=False, peer_timeout=2.0)  # (query_timeout 5 s: the back-off outlasts a silence)
    net.found()
    net.m["a"].table.unsynced("b")
    net.m["b"].table.unsynced("a")
    net.hold("a", "b").hold("b", "a")
    net.tick()
    net.settle()
    assert net.m["a"].is_leader and not net.m["b"].is_leader and net.m["c"].promised == (1, "a")
    assert net.m["b"].leader.takeover._no_lead_until > net.now + 4  # backing off from a
    if how == "goodbye":
        net.release("a", "b")
        net.handle("a", net.m["a"].leave(net.now))
        net.settle()
        net.crashed.add("a")
    else:
        net.crash("a")
        if how == "lost":
            for p in "bc":
                net.handle(p, net.m[p].on_peer_lost("a", net.now))
    net.auto = True
    t0 = net.now
    while not net.m["b"].is_leader and net.now < t0 + 10:
        net.tick()
    assert net.now - t0 < (2.5 if how == "silent" else 0.15)
    net.run(1.0)
    assert net.applied("c")[-1][1] == ("b", "c")
    net.check_safety()


def test_min_peers_no_proposal_one_clear_log_and_reminders_at_10_60_and_every_300_s():
    """A step that waits for the missing peer waits in silence but for these (the first is
    info, which a library's default logging does not show; the reminders are warnings)."""
    net = Net("ab", min_peers=3)
    net.found()
    net.run(2.0)
    assert not net.sent("a", M.PROPOSE)
    logs = [x.text for x in net.of("a", Log) if "waiting for" in x.text]
    assert logs == ["waiting for 1 more peer(s): 2 of 3 synced"]
    assert not net.of("a", Waiting)
    net.run(700.0, dt=0.5)
    said = net.of("a", Waiting)
    assert [round(w.seconds) for w in said] == [10, 60, 360, 660]
    assert {w.why for w in said} == {"waiting for 1 more peer(s): 2 of 3 synced"}
    assert not net.of("b", Waiting)  # (the coordinator says it)
    net.add("c")
    net.sync_from("c", "a")
    net.run(1.0)
    assert net.applied("c")
    assert len(net.of("a", Waiting)) == 4


# -- a READY sent again: a START or ABORT lost with a link is told again ------------------------
def test_a_member_whose_abort_was_lost_is_answered_when_its_ready_comes_again():
    net = cluster("abc", run=0.5, min_peers=3)
    net.auto = False
    net.tick()  # the leader proposes the next round
    r = net.m["a"].lead.r
    net.hold("c", "a")  # c's READY is slow to come ...
    net.drop("a", "c", M.ABORT).drop("a", "c", M.STATUS)  # ... and what the leader tells c then is lost
    for p in "abc":
        net.contribute(p)
    net.settle()
    assert net.m["c"].pending.started and not net.m["c"].pending.told  # (its ring began as it contributed)
    net.auto = True
    net.run(41.0)  # the leader gives up on c's READY (at 8 deadlines: c is live) and drops it; c never hears
    assert [m["drop"] for m in net.sent("a", M.ABORT) if m["r"] == r] == [["c"]]
    assert net.m["c"].pending is not None and net.m["c"].pending.r == r  # c still waits to hear of it
    net.release("c", "a")
    net.run(12.0)
    told = [m["reason"] for m in net.sent("a", M.ABORT) if m["r"] == r][1:]  # answered (its READY, or its STATUS)
    assert told and set(told) <= {"that attempt is over", "its leader was lost"}, told
    after = [x for x in net.applied("c") if x[0] > r]
    assert after and all(v == ("a", "b", "c") for _, v, _ in after)  # and back in the rounds
    net.check_safety()
    net.check_same_outcomes()


def start_lost_to_c():
    """A net of a, b, c whose round r every member contributed to, the leader's START to c lost
    (with a link that came back at once); nobody drives the rings yet. Returns (net, r). (A peer
    timeout of 40 s, a silence of 10 s: the tests let c's deadline pass with no tick at the
    leader, which at the default would take 6 s untouched for its own stillness,
    ``RoundMachine._notice_stillness``.)"""
    net = cluster("abc", run=0.5, peer_timeout=40.0)
    net.auto = False
    net.tick()
    r = net.m["a"].lead.r
    net.drop("a", "c", M.START)
    for p in "abc":
        net.contribute(p)
    net.settle()
    assert net.m["c"].pending.started and not net.m["c"].pending.told  # (its ring runs all the same)
    return net, r


def test_a_member_whose_start_was_lost_commits_with_the_total_the_commit_tells():
    net, r = start_lost_to_c()
    net.auto = True
    net.settle()  # the rings end, the leader commits
    assert net.m["a"].counters["start_again"] == 0
    assert [x for x in net.applied("c") if x[0] == r] == [x for x in net.applied("a") if x[0] == r] != []
    assert not [m for m in net.sent("a", M.ABORT) if m["r"] == r]
    net.check_safety()
    net.check_same_outcomes()


def test_a_member_whose_start_was_lost_sends_its_ready_again_and_hears_it():
    net, r = start_lost_to_c()
    net.now += 6.0  # c's wait to hear START passes its deadline (the leader's has not yet)
    net.handle("c", net.m["c"].on_tick(net.now))
    net.settle()
    assert net.m["a"].counters["start_again"] == 1 and net.m["c"].pending.told
    net.auto = True
    net.settle()
    assert [x for x in net.applied("c") if x[0] == r] == [x for x in net.applied("a") if x[0] == r] != []
    assert not [m for m in net.sent("a", M.ABORT) if m["r"] == r]
    net.check_safety()
    net.check_same_outcomes()


# -- a peer alone: batches applied at once, their rounds committed after (solo) ---------------------
def alone_collecting(ids="a", **cfg):
    """A net whose peer ``a`` leads, collecting its own batch of a round (none handed over)."""
    net = Net(ids, auto=False, **cfg)
    net.found()
    for _ in range(5):
        net.tick()
    assert net.m["a"].lead.phase == COLLECTING and net.m["a"].pending.samples is None
    return net


def test_a_peer_alone_commits_its_solo_rounds_as_rounds_of_one_member_and_goes_back_to_rounds():
    solo, rounds = alone_collecting(), alone_collecting()
    a = solo.m["a"]
    r = a.solo_round()
    a.begin_solo(solo.now)
    assert r == rounds.m["a"].lead.r and a.solo and a.pending is None
    assert a.solo_round() is None  # (already)
    with pytest.raises(RuntimeError, match="no solo now"):
        a.begin_solo(solo.now)
    solo.tick()  # a tick proposes nothing while solo, and moves no round number
    assert a.solo and a.lead.r == r and not solo.of("a", M.Stall)
    solo.handle("a", a.commit_solo([(r, 5), (r + 1, 7)], solo.now))
    for n in (5, 7):  # the same batches through ordinary rounds of one member
        rounds.contribute("a", n)
        rounds.settle()
        rounds.finish_ring("a")
        rounds.settle()
    b = rounds.m["a"]
    assert rounds.applied("a") == [(r, ("a",), 5), (r + 1, ("a",), 7)]
    assert (a.history.version, a.history.digest, a.round) == (b.history.version, b.history.digest, b.round)
    assert a.sync_point() == b.sync_point() and a.history.recent() == b.history.recent()
    assert a.table.get("a").served == b.table.get("a").served is True
    assert list(a._log) == list(b._log)  # (what a STATUS tells a new leader of our attempts)
    asked = len(solo.of("a", M.Contribute))
    solo.handle("a", a.end_solo(solo.now))
    assert not a.solo and a.lead.phase == COLLECTING and a.pending.r == r + 2
    assert [c.r for c in solo.of("a", M.Contribute)[asked:]] == [r + 2]
    solo.auto = True  # rounds go on, on the same chain
    solo.run(0.5)
    assert solo.applied("a")[0][0] == r + 2 and a.version > 2


def test_solo_rounds_out_of_order_are_refused():
    net = alone_collecting()
    a = net.m["a"]
    r = a.solo_round()
    a.begin_solo(net.now)
    with pytest.raises(RuntimeError, match="out of order"):
        a.commit_solo([(r + 1, 5)], net.now)
    with pytest.raises(RuntimeError, match="out of order"):
        a.commit_solo([(r, 0)], net.now)


def test_no_solo_with_another_live_peer_with_min_peers_or_with_a_batch_handed_over():
    net = cluster("ab", run=0.5)
    net.hold_a_round([])
    assert net.m["a"].solo_round() is None  # b is live (and in the view)
    waiting = Net("a", auto=False, min_peers=2)
    waiting.found()
    waiting.run(0.5)
    assert waiting.m["a"].solo_round() is None  # (it waits for a second peer)
    handed = alone_collecting()
    handed.contribute("a", 4)
    assert handed.m["a"].solo_round() is None


def test_a_joiner_after_solo_rounds_loads_them_and_trains_on_the_same_chain():
    net = alone_collecting()
    a = net.m["a"]
    r = a.solo_round()
    a.begin_solo(net.now)
    net.handle("a", a.commit_solo([(r + i, 3) for i in range(4)], net.now))
    net.handle("a", a.end_solo(net.now))
    net.auto = True
    net.add("b")  # a fresh peer: behind, it loads a's state
    net.handle("b", net.m["b"].on_synced(GENESIS, net.now))
    net.run(2.0)
    assert net.resyncs["b"] and net.m["b"].synced and net.m["b"].version == net.m["a"].version > 4
    assert net.m["b"].history.digest == net.m["a"].history.digest
    assert any(view == ("a", "b") for _, view, _ in net.applied("b"))
    net.check_safety()


def test_a_peer_that_trained_alone_then_joined_does_not_take_the_lead_while_its_leader_holds():
    """Three peers started together: a and b each trained alone a moment (their solo rounds
    mark them served, in their own tables), then b loaded a's state while a sent its state to a
    slow joiner c and held its rounds for it. Five seconds on, b, unserved in a's table but
    served in its own, thought itself the coordinator, took the lead and ran a round with a:
    c's download (50 s at 10 Mbit/s) was behind once it landed, and c loaded it all again."""
    from p2ptrain.cluster.rounds import SyncPoint
    net = Net("a")
    net.found()
    net.run(2.0)
    net.manual_sync.add("c")
    b = net.add("b")
    net.handle("b", b.on_synced(SyncPoint(3, b"b" * 16, 2, 0), net.now))  # its own lineage ...
    b.table.mark_served(["b"])  # ... of solo rounds
    c = net.add("c")
    net.handle("c", c.on_synced(SyncPoint(2, b"c" * 16, 1, 0), net.now))
    net.settle()
    assert b.synced and b.history.version == net.m["a"].history.version and net.needs_sync == {"c": "a"}
    net.handle("a", net.m["a"].hold_for("c", net.now, sending=True))
    held = net.m["a"].version
    net.run(30.0)
    assert not [x.text for x in net.of("b", Log) if "coordinating" in x.text]
    assert net.m["a"].version <= held + 1  # (the round collecting when the hold began)
    net.sync_from("c", "a")  # the state lands
    net.run(10.0)
    assert c.synced and not net.resyncs["c"][1:]  # loaded once
    assert len({net.m[p].version for p in "abc"}) == 1 and net.m["a"].version > held + 1


def test_a_joiner_with_a_smaller_id_leads_only_after_its_first_round():
    """b and c train; a (the smallest id) and d join together, and b holds its rounds while
    its state goes to d. a, once loaded, knew of no peer that had served in a view, so it took
    itself for the coordinator and took the lead: its rounds left d's download behind (d loaded
    it all again). STATUS now says who has served: a waits for its first round, at the
    boundary after d is in, and then leads."""
    from p2ptrain.cluster.rounds import SyncPoint
    net = Net("bc")
    net.found()
    net.run(3.0)
    net.manual_sync.add("d")
    a = net.add("a")
    net.handle("a", a.on_synced(SyncPoint(1, b"a" * 16, 0, 0), net.now))
    d = net.add("d")
    net.handle("d", d.on_synced(SyncPoint(2, b"d" * 16, 1, 0), net.now))
    net.settle()
    assert net.needs_sync == {"d": "b"} and a.synced and a.history.version == net.m["b"].history.version
    net.handle("b", net.m["b"].hold_for("d", net.now, sending=True))
    held = net.m["b"].version
    net.run(30.0)
    assert a.lead is None and net.m["b"].version <= held + 1  # (the round collecting when the hold began)
    net.sync_from("d", "b")
    net.run(10.0)
    assert not net.resyncs["d"][1:] and len({net.m[p].version for p in "abcd"}) == 1
    assert a.lead is not None and net.m["b"].lead is None  # (handed over at a boundary)
    assert [x.text for x in net.of("b", Log) if "handing the lead over to a" in x.text]


# -- a member silent in a round we lead: left out of that round after 2.5 s (a quarter of the peer timeout) --
# (what, the round's phase, the members it waits for, seconds since b and c were last heard, config, left out;
#  a gap of our own events, 1.5 s long (past LISTEN_GAP, short of our own stillness), that ended this many
#  seconds ago)
SILENT = [
    ("collecting: c silent past 2.5 s", COLLECTING, "bc", (1.0, 3.0), {}, ["c"]),
    ("running: both silent, the leader never", RUNNING, "abc", (3.0, 4.0), {}, ["b", "c"]),
    ("running: c's DONE is in", RUNNING, "b", (1.0, 9.0), {}, []),
    ("within the silence", COLLECTING, "bc", (2.4, 2.4), {}, []),
    ("peer timeout 20 s: 5 s", COLLECTING, "bc", (4.5, 5.5), {"peer_timeout": 20.0}, ["c"]),
    ("peer timeout 5 s: never under the 2.5 s floor", COLLECTING, "bc", (2.0, 2.4), {"peer_timeout": 5.0}, []),
    ("between rounds: none in flight", BETWEEN, "", (9.0, 9.0), {}, []),
    ("querying: a takeover has its own rule", QUERYING, "bc", (9.0, 9.0), {}, []),
    ("our own events stood 1.5 s apart: silence counts from their end", COLLECTING, "bc", (1.0, 9.0), {}, [], 2.0),
    ("... which c's outlasts", COLLECTING, "bc", (1.0, 9.0), {}, ["c"], 3.0),
]


@pytest.mark.parametrize("what,phase,waiting,ago,cfg,expected,gap_ended", [c + (None,) * (7 - len(c)) for c in SILENT],
                         ids=[c[0] for c in SILENT])
def test_a_round_leaves_out_the_members_silent_past_the_silence(what, phase, waiting, ago, cfg, expected, gap_ended):
    m = RoundMachine("a", RoundConfig(**cfg))
    for peer, seconds in zip("bc", ago):
        m.table.connected(peer, 100.0 - seconds)
    if gap_ended is not None:  # (ticks: our events)
        m.on_tick(100.0 - gap_ended - 1.5)
        m.on_tick(100.0 - gap_ended)
    m.leader.lead = _Lead((1, "a"), phase, 3, 90.0, view=("a", "b", "c"), waiting=set(waiting))
    assert m.leader.silent_members(100.0) == expected


def test_a_stopped_member_is_left_out_after_2_5_s_and_trains_again_once_it_loads_the_state():
    """SIGSTOP (a laptop's lid) for 4 s, under the 10 s peer timeout: the others commit without it
    after 2.5 s of its silence, rather than wait until it wakes; woken, it is behind, loads the
    state, and is in the view again."""
    net = cluster("abc", run=1.0)
    n = len(net.applied("a"))
    net.stand_still("c", 4.0)
    during = net.applied("a")[n:]
    assert during and {v for _, v, _ in during} >= {("a", "b")}, during
    assert [m["drop"] for m in net.sent("a", M.ABORT) if m["reason"].startswith("c sent nothing for 2.5 s")] == [["c"]]
    net.run(2.0)
    assert net.resyncs["c"] and net.resyncs["c"][-1].startswith("behind")
    assert net.applied("c")[-1][1] == ("a", "b", "c") and net.m["c"].table.state("a") != "dead"
    net.check_safety()


def test_a_stopped_leader_is_given_up_after_2_5_s_and_the_next_peer_leads():
    """SIGSTOP of the leader (a laptop's lid) for 4.5 s, under the 10 s peer timeout: after 2.5 s
    of its silence the next smallest peer leads and the other two commit rounds without it, rather
    than wait the peer timeout out (``Member.give_up_silent_leader``); woken, it finds a newer
    ballot, loads the state (behind) and is in the view again."""
    net = cluster("abc", run=1.0)
    n = {p: len(net.applied(p)) for p in "bc"}
    net.stand_still("a", 4.5)
    for p in "bc":
        during = net.applied(p)[n[p]:]
        assert during and {v for _, v, _ in during} == {("b", "c")}, (p, during)
        assert [x.text for x in net.of(p, Log) if x.text.startswith("leader a sent nothing for 2.5 s")], p
    assert net.m["b"].lead is not None and net.m["b"].table.state("a") != "dead"
    net.run(3.0)
    assert net.resyncs["a"] and net.resyncs["a"][-1].startswith("behind"), net.resyncs["a"]
    assert ("a", "b", "c") in {v for _, v, _ in net.applied("a")[-3:]}
    net.check_safety()


@pytest.mark.parametrize("what,heard,expected", [
    ("the leader silent 3 s, b heard 1 s ago", {"a": 3.0, "b": 1.0}, "syncing"),
    ("the leader silent 2.4 s: not yet", {"a": 2.4, "b": 1.0}, "synced"),
    ("every peer silent: our own link, not the leader", {"a": 3.0, "b": 3.5}, "synced"),
    ("the leader is the only other peer", {"a": 3.0}, "syncing"),
])
def test_a_member_gives_up_a_leader_silent_past_the_silence_unless_all_are(what, heard, expected):
    m = RoundMachine("c", RoundConfig())
    m.synced = True
    for peer, ago in heard.items():
        m.table.connected(peer, 100.0 - ago)
        m.table.synced(peer, 0, b"", -1)
    m.member.promised = (1, "a")
    m.member.give_up_silent_leader(100.0)
    assert m.table.state("a") == expected


def test_a_member_stopped_with_the_leader_does_not_hold_the_takeover_for_its_query_timeout():
    """The leader and a member stopped together (two lids) for 6 s: after 2.5 s of silence the
    next peer leads, and its takeover leaves the silent member out as a round does, rather than
    wait the 5 s query timeout for its STATUS: the two left commit rounds before the others wake
    (with the wait, not before 7.5 s). Woken, both load the state and are in the view again."""
    net = cluster("abcd", run=1.0)
    n = len(net.applied("c"))
    net.stand_still("ab", 6.0, dt=0.1)
    during = net.applied("c")[n:]
    assert during and {v for _, v, _ in during} == {("c", "d")}, during
    net.run(3.0)
    assert all(net.applied(p)[-1][1] == ("a", "b", "c", "d") for p in "abcd"), [net.applied(p)[-1] for p in "abcd"]
    net.check_safety()


@pytest.mark.parametrize("silent_for,held", [(1.0, True), (5.5, False)])
def test_a_joiner_stopped_mid_download_holds_the_boundary_only_until_it_is_silent(silent_for, held):
    m = RoundMachine("a", RoundConfig())
    m.table.connected("d", 100.0 - silent_for)
    m.leader._admit = {"d": math.inf}  # (our state is on its way to d: ``hold_for``)
    assert bool(m.leader._catching_up(100.0)) == held


def test_a_round_recommitted_by_a_new_leader_carries_the_mask_of_the_parameters_used():
    """a commits a round in which some parameters had no gradient anywhere, tells only b, and
    dies; c is in doubt. b, the new leader, commits it to c with the COMMIT's mask, so c leaves
    those parameters' ``grad`` None as b did (without it, c stepped every parameter: apart)."""
    net = Net("abc", auto=False)
    net.found()
    masks = {"a": b"\x01", "b": b"\x03", "c": b"\x01"}  # (bits: which parameters had a gradient)
    net.commit_unheard("a", ["c"], used=masks)
    net.crash("a")
    net.auto = True
    for p in "bc":
        net.handle(p, net.m[p].on_peer_lost("a", net.now))
    net.run(3.0)
    first = {p: [x.used for x in net.of(p, M.Apply) if x.r == 0] for p in "bc"}
    assert first["b"] == first["c"] == [b"\x03"], first
    net.check_safety()


def test_a_leader_back_from_a_stop_while_another_still_stands_still_stalls_no_round():
    """a (the leader, the smallest id) and c stand still; b leads after 5 s. a wakes while c
    still stands still: it leads no more (its last round aborted), hears the others, loads
    their state (behind) and awaits the STATUS of the side it loaded, not c's. Leading on, a
    waited 5 s for c's READY, the others' STATUS behind it, while b held its rounds for a to load;
    then, handed the lead, a waited for c's STATUS up to the query timeout: the soak saw 10 s
    without a round."""
    net = cluster("abcd", run=1.0)
    held = {p: {(o, p) for o in net.m if o != p} - net.held for p in "ac"}
    for p in "ac":
        net.held |= held[p]
        net.still.add(p)
    net.run(7.0)
    assert net.m["b"].leader.lead is not None
    net.still.discard("a")
    net.held -= held["a"]
    net.settle()
    start = net.now
    net.run(3.0)  # (c still stands still)
    times = [t for t, _ in net.applied_at["b"] if t >= start]
    gaps = [b - a for a, b in zip([start] + times, times)]
    assert times and max(gaps) < 2.0, gaps
    views = [v for r, v, _ in net.applied("b") if r > 0][-5:]
    assert all(v == ("a", "b", "d") for v in views), views
    net.still.discard("c")
    net.held -= held["c"]
    net.settle()
    net.run(3.0)
    assert all(net.applied(p)[-1][1] == ("a", "b", "c", "d") for p in "abcd"), [net.applied(p)[-1] for p in "abcd"]
    net.check_safety()


def test_a_back_off_from_a_leader_we_never_saw_ends_once_another_leads_us():
    """A peer loads state from c, whose STATUS names a as its leader: it backs off from leading
    while it does not see a (a replugged peer with a small id took a side from its leader). a was
    stopped meanwhile; c took over, led a round with us, and hands us the lead (our id is
    smaller): we take it at once, not when the back-off ends (the soak: 5 s without a round)."""
    m = RoundMachine("b", RoundConfig())
    m.synced = True
    m._set_self()
    m.table.connected("c", 99.0)
    m.table.synced("c", 0, b"", -1)
    m.table.mark_served(["b", "c"])
    m.leader.takeover.back_off("a", 99.0)
    assert not m.leader.takeover.may_lead(100.0)  # (no leader led us yet: a leads that side)
    m.member.promised = (6, "c")
    assert m.leader.takeover.may_lead(100.0)


def test_a_peer_back_from_an_unplugged_cable_does_not_take_the_lead_from_a_live_leader():
    """b's cable is out for 7 s; it comes back first to c and d while its link to a, the leader,
    stays quiet 3 s longer (TCP retransmits after a back-off). b finds a silent while it hears the
    others and takes over; c and d hear a, so they refuse its QUERY (as Raft's followers refuse
    a vote while their leader is live): a's rounds with c and d go on without a gap, and b, told
    by their STATUS that it is behind, loads the state. Obeying b's newer epoch, c and d had left
    a's round, and the soak saw the cluster without a round for 5-6 s."""
    net = cluster("abcd", run=1.0)
    for p in "acd":
        net.unplug("b", p)
    net.run(7.0)
    assert {v for _, v, _ in net.applied("a")[-3:]} == {("a", "c", "d")}
    for p in "cd":
        net.replug("b", p)
    start = net.now
    net.run(3.0)
    net.replug("b", "a")
    net.run(3.0)
    times = [t for t, _ in net.applied_at["a"] if t >= start]
    gaps = [y - x for x, y in zip([start] + times, times)]
    assert times and max(gaps) < 1.0, gaps
    assert not [x for x in net.of("a", Log) if "superseded" in x.text or "follows b" in x.text]
    assert net.resyncs["b"] and net.resyncs["b"][-1].startswith("behind"), net.resyncs["b"]
    assert all(net.applied(p)[-1][1] == ("a", "b", "c", "d") for p in "abcd"), [net.applied(p)[-1] for p in "abcd"]
    net.check_safety()
