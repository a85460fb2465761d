"""The peer table, the lineage chain and its heal rule, and the adaptive round timer: pure code."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from p2ptrain.cluster import membership as mb
from p2ptrain.cluster.membership import (CONNECTING, DEAD, LEAVING, SYNCED, SYNCING, History, Lineage, PeerTable,
                                 RoundTimer, heal_decision, relation)


def table(*synced, me="m"):
    t = PeerTable(me)
    t.set_self(True, 0, b"d")
    for p in synced:
        t.connected(p, 0.0)
        t.synced(p, 0, b"d", 0, 0.0)
    return t


# -- every transition of the table ------------------------------------------------------------
def entry_in(state):
    """A table with peer "p" in ``state`` (None: absent)."""
    t = table()
    if state is None:
        return t
    t.heard("p", None, 0.0)
    if state in (SYNCING, SYNCED, DEAD, LEAVING):
        t.connected("p", 0.0)
    if state == SYNCED:
        t.synced("p", 0, b"d", 0)
    if state == DEAD:
        t.expire(100.0, 1.0)
    if state == LEAVING:
        t.said_goodbye("p")
    assert t.state("p") == state
    return t


EVENTS = {
    "heard": lambda t: t.heard("p", None, 200.0), "connected": lambda t: t.connected("p", 200.0),
    "synced": lambda t: t.synced("p", 0, b"d", 0, 200.0), "unsynced": lambda t: t.unsynced("p"),
    "link_lost": lambda t: t.link_lost("p", 200.0), "said_goodbye": lambda t: t.said_goodbye("p", 200.0),
    "expire": lambda t: t.expire(1000.0, 1.0), "message": lambda t: t.message("p", 200.0),
}


@pytest.mark.parametrize("state", [None, *mb.STATES])
@pytest.mark.parametrize("event", sorted(EVENTS))
def test_every_transition_follows_the_table(state, event):
    t = entry_in(state)
    EVENTS[event](t)
    expected = mb._TRANSITIONS.get((event, state), state)
    if state in (DEAD, LEAVING) and event == "expire":  # tombstones are forgotten after a while
        expected = None
    assert t.state("p") == expected


def test_new_peer_heard_then_connected_then_synced():
    t = PeerTable("m")
    assert t.heard("b", ("10.0.0.2", 7001), 1.0) and t.state("b") == CONNECTING
    assert t.get("b").addr == ("10.0.0.2", 7001) and t.get("b").last_heard == 1.0
    assert t.connected("b", 2.0) and t.state("b") == SYNCING
    assert t.live_synced() == []  # not in a view before it shows our lineage
    assert t.synced("b", 3, b"x", 7, 2.5) and t.state("b") == SYNCED
    assert (t.get("b").version, t.get("b").digest, t.get("b").round) == (3, b"x", 7)


def test_inbound_connection_without_beacon_creates_entry():
    t = PeerTable("m")
    assert t.connected("b", 1.0, addr=("h", 1)) and t.state("b") == SYNCING and t.get("b").addr == ("h", 1)


def test_unknown_ids_are_not_created_by_other_events():
    t = PeerTable("m")
    for ev in (lambda: t.synced("x", 0, b"", 0), lambda: t.link_lost("x", 1.0), lambda: t.unsynced("x"),
               lambda: t.said_goodbye("x"), lambda: t.message("x", 1.0)):
        ev()
    assert "x" not in t and len(t) == 1


def test_synced_to_syncing_and_back():
    t = table("b")
    assert t.unsynced("b") and t.state("b") == SYNCING
    assert not t.unsynced("b")  # already
    assert t.synced("b", 1, b"y", 1) and t.state("b") == SYNCED


def test_link_lost_goes_to_connecting_and_reconnect_needs_sync():
    t = table("b")
    assert t.link_lost("b", 5.0) and t.state("b") == CONNECTING
    assert not t.synced("b", 0, b"d", 0)  # a STATUS needs a link first
    assert t.connected("b", 6.0) and t.state("b") == SYNCING


def test_goodbye_is_final():
    t = table("b")
    assert t.said_goodbye("b", 1.0) and t.state("b") == LEAVING
    for ev in (lambda: t.heard("b", None, 2.0), lambda: t.connected("b", 2.0),
               lambda: t.synced("b", 0, b"d", 0), lambda: t.expire(100.0, 1.0)):
        ev()
        assert t.state("b") in (LEAVING, None)


def test_expire_marks_silent_dead_and_forgets_tombstones():
    t = table("b", "c")
    t.heard("c", None, 9.0)
    assert t.expire(10.5, 5.0) == ["b"] and t.state("b") == DEAD and t.state("c") == SYNCED
    assert t.expire(10.5, 5.0) == []  # only newly dead
    assert t.heard("b", None, 11.0) and t.state("b") == CONNECTING  # back from the dead
    t.expire(20.0, 5.0)
    assert t.state("b") == DEAD
    t.expire(20.0 + 5.0 * mb.FORGET_AFTER + 1, 5.0)
    assert "b" not in t and t.state("m") == SYNCED  # our own entry never expires


def test_dead_peer_with_live_link_can_show_status_again():
    t = table("b")
    t.expire(100.0, 5.0)
    assert t.state("b") == DEAD
    assert t.synced("b", 0, b"d", 0, 101.0) and t.state("b") == SYNCED


def test_message_is_proof_of_life_only():
    t = table("b")
    t.message("b", 42.0)
    assert t.get("b").last_heard == 42.0 and t.state("b") == SYNCED
    assert t.expire(45.0, 5.0) == []


def test_self_entry_is_set_by_the_round_machine_only():
    t = PeerTable("m")
    assert t.live_synced() == [] and t.coordinator() is None
    t.link_lost("m", 1.0)
    t.said_goodbye("m")
    assert t.state("m") == SYNCING
    t.set_self(True, 4, b"q", 9)
    assert t.live_synced() == ["m"] and t.coordinator() == "m"


def test_coordinator_is_smallest_live_synced_served_first():
    t = table("b", "k", me="m")
    assert t.coordinator() == "b"
    t.mark_served(["m", "k"])
    assert t.coordinator() == "k"  # b has not served in a view yet: it waits for a boundary
    t.mark_served(["b"])
    assert t.coordinator() == "b"
    t.link_lost("b", 1.0)
    assert t.coordinator() == "k"


def test_can_train_says_how_many_are_missing():
    t = table("b")
    assert t.can_train(2) == (True, "2 synced peers")
    ok, why = t.can_train(4)
    assert not ok and why == "waiting for 2 more peer(s): 2 of 4 synced"


def test_report_keeps_round_and_checksum():
    t = table("b")
    t.report("b", 5, b"\x01")
    t.report("b", 4, None)
    assert t.get("b").round == 5 and t.get("b").checksum == b"\x01"


def test_security_limits():
    t = PeerTable("m")
    assert not t.heard("x" * (mb.MAX_ID_LEN + 1), None, 0.0) and not t.heard("", None, 0.0)
    for i in range(mb.MAX_PEERS + 10):
        t.heard(f"p{i:05d}", None, 0.0)
    assert len(t) == mb.MAX_PEERS
    with pytest.raises(ValueError):
        PeerTable("")


# -- lineage ------------------------------------------------------------------------------------
def chain(rounds):
    h = History(0, mb.genesis(b"seed"))
    for r, view, total in rounds:
        h.append(r, view, total)
    return h


def test_history_chain_depends_on_every_field_and_order():
    base = [(0, ("a", "b"), 10), (2, ("a", "b"), 12)]
    h = chain(base)
    assert h.version == 2 and len(h.digest) == mb.DIGEST_BYTES
    for other in ([(0, ("a", "b"), 10), (3, ("a", "b"), 12)], [(0, ("a",), 10), (2, ("a", "b"), 12)],
                  [(0, ("a", "b"), 11), (2, ("a", "b"), 12)], list(reversed(base))):
        assert chain(other).digest != h.digest
    assert chain(base).digest == h.digest
    assert mb.genesis(b"x") != mb.genesis(b"y")


def test_history_window_and_relation():
    a = chain([(r, ("a",), 1) for r in range(5)])
    b = chain([(r, ("a",), 1) for r in range(3)])
    assert a.at(3) == b.digest and a.at(99) is None
    assert relation(a, b.version, b.digest, b.recent()) == "behind"
    assert relation(b, a.version, a.digest, a.recent()) == "ahead"
    assert relation(a, a.version, a.digest, a.recent()) == "same"
    c = chain([(r, ("a",), 2) for r in range(3)])
    assert relation(a, c.version, c.digest, c.recent()) == "split"
    assert relation(c, a.version, a.digest, a.recent()) == "split"
    assert relation(b, c.version, c.digest, c.recent()) == "split"
    long = chain([(r, ("a",), 1) for r in range(mb.WINDOW + 10)])
    assert long.at(0) is None and len(long.recent()) == mb.STATUS_WINDOW
    assert relation(long, 0, b"anything", []) == "behind"  # too old to tell: it loads state anyway


def test_the_digest_window_holds_its_versions_in_a_megabyte_whatever_the_runs_length():
    """A long run's History keeps WINDOW versions' digests in one ring (16 bytes a version),
    not a dict of bytes objects (about 200 bytes a version: 13 MB at WINDOW); every version
    in the window, across the ring's wrap, is still told."""
    import tracemalloc

    tracemalloc.start()
    try:
        h = History()
        kept = {}
        for r in range(mb.WINDOW + 5000):
            h.append(r, ("a", "b"), 3)
            if r % 997 == 0 or r > mb.WINDOW + 4990:
                kept[h.version] = h.digest
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert held < mb.WINDOW * mb.DIGEST_BYTES + 200_000, held
    oldest = h.version - mb.WINDOW + 1
    assert h.at(oldest - 1) is None and h.at(oldest) is not None and h.at(h.version) == h.digest
    for v, d in kept.items():
        assert h.at(v) == (d if v >= oldest else None), v
    assert [v for v, _ in h.recent()] == list(range(h.version - mb.STATUS_WINDOW + 1, h.version + 1))
    assert all(h.at(v) == d for v, d in h.recent(mb.WINDOW))
    resumed = History(h.version, h.digest, h.recent(mb.WINDOW))  # (a snapshot's lineage)
    assert resumed.at(oldest) == h.at(oldest) and resumed.at(oldest + 7919) == h.at(oldest + 7919)


def test_a_long_split_is_told_from_lagging_by_asking_the_newer_side():
    """The older side cannot see a split older than the newer side's STATUS window: it asks,
    and the reply carries the newer side's digest at its version (``at``)."""
    common = [(r, ("a", "b", "c"), 3) for r in range(5)]
    small = chain(common + [(r, ("c",), 1) for r in range(5, 8)])  # 3 rounds alone
    big = chain(common + [(r, ("a", "b"), 2) for r in range(5, 40)])  # 35 rounds on the other side
    lag = chain(common + [(r, ("a", "b"), 2) for r in range(5, 8)])  # on big's chain, far behind
    for older in (small, lag):
        assert relation(older, big.version, big.digest, big.recent(), can_ask=True) == "unknown"
        assert relation(older, big.version, big.digest, big.recent()) == "ahead"  # (a reply: by version)
    assert relation(big, small.version, small.digest, small.recent()) == "split"  # the newer side knows
    at_small, at_lag = (small.version, big.at(small.version)), (lag.version, big.at(lag.version))
    assert relation(small, big.version, big.digest, big.recent(), at=at_small) == "split"
    assert relation(lag, big.version, big.digest, big.recent(), at=at_lag) == "ahead"


def test_heal_decision_rules():
    big, small = Lineage(3, b"\x01", 10, "b"), Lineage(2, b"\x02", 50, "a")  # more members keep, however far
    assert heal_decision(small, big) == "resync" and heal_decision(big, small) == "keep"
    # a tie of members: more updates keep (peers that founded apart: the side 145 updates in is
    # not given up for one at version 1, whatever the smallest ids)
    far, near = Lineage(1, b"\x01", 145, "d"), Lineage(1, b"\x02", 1, "a")
    assert heal_decision(far, near) == "keep" and heal_decision(near, far) == "resync"
    x, y = Lineage(2, b"\x01", 5, "a"), Lineage(2, b"\x02", 5, "c")  # then the larger smallest id re-syncs
    assert heal_decision(y, x) == "resync" and heal_decision(x, y) == "keep"
    x, y = Lineage(2, b"\x01", 5, "a"), Lineage(2, b"\x02", 5, "a")  # then the larger digest
    assert heal_decision(y, x) == "resync" and heal_decision(x, y) == "keep"
    assert heal_decision(x, x) == "keep"


lineages = st.builds(Lineage, st.integers(1, 4), st.binary(min_size=1, max_size=2), st.integers(0, 3),
                     st.sampled_from("abcd"))


@given(lineages, lineages)
def test_heal_decision_exactly_one_side_resyncs(x, y):
    a, b = heal_decision(x, y), heal_decision(y, x)
    if (x.digest, x.version) == (y.digest, y.version):
        assert a == b == "keep"
    else:
        assert sorted([a, b]) == ["keep", "resync"]


# -- timer --------------------------------------------------------------------------------------
def test_round_timer_floor_bytes_and_median_mad():
    t = RoundTimer(floor=5.0, slack=4.0, throughput=1e6)
    assert t.deadline() == 5.0
    assert t.deadline(10_000_000) == pytest.approx(40.0)  # 4 * 10 MB / 1 MB/s before any sample
    for s in (1.0, 1.0, 1.0, 1.2, 0.8):
        t.record(s, 100_000_000)  # ~100 MB/s observed
    assert t.throughput == pytest.approx(100e6)
    assert t.deadline(10_000_000) == 5.0  # fast link: the floor
    assert t.deadline(1_000_000_000) == pytest.approx(40.0)
    slow = RoundTimer(floor=1.0)
    for s in (10, 10, 11, 9, 10, 60):  # one outlier does not move median + 4 MAD much
        slow.record(s)
    assert slow.deadline() == pytest.approx(10 + 4 * 0.5)
    slow.record(-1.0)
    assert slow.deadline() == pytest.approx(12.0)
    with pytest.raises(ValueError):
        RoundTimer(floor=0)


def test_a_history_resumed_from_a_members_window_knows_its_older_versions():
    member = History()
    for r in range(20):
        member.append(r, ["a", "b"], 3)
    window = member.recent(10)
    resumed = History(member.version, member.digest, window)
    assert resumed.at(member.version - 9) == member.at(member.version - 9) is not None
    assert mb.relation(resumed, member.version - 5, b"x" * 16, []) == "split"  # not "behind": it can tell
    for bad in (window[:-1], window[::2], [(v, d[:3]) for v, d in window], [("1", b"x")], [None]):
        fresh = History(member.version, member.digest, bad)  # not a chain ending here: ignored
        assert fresh.at(member.version - 1) is None and fresh.at(member.version) == member.digest
