"""A member that holds the rounds more than its samples are worth is named in one line by the
leader (``p2ptrain.cluster.worth``): the rule by tables, then the round machine on the fake bus
of ``roundnet`` with one slow member."""

import pytest
from roundnet import cluster

from p2ptrain.cluster.roundmsg import Log
from p2ptrain.cluster.worth import Worth

pytestmark = pytest.mark.timeout(60)


def rounds(worth, n, ready_at, samples, seconds):
    return [worth.round(ready_at, samples, seconds) for _ in range(n)]


def test_a_member_held_for_more_than_its_samples_are_worth_is_named_once_with_the_figures():
    # The pair in gradient mode: the fast peer ready after its 0.11 s batch, the slow one
    # 0.3 s later; 64 samples each a round of 0.45 s, 0.15 s without the slow one: the fast one
    # alone makes 427/s, so the slow one's 64 samples are worth 0.15 s of it, and cost 0.3 s.
    worth = Worth(window=20, min_held=5.0)
    said = rounds(worth, 40, {"fast": 0.11, "slow": 0.41}, {"fast": 64, "slow": 64}, 0.45)
    assert said[:19] == [None] * 19  # (a whole window first)
    lines = [s for s in said if s]
    assert len(lines) == 1 and said[19] == lines[0]
    assert lines[0].startswith("peer slow held the last 20 rounds 6.0 s in all for 1280 samples, worth 3.0 s")
    assert "fast" not in lines[0].split(":")[0]


def test_a_member_that_pays_for_itself_is_not_named():
    worth = Worth(window=20, min_held=5.0)
    # held 0.3 s a round, but its 640 samples are worth 2.0 s of the others' 320/s: it pays
    assert rounds(worth, 40, {"a": 0.1, "b": 0.4}, {"a": 64, "b": 640}, 0.5) == [None] * 40
    # equal members, the last by a hair each round: held little in all
    assert rounds(Worth(), 60, {"a": 0.100, "b": 0.101}, {"a": 64, "b": 64}, 0.15) == [None] * 60
    # held much, but not for a whole window yet
    assert rounds(Worth(window=20), 19, {"a": 0.1, "b": 5.0}, {"a": 64, "b": 1}, 5.1) == [None] * 19


def test_said_again_only_after_a_window_in_which_it_paid_for_itself_or_after_it_left():
    worth = Worth(window=5, min_held=1.0)
    slow, fine = ({"a": 0.1, "b": 0.6}, {"a": 64, "b": 8}, 0.7), ({"a": 0.1, "b": 0.1}, {"a": 64, "b": 64}, 0.2)
    assert sum(map(bool, rounds(worth, 20, *slow))) == 1
    rounds(worth, 5, *fine)  # a whole window of paying for itself
    assert sum(map(bool, rounds(worth, 10, *slow))) == 1
    worth.forget("b")
    assert sum(map(bool, rounds(worth, 10, *slow))) == 1
    assert worth.round({"a": 0.1}, {"a": 64}, 0.2) is None  # (alone: nobody to hold)


def test_the_leader_names_the_member_whose_batches_every_round_waits_for():
    net = cluster("abc", run=0.5)
    net.compute["c"] = 0.5  # c hands its contribution 0.5 s after each proposal; a and b at once
    net.run(30.0)
    lines = [x.text for x in net.of("a", Log) if x.level == "warning"]
    assert len(lines) == 1 and lines[0].startswith("peer c held the last 20 rounds"), lines
    assert not [x for p in "bc" for x in net.of(p, Log) if "held the last" in x.text]  # (the leader's line)
    net.check_safety()


def test_the_leader_says_nothing_of_members_that_keep_pace():
    net = cluster("abc", run=0.5)
    net.run(30.0)
    assert not [x for x in net.of("a", Log) if "held the last" in x.text]
