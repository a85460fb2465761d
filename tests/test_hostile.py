"""Hostile insiders: peers that know the secret and misbehave. The others refuse what they send
(the remote-fault error, one log line naming them) or leave it out, keep training, and no NaN or
inf reaches their parameters. The parsers' side of this is ``test_fuzz``; chunks of the wrong
size or of another call are ``test_allreduce``'s (a raw chunk past a chunk's size, a chunk of a
later call) and ``test_group``'s (a corrupt compressed chunk names its peer)."""

from __future__ import annotations

import asyncio
import logging

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from roundnet import Net
from test_trainer_staleness import close_all, label, make_adam, open_peers, run_threads

from p2ptrain.cluster import roundmsg as M
from p2ptrain.cluster import snapshot, statesync
from p2ptrain.codecs import parse_codec
from p2ptrain.codecs._codec import check_received
from p2ptrain.errors import CodecError, RemoteProtocolError

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_peer_whose_gradient_holds_nan_or_inf_under_none_spoils_no_parameter(caplog, bad):
    """With ``none`` a NaN or inf gradient (an overflow, or a peer that sends one on purpose)
    was averaged into every replica: both ended on NaN parameters, and said nothing. Now its
    round is left out on every member, as a lossy codec's is, and training goes on."""
    peers = open_peers([make_adam] * 2, staleness=0, compression="none", max_rounds=8)
    spoiled = []

    def loop(r):
        g = torch.Generator().manual_seed(100 + r)
        while not peers[r].finished:
            x = torch.randn(32, 16, generator=g)
            F.cross_entropy(peers[r].model(x), label(x)).backward()
            if r == 0 and peers[r].version >= 3 and not spoiled:
                spoiled.append(peers[r].version)
                peers[r].model[0].bias.grad[0] = bad
            peers[r].step(batch_size=32)

    try:
        with caplog.at_level(logging.INFO):
            run_threads([lambda r=r: loop(r) for r in range(2)])
    finally:
        close_all(peers)
    assert spoiled and [p.version for p in peers] == [8, 8]
    assert all(torch.isfinite(q).all() for p in peers for q in p.model.parameters())
    for a, b in zip(peers[0].model.parameters(), peers[1].model.parameters()):
        assert torch.equal(a, b)
    assert peers[0].dropped == peers[1].dropped == 32  # (that round's batches, on both)
    said = [r.getMessage() for r in caplog.records]
    assert any("aborted: " in m and "NaN or inf" in m for m in said), said


def test_a_final_sum_that_comes_with_nan_or_inf_is_the_senders_fault():
    """A segment's owner that sends its final sum with NaN or inf (its own encode would have
    refused them: it sends them on purpose) fails the call as the sender's fault: no peer's
    parameters take them (``AllReduce._absorb`` checks what an all-gather hop brings)."""
    values = np.ones(1000, np.float32)
    check_received(values)
    for bad in (np.nan, np.inf, -np.inf):
        values[500] = bad
        with pytest.raises(CodecError, match="NaN or inf"):
            check_received(values)
    spoiled = np.full(1000, 2.0, np.float32)
    spoiled[7] = np.nan
    payload = bytearray(spoiled.tobytes())
    out = np.empty(1000, np.float32)
    parse_codec("none").decode({}, payload, out)  # (the codec copies what came ...)
    with pytest.raises(CodecError):
        check_received(out)  # (... and the all-gather refuses it)


def fake_transfer():
    fingerprint = [("0.weight", (4, 3), "float32", True), ("0.bias", (4,), "float32", True)]
    return statesync.StateTransfer(None, fingerprint, on_ask=None, on_foreign=lambda p, d: None)


def test_a_snapshot_that_lies_about_its_parameters_is_not_loaded():
    """A member's snapshot whose checksum is right for what it sends, but what it sends holds
    NaN (in a parameter, or in the optimizer's moments): the joiner refuses it, naming where."""
    transfer = fake_transfer()
    model = {"0.weight": torch.ones(4, 3), "0.bias": torch.zeros(4)}
    good = {"model": model, "optimizer": {"state": {0: {"exp_avg": torch.zeros(4, 3)}}}}
    decoded = snapshot.unpack(b"".join(bytes(b) for b in snapshot.pack(good)))
    transfer.check(decoded, snapshot.tensors_checksum(decoded["model"].items()), "z")
    poisoned_param = {**good, "model": {**model, "0.bias": torch.tensor([0.0, float("nan"), 0.0, 0.0])}}
    poisoned_state = {**good, "optimizer": {"state": {0: {"exp_avg": torch.full((4, 3), float("inf"))}}}}
    for state, where in ((poisoned_param, "model.0.bias"), (poisoned_state, "optimizer.state.0.exp_avg")):
        decoded = snapshot.unpack(b"".join(bytes(b) for b in snapshot.pack(state)))
        with pytest.raises(RemoteProtocolError, match=f"the snapshot from z holds NaN or inf \\({where}\\)"):
            transfer.check(decoded, snapshot.tensors_checksum(decoded["model"].items()), "z")
    with pytest.raises(RemoteProtocolError, match="fails its parameter checksum"):  # (and one that lies outright)
        transfer.check(snapshot.unpack(b"".join(bytes(b) for b in snapshot.pack(good))), "0" * 32, "z")


def test_a_flood_of_stale_round_messages_stops_no_round_and_fills_no_log():
    """b, a member, sends a 20,000 messages of rounds long over (proposals, starts, commits and
    aborts under old ballots, NACKs, DONEs): a counts them as stale and goes on committing at
    the same pace, with no log line per message."""
    net = Net("abc")
    net.found()
    net.run(1.0)
    a = net.m["a"]
    before_version, before_logs = a.version, len(net.of("a", M.Log))
    net.run(1.0)
    pace = a.version - before_version
    old_b = [0, "b"]
    flood = [{"t": M.PROPOSE, "r": 1, "b": old_b, "view": ["a", "b"]},
             {"t": M.START, "r": 1, "b": old_b, "view": ["a", "b"], "total": 5},
             {"t": M.COMMIT, "r": 1, "b": old_b, "total": 5},
             {"t": M.ABORT, "r": 2, "b": old_b, "reason": "x" * 200, "drop": ["c"]},
             {"t": M.NACK, "r": 1, "b": old_b, "reason": "no"},
             {"t": M.DONE, "r": 1, "b": old_b, "ok": True, "checksum": None}]
    logs, version = len(net.of("a", M.Log)), a.version
    for k in range(20_000):
        if k % 2000 == 0:
            net.tick()
        try:
            net.handle("a", a.on_message("b", flood[k % len(flood)], net.clock("a")))
        except RemoteProtocolError:  # (the host would drop the link: the test counts it)
            pytest.fail(f"a stale message was taken for a malformed one: {flood[k % len(flood)]}")
    net.settle()
    net.run(1.0)
    assert a.version - version >= pace // 2, (a.version - version, pace)  # (rounds went on)
    assert len(net.of("a", M.Log)) - logs < 50, [x.text for x in net.of("a", M.Log)[logs:]][:10]
    assert a.counters["stale"] > 0
    assert len(net.of("a", M.Log)) >= before_logs
    net.check_safety()


async def test_a_flood_of_malformed_round_messages_is_one_line_and_the_rounds_go_on(caplog):
    """b, linked, sends 500 malformed round messages: a drops each, says so in one warning
    naming b (the next, a minute later, counts the rest), and their rounds go on. It was a
    warning a message."""
    from helpers import until
    from test_cluster import linked

    from p2ptrain.cluster.rounds import RoundConfig

    trainers, clusters = await linked(["a", "b"], RoundConfig(min_peers=2))
    try:
        await until(lambda: all(len(t.applied) >= 3 for t in trainers), timeout=20)
        with caplog.at_level(logging.WARNING, logger="p2ptrain.cluster.cluster"):
            for _ in range(500):
                clusters[1].mesh.post("a", {"t": M.PROPOSE, "r": "not a round", "b": [1, "b"], "view": ["a", "b"]})
            done = len(trainers[0].applied)
            await until(lambda: len(trainers[0].applied) >= done + 3, timeout=30)
        broke = [r.getMessage() for r in caplog.records if "broke the round protocol" in r.getMessage()]
        assert len(broke) == 1 and broke[0].startswith("peer b broke the round protocol: malformed"), broke
    finally:
        for c in clusters:
            await c.close()


def test_the_lines_about_a_peers_refused_messages_come_once_a_minute_with_the_count():
    from p2ptrain.cluster.faultlog import FaultLog

    faults = FaultLog(every=60.0)
    assert faults.refused("b", 0.0) == 0  # (its first: said at once)
    assert [faults.refused("b", t) for t in (1.0, 2.0, 59.0)] == [None] * 3
    assert faults.refused("c", 3.0) == 0  # (another peer: its own line)
    assert faults.refused("b", 60.5) == 3 and faults.refused("b", 61.0) is None
