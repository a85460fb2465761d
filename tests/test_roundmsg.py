"""The round protocol's messages (``p2ptrain.cluster.roundmsg``): the fields on the wire, and
``parse``, which returns a message as the frozen class of its type (a field an older peer omits
reads as its default) or raises ``RemoteProtocolError`` and nothing else (fuzzed)."""

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from roundnet import Net

from p2ptrain.cluster import roundmsg as M
from p2ptrain.cluster.rounds import RoundMachine
from p2ptrain.cluster.used import MASK_LIMIT
from p2ptrain.errors import RemoteProtocolError


def test_message_types_and_fields_on_the_wire():
    net = Net("ab", auto=True)
    net.found()
    net.tick()
    p = net.sent("a", M.PROPOSE)[0]
    assert set(p) == {"t", "r", "b", "view", "end"} and p["b"] == [1, "a"] and p["view"] == ["a", "b"]
    assert p["end"] is None  # (no --max-rounds or --duration: no limits)
    assert set(net.sent("b", M.READY)[0]) == {"t", "r", "b", "samples", "version", "digest"}
    start = net.sent("a", M.START)[0]
    assert set(start) == {"t", "r", "b", "view", "total", "spread", "ready"}
    assert len(start["ready"]) == 2 and min(start["ready"]) == 0  # (the last READY's own: none after it)
    assert set(net.sent("b", M.DONE)[0]) == {"t", "r", "b", "ok", "checksum"}
    commit = net.sent("a", M.COMMIT)[0]
    assert set(commit) == {"t", "r", "b", "total", "spread"} and commit["total"] == start["total"] > 0
    theirs = [m["samples"] for m in net.sent("b", M.READY) if m["r"] == start["r"]][0]
    samples = [theirs, start["total"] - theirs]  # (the leader's own READY goes to itself, not the wire)
    assert samples[0] != samples[1]
    assert commit["spread"] == start["spread"] == [max(samples), sum(n * n for n in samples)]


def test_a_spread_of_samples_is_the_largest_and_the_squares_or_none():
    assert M.spread_of([30, 3]) == [30, 909] and M.spread_of([5]) == [5, 25]
    assert M.spread_of([0, 0]) is None  # (nobody had anything: nothing to scale)


@pytest.mark.parametrize("spread", [[6, 36], [3, 10], [3, 16], [0, 0], [3], "x", [3, 9, 1], [-1, 9]])
def test_a_spread_that_does_not_fit_its_total_is_refused(spread):
    # total 5, largest 3: the other 2 samples add at least 2 (1 + 1) and the squares are at most 3 * 5
    with pytest.raises(RemoteProtocolError):
        M.parse({"t": M.COMMIT, "r": 1, "b": [1, "a"], "total": 5, "spread": spread})
    for fits in ([3, 11], [3, 13], [5, 25], [1, 5]):
        assert M.parse({"t": M.COMMIT, "r": 1, "b": [1, "a"], "total": 5, "spread": fits}).spread == tuple(fits)


def test_a_start_says_when_each_member_was_ready_before_the_last():
    offsets = M.ready_offsets(["a", "b", "c"], {"a": 0.5, "b": 0.1, "c": 0.35})
    assert offsets == [0.0, 0.4, 0.15]
    assert M.others_after(["a", "b", "c"], tuple(offsets), "a") == pytest.approx(-0.15)  # (a the last: c 0.15 s before)
    assert M.others_after(["a", "b", "c"], tuple(offsets), "c") == pytest.approx(0.15)  # (a, the last, is c's other)
    assert M.others_after(["a", "b", "c"], tuple(offsets), "b") == pytest.approx(0.4)
    assert M.others_after(["a"], (0.0,), "a") is None and M.others_after(["a", "b"], None, "a") is None
    assert M.others_after(["a", "b"], (0.0, 0.1), "z") is None  # (not a member)
    start = {"t": M.START, "r": 1, "b": [1, "a"], "view": ["a", "b"], "total": 5}
    assert M.parse(start).ready is None  # (an older leader says none)
    assert M.parse({**start, "ready": [0.25, 0]}).ready == (0.25, 0.0)
    for bad in ([-1.0, 0], [float("nan"), 0], ["x", 0], [1e9, 0], [0.0], [0, 0, 0], 0.5):
        with pytest.raises(RemoteProtocolError):
            M.parse({**start, "ready": bad})


def test_parse_normalises_and_drops_unknown_fields():
    m = M.parse({"t": M.PROPOSE, "r": 3, "b": [2, "a"], "view": ["a", "b"], "extra": 1})
    assert m == M.Propose(r=3, b=(2, "a"), view=("a", "b"), end=None)  # (an older peer: no limits)


def test_nack_of_an_older_peer_without_missing_parses():
    m = M.parse({"t": M.NACK, "r": 3, "b": [2, "a"], "reason": "x"})
    assert m == M.Nack(r=3, b=(2, "a"), reason="x", missing=None)


VALID = {
    M.QUERY: {"t": M.QUERY, "b": [1, "a"]},
    M.PROPOSE: {"t": M.PROPOSE, "r": 1, "b": [1, "a"], "view": ["a", "b"], "end": [30, 12.5]},
    M.READY: {"t": M.READY, "r": 1, "b": [1, "a"], "samples": 3, "version": 0, "digest": b"d"},
    M.START: {"t": M.START, "r": 1, "b": [1, "a"], "view": ["a", "b"], "total": 3},
    M.DONE: {"t": M.DONE, "r": 1, "b": [1, "a"], "ok": True, "checksum": None, "void": None},
    M.COMMIT: {"t": M.COMMIT, "r": 1, "b": [1, "a"], "total": 3},
    M.ABORT: {"t": M.ABORT, "r": 1, "b": [1, "a"], "reason": "x", "drop": ["c"]},
    M.NACK: {"t": M.NACK, "r": -1, "b": [1, "a"], "reason": "x", "missing": ["c"]},
    M.GOODBYE: {"t": M.GOODBYE, "end": 30},
    M.END: {"t": M.END, "b": [1, "a"], "version": 30, "digest": b"d", "why": "x"},
    M.STATUS: {"t": M.STATUS, "synced": True, "version": 0, "digest": b"", "round": -1, "members": 1, "min_id": "",
               "window": [[0, b""]], "log": [[0, [1, "a"], True]], "promised": None, "b": None, "re": False,
               "pending": {"r": 0, "b": [1, "a"], "phase": "ring", "ok": False, "view": ["a"], "total": 0}},
}
CLASSES = {M.QUERY: M.Query, M.STATUS: M.Status, M.PROPOSE: M.Propose, M.READY: M.Ready, M.START: M.Start,
           M.DONE: M.Done, M.COMMIT: M.Commit, M.ABORT: M.Abort, M.NACK: M.Nack, M.GOODBYE: M.Goodbye, M.END: M.End}
FULL = {**VALID, M.STATUS: {**VALID[M.STATUS], "at": [3, b"d"], "out": 2, "end": 7, "served": True, "side": ["a", "b"],
                         "masks": [[0, [1, "a"], b"\x03"]]},
        M.ABORT: {**VALID[M.ABORT], "void": M.NOT_FINITE}, M.DONE: {**VALID[M.DONE], "used": b"\x05"},
        M.COMMIT: {**VALID[M.COMMIT], "used": b"\x07", "spread": [2, 5]},
        M.START: {**VALID[M.START], "spread": [2, 5], "ready": [0.05, 0]}}  # every field of each type
OMITTED = {M.STATUS: ("pending", "promised", "b", "at", "out", "end", "served", "side", "masks"), M.PROPOSE: ("end",),
           M.DONE: ("checksum", "void", "used"), M.NACK: ("missing",), M.GOODBYE: ("end",), M.ABORT: ("void",),
           M.COMMIT: ("total", "used", "spread"), M.START: ("spread", "ready")}  # what a leader may leave out


@pytest.mark.parametrize("t", sorted(FULL))
def test_each_type_parses_to_its_frozen_class_with_its_fields(t):
    m = M.parse(FULL[t])
    assert type(m) is CLASSES[t] and m.t == t
    assert {f.name for f in dataclasses.fields(m)} == set(FULL[t]) - {"t"}
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(m, dataclasses.fields(m)[0].name, None)


def test_parsed_fields_are_typed():
    m = M.parse(FULL[M.STATUS])
    assert m.pending == M.Attempt(r=0, b=(1, "a"), phase="ring", ok=False, view=("a",), total=0)
    assert (m.synced, m.version, m.digest, m.round, m.members, m.min_id, m.re) == (True, 0, b"", -1, 1, "", False)
    assert m.window == [(0, b"")] and m.log == [(0, (1, "a"), True)] and m.promised is None and m.b is None
    assert (m.at, m.out, m.end, m.served, m.side) == ((3, b"d"), 2.0, 7, True, ("a", "b")) and type(m.out) is float
    m = M.parse({**FULL[M.STATUS], "promised": [1, "a"], "b": [2, "b"], "min_id": "c"})
    assert (m.promised, m.b, m.min_id) == ((1, "a"), (2, "b"), "c")
    assert M.parse(FULL[M.PROPOSE]) == M.Propose(r=1, b=(1, "a"), view=("a", "b"), end=(30, 12.5))
    assert M.parse(FULL[M.READY]) == M.Ready(r=1, b=(1, "a"), samples=3, version=0, digest=b"d")
    assert M.parse(FULL[M.START]) == M.Start(r=1, b=(1, "a"), view=("a", "b"), total=3, spread=(2, 5), ready=(0.05, 0.0))
    assert M.parse({**VALID[M.DONE], "checksum": b"c"}) == M.Done(r=1, b=(1, "a"), ok=True, checksum=b"c",
                                                                 void=None)
    assert M.parse({**FULL[M.DONE], "ok": False, "void": M.NOT_FINITE}).void == "nonfinite"
    assert M.parse(FULL[M.COMMIT]) == M.Commit(r=1, b=(1, "a"), total=3, used=b"\x07", spread=(2, 5))
    pending = {**FULL[M.STATUS]["pending"], "total": 3, "spread": [2, 5]}  # (a new leader sends it on: ``takeover``)
    assert M.parse({**FULL[M.STATUS], "pending": pending}).pending.spread == (2, 5)
    with pytest.raises(RemoteProtocolError):
        M.parse({**FULL[M.STATUS], "pending": {**pending, "spread": [2, 9]}})
    assert M.parse(FULL[M.DONE]).used == b"\x05"  # (which parameters had a gradient: ``used``)
    for t in (M.DONE, M.COMMIT):  # (a bitmask, bounded)
        for bad in ("x", 3, b"\0" * (MASK_LIMIT + 1)):
            with pytest.raises(RemoteProtocolError):
                M.parse({**FULL[t], "used": bad})
    assert M.parse({**FULL[M.COMMIT], "total": None}).total is None  # (a leader that tells none: START did)
    assert M.parse(FULL[M.ABORT]) == M.Abort(r=1, b=(1, "a"), reason="x", drop=("c",), void="nonfinite")
    assert M.parse(FULL[M.NACK]) == M.Nack(r=-1, b=(1, "a"), reason="x", missing=("c",))
    assert M.parse(FULL[M.GOODBYE]) == M.Goodbye(end=30)
    assert M.parse(FULL[M.END]) == M.End(b=(1, "a"), version=30, digest=b"d", why="x")
    assert M.parse(FULL[M.QUERY]) == M.Query(b=(1, "a"))


@pytest.mark.parametrize("t", sorted(FULL))
def test_a_field_an_older_peer_omits_gets_its_default_and_the_others_are_required(t):
    for name in set(FULL[t]) - {"t"}:
        msg = {k: v for k, v in FULL[t].items() if k != name}
        if name in OMITTED.get(t, ()):
            m = M.parse(msg)
            assert getattr(m, name) is None
            others = {f.name: getattr(m, f.name) for f in dataclasses.fields(m) if f.name != name}
            assert CLASSES[t](**others) == m  # the class's default is parse's
        else:
            with pytest.raises(RemoteProtocolError):
                M.parse(msg)


VALUES = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=4) | st.binary(max_size=4),
                      lambda x: st.lists(x, max_size=3) | st.dictionaries(st.text(max_size=3), x, max_size=3),
                      max_leaves=6)


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(sorted(VALID)), st.data())
def test_parse_accepts_or_raises_remote_protocol_error_only(t, data):
    """h11's fuzzer rule: a valid message with one field replaced parses, or raises the remote-fault error."""
    msg = dict(VALID[t])
    assert M.parse(msg).t == t
    key = data.draw(st.sampled_from(sorted(msg)))
    msg[key] = data.draw(VALUES)
    if key != "pending" and t == M.STATUS and data.draw(st.booleans()):
        msg["pending"] = {**msg["pending"], data.draw(st.sampled_from(sorted(msg["pending"]))): data.draw(VALUES)}
    try:
        M.parse(msg)
    except RemoteProtocolError:
        pass


@pytest.mark.parametrize("msg", [
    None, [], {"t": "nope"}, {"t": M.PROPOSE},
    {"t": M.PROPOSE, "r": -1, "b": [1, "a"], "view": ["a"]},
    {"t": M.PROPOSE, "r": 1, "b": [1, "a"], "view": ["b", "a"]},  # not sorted
    {"t": M.PROPOSE, "r": 1, "b": [1, "a"], "view": ["a", "a"]},
    {"t": M.PROPOSE, "r": 1, "b": [1, "a"], "view": []},
    {"t": M.PROPOSE, "r": 1, "b": [1, "a"], "view": ["p%03d" % i for i in range(M.MAX_VIEW + 1)]},
    {"t": M.PROPOSE, "r": 1, "b": [1, ""], "view": ["a"]},
    {"t": M.PROPOSE, "r": True, "b": [1, "a"], "view": ["a"]},
    {"t": M.STATUS, "synced": True, "version": 0, "digest": b"", "round": -1, "members": 1, "min_id": "",
     "window": [[0, b""]] * 9, "log": [], "pending": None, "promised": None, "b": None, "re": False},
    {"t": M.READY, "r": 1, "b": [1, "a"], "samples": 1.5, "version": 0, "digest": b""},
    {"t": M.DONE, "r": 1, "b": [1, "a"], "ok": 1, "checksum": None},
    {"t": M.DONE, "r": 1, "b": [1, "a"], "ok": False, "checksum": None, "void": "tired"},
    {"t": M.DONE, "r": 1, "b": [1, "a"], "ok": False, "checksum": None, "void": True},
    {"t": M.ABORT, "r": 1, "b": [1, "a"], "reason": "x" * 1000, "drop": []},
    {"t": M.NACK, "r": 1, "b": [1, "a"], "reason": "x", "missing": [1]},
    {"t": M.NACK, "r": 1, "b": [1, "a"], "reason": "x", "missing": "c"},
    {"t": M.NACK, "r": 1, "b": [1, "a"], "reason": "x", "missing": ["p%03d" % i for i in range(M.MAX_VIEW + 1)]},
    {"t": M.STATUS, "synced": True},
])
def test_malformed_messages_raise_remote_protocol_error(msg):
    m = RoundMachine("b")
    with pytest.raises(RemoteProtocolError):
        m.on_message("a", msg, 0.0)
