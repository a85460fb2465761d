"""One end of a run for the whole cluster (``p2ptrain.cluster.ending``), on the round machine's
fake bus: every member finishes at the same version, whoever joined late, whoever leads, and a
peer that arrives after the end does not train alone."""

import dataclasses
import math

import pytest
from roundnet import GENESIS, Net, cluster

from p2ptrain.cluster.membership import DEAD

from p2ptrain.cluster import roundmsg as M
from p2ptrain.cluster.roundmsg import Apply, Finish, Log

pytestmark = pytest.mark.timeout(60)


def finished(net, p):
    return [(a.version, a.r) for a in net.of(p, Finish)]


def versions_applied(net, p):
    return len([a for a in net.actions[p] if isinstance(a, Apply)])


def own(net, p, **cfg):
    net.m[p].config = dataclasses.replace(net.m[p].config, **cfg)


def test_every_member_finishes_at_the_cluster_version_and_no_round_follows():
    net = cluster("abc", run=3.0, max_version=12)
    ends = {p: finished(net, p) for p in "abc"}
    assert ends["a"] == ends["b"] == ends["c"] and ends["a"][0][0] == 12, ends
    assert all(net.m[p].history.version == 12 == net.m[p].ended for p in "abc")
    assert all(versions_applied(net, p) == 12 for p in "abc")
    proposals = len(net.sent("a", M.PROPOSE))
    net.run(2.0)
    assert len(net.sent("a", M.PROPOSE)) == proposals  # nothing after the end
    assert net.sent("a", M.END)[0]["version"] == 12
    net.check_safety()


def test_the_leaders_clock_ends_the_run_for_members_without_one():
    net = Net("abc")
    own(net, "a", deadline=1.0)  # only the leader has a --duration
    net.found()
    net.run(3.0)
    ends = {p: finished(net, p) for p in "abc"}
    assert ends["a"] and ends["a"] == ends["b"] == ends["c"], ends
    assert "duration" in net.of("b", Finish)[0].reason
    assert 0 < ends["a"][0][0] == net.m["c"].history.version


def test_members_keep_the_leaders_limits_and_a_new_leader_ends_there():
    """The leader's PROPOSE carries its limits; after it dies, the next leader (which has no
    --max-rounds of its own) ends the run where the first one would have."""
    net = Net("abc")
    own(net, "a", max_version=30)
    net.found()
    net.run(0.5)
    assert net.sent("a", M.PROPOSE)[-1]["end"] == [30, None]
    assert 0 < net.m["b"].history.version < 30
    net.crash("a")
    net.run(25.0)
    assert net.m["b"].is_leader or net.m["b"].ended is not None
    assert finished(net, "b") == finished(net, "c") and finished(net, "b")[0][0] == 30


def test_a_leader_that_never_heard_the_deadline_is_ended_by_its_members():
    """The leader started later (its --duration ends long after) and never heard the cluster's
    deadline, which its members hold: two peer timeouts past it, a member ends the run between
    rounds and the others finish at its version (they trained on past every --duration of
    theirs: a churn soak's peers had to be killed)."""
    net = Net("abc")
    own(net, "a", deadline=100.0)
    for p in "bc":
        own(net, p, deadline=1.0)
    net.found()
    net.run(1.0 + 2 * net.m["b"].config.peer_timeout + 2.0)
    ends = {p: finished(net, p) for p in "abc"}
    assert all(ends.values()) and ends["a"] == ends["b"] == ends["c"], ends
    assert any("never heard it" in f.reason for p in "bc" for f in net.of(p, Finish)), ends
    net.check_safety()


def test_a_later_deadline_from_a_new_leader_does_not_move_the_end_a_member_heard():
    """Members keep the earliest deadline heard: a leader that took over without it (it was
    restarted, say) does not move the run's end away."""
    net = Net("abc")
    own(net, "a", deadline=1.0)
    net.found()
    net.run(0.5)
    heard = net.m["b"].ending.limits()[1]
    net.m["b"].ending.adopt_limits(M.Propose(r=99, b=(9, "x"), view=("b", "c", "x"), end=(0, 500.0)), net.now)
    assert net.m["b"].ending.limits()[1] == heard < 2.0


def test_a_joiner_catching_up_at_the_end_finishes_with_the_same_parameters():
    """The leader holds the end, as it holds a round, while a joiner loads its state: the
    joiner finishes at the same version (so with the same parameters)."""
    net = cluster("bc", run=0.5, max_version=40)
    net.manual_sync.add("a")
    net.add("a")
    net.handle("a", net.m["a"].on_synced(dataclasses.replace(GENESIS), net.now))  # fresh: behind
    net.run(0.3)
    assert net.resyncs["a"]  # it will load b's state
    net.run(2.0)  # meanwhile the cluster goes on without it ...
    net.sync_from("a", "b")
    net.run(5.0)
    ends = {p: finished(net, p) for p in "abc"}
    assert ends["a"] == ends["b"] == ends["c"] and ends["b"][0][0] == 40, ends
    assert net.m["a"].history.digest == net.m["b"].history.digest


def test_a_peer_that_arrives_after_the_end_does_not_train_alone():
    net = cluster("bc", run=3.0, max_version=10)
    assert finished(net, "b") == finished(net, "c") != []
    net.add("a")  # fresh, and with the smallest id: it would lead itself
    net.handle("a", net.m["a"].on_synced(GENESIS, net.now))
    net.run(2.0)
    assert net.m["a"].ended == 0 and finished(net, "a") == [(0, -1)]
    assert not net.applied("a") and not net.sent("a", M.PROPOSE)
    assert any("ended at version 10" in a.text for a in net.of("a", Log))


def test_a_goodbye_that_says_the_run_ended_stops_a_peer_left_alone():
    net = cluster("ab", run=1.0)
    version = net.m["a"].history.version
    net.m["b"].ending.ended = version  # (b finished the run; a did not hear END)
    net.handle("b", net.m["b"].leave(net.now))
    net.settle()
    assert finished(net, "a") == [(version, net.m["a"].round)]
    proposals, applied = len(net.sent("a", M.PROPOSE)), net.applied("a")
    net.run(1.0)
    assert len(net.sent("a", M.PROPOSE)) == proposals and net.applied("a") == applied


def test_no_limits_no_end():
    net = cluster("ab", run=3.0)
    assert not finished(net, "a") and net.m["a"].ended is None
    assert net.sent("a", M.PROPOSE)[-1]["end"] is None
    assert math.isinf(net.m["a"].ending.limits()[1])


def test_idle_rounds_are_not_versions_the_end_counts_updates():
    """A committed round in which nobody contributed (total 0) changes no parameter: like an
    aborted round it leaves the chain as it was, so the run ends after ``max_version``
    updates, not after that many rounds of which some applied nothing."""
    net = Net("abc", max_version=12)
    contribute = net.contribute

    def some_idle(p, samples=None):  # every third round nobody has anything
        r = min(r for r, n in net.asked[p].items() if n)
        contribute(p, 0 if r % 3 == 0 else samples)

    net.contribute = some_idle
    net.found()
    net.run(4.0)
    for p in "abc":
        idle = [a for a in net.of(p, Apply) if a.total_samples == 0]
        updates = [a for a in net.of(p, Apply) if a.total_samples > 0]
        assert idle and len(updates) == 12 == net.m[p].history.version, (p, len(idle), len(updates))
        assert finished(net, p) == finished(net, "a") and finished(net, p)[0][0] == 12
    assert len({net.m[p].history.digest for p in "abc"}) == 1
    net.check_safety()


def test_a_member_told_the_end_by_a_peer_before_the_last_commit_reaches_it_finishes_with_the_others():
    """The leader's COMMIT of the last round is slow to reach c (a CPU-starved peer), and b,
    done, says goodbye with the end on its own link first: c finished at once, a version behind
    the others, with other parameters. Now it waits for its started round's decision."""
    net = Net("abc", auto=False, max_version=1)
    net.found()
    net.commit_unheard("a", "c")  # (the last round: a's COMMIT and END to c are held)
    assert finished(net, "a") == finished(net, "b") and finished(net, "a")[0][0] == 1
    assert not finished(net, "c") and net.m["c"].pending is not None
    net.handle("b", net.m["b"].leave(net.now))  # (its GOODBYE says the run ended at version 1)
    net.settle()
    net.tick()
    assert not finished(net, "c")  # its round awaits the leader's decision
    net.release("a", "c")
    net.settle()
    assert finished(net, "c") == finished(net, "a")
    assert net.m["c"].history.digest == net.m["a"].history.digest and versions_applied(net, "c") == 1


def stop_while_the_others_finish(net, p, seconds, exit_after=True):
    """p stands still (SIGSTOP) ``seconds`` while the others go on (``Net.stand_still``); those
    that finish meanwhile exit (``exit_after``): their links close, what they sent p before
    waits in its sockets. Then p runs again and finds their links closed."""
    into = {(o, p) for o in net.m if o != p}
    net.held |= into
    net.still.add(p)
    for _ in range(round(seconds / 0.5)):
        net.tick(0.5)
        for o in net.live():
            if exit_after and net.m[o].ended is not None:
                net.crash(o, sent_arrive=True)
    net.still.discard(p)
    net.held -= into
    net.settle()
    for o in sorted(net.crashed):
        net.handle(p, net.m[p].on_peer_lost(o, net.clock(p)))


@pytest.mark.parametrize("min_peers", [1, 2])
def test_a_peer_stopped_past_the_end_while_the_others_exit_stops_too(min_peers):
    """c is stopped 25 s; a and b drop it, reach the last version and exit, so no END or STATUS
    can reach c. Waking, it finds none of them and stops at once, at its own version, without
    a round alone (it trained on alone to the limit, or with --min-peers 2 waited for ever)."""
    net = Net("abc", max_version=30, min_peers=min_peers)
    net.found()
    net.run(1.0)
    version = net.m["c"].version
    assert 0 < version < 30
    stop_while_the_others_finish(net, "c", 25.0)
    assert net.crashed == {"a", "b"} and net.m["a"].ended == 30
    net.run(10.0)
    assert finished(net, "c") == [(version, net.m["c"].round)] and net.of("c", Finish)[0].behind
    assert versions_applied(net, "c") == version and not [a for a in net.of("c", Apply) if a.view == ("c",)]
    assert any("stood still 25 s" in a.text and "last version (30)" in a.text for a in net.of("c", Log))


def test_a_peer_stopped_briefly_while_the_others_crash_goes_on_alone():
    """At the pace it saw the others could not have reached the end in the 8 s c stood still:
    they crashed. c, alone, goes on as a peer left alone does."""
    net = Net("abc", max_version=500)
    net.found()
    net.run(1.0)
    net.crash("a").crash("b")
    stop_while_the_others_finish(net, "c", 8.0)
    net.run(10.0)
    assert net.m["c"].ended is None and net.m["c"].version > 20


def test_a_peer_stopped_past_the_end_hears_it_from_a_peer_still_there():
    """The others finished but have not exited: waking, c hears the end from them."""
    net = Net("abc", max_version=30)
    net.found()
    net.run(1.0)
    stop_while_the_others_finish(net, "c", 25.0, exit_after=False)
    for o in "ab":
        if DEAD in (net.m[o].table.state("c"), net.m["c"].table.state(o)):
            net.cut(o, "c").reconnect(o, "c")
    net.run(3.0)
    assert finished(net, "c") and net.m["c"].version < 30 == net.m["a"].ended
    assert not [a for a in net.of("c", Apply) if a.view == ("c",)]
