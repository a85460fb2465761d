"""State transfer: a joiner loads the members' state over the mesh and trains on with them;
a peer of another model is refused, naming what differs."""

import asyncio

import pytest
import torch
from helpers import until

from p2ptrain.cluster import statesync
from p2ptrain.cluster.cluster import Cluster
from p2ptrain.errors import FingerprintError, LinkError, RemoteProtocolError
from p2ptrain.cluster.rounds import RoundConfig

pytestmark = pytest.mark.timeout(60)
LENGTH = 3000
FP = [("w", (LENGTH,), "float32")]


class TensorTrainer:
    """One parameter vector; each round contributes (rank+1) and applies the mean."""

    def __init__(self, rank, start=0.0):
        self.rank, self.w, self.version = rank, torch.full((LENGTH,), start), 0
        self.restored, self.busy = [], False
        self.seen = {}  # version -> parameters then

    def take(self, members=1, alone=False):
        return torch.full((LENGTH,), float(self.rank + 1)).numpy(), 1

    def used(self, contribution):  # (every parameter had a gradient)
        return None

    def apply(self, summed, total, used=None, spread=None):
        self.w += torch.from_numpy(summed) / total
        self.version += 1
        self.seen[self.version] = self.w.clone()

    def put_back(self, contribution, samples, not_finite=False):
        pass

    def snapshot(self):
        return None if self.busy else {"model": {"w": self.w.clone()}, "optimizer": {"state": {}}, "version": self.version}

    def restore(self, state):
        self.w, self.version = state["model"]["w"].clone(), state["version"]
        self.restored.append(state["version"])
        self.seen[self.version] = self.w.clone()


async def start(ids, trainers, fingerprints, checksums, min_peers=1, join_hold=10.0):
    clusters = [Cluster(peer_id=pid, trainer=t, checksum=c, secret=b"k", fingerprint=fp,
                        config=RoundConfig(min_peers=min_peers, join_hold=join_hold))
                for pid, t, fp, c in zip(ids, trainers, fingerprints, checksums)]
    for c in clusters:
        await c.__aenter__()
    return clusters


def link(clusters):
    for c in clusters:
        for d in clusters:
            c.propose("127.0.0.1", d.port)


async def test_a_joiner_loads_the_state_and_then_applies_the_same_rounds():
    trainers = [TensorTrainer(0), TensorTrainer(1), TensorTrainer(2, start=5.0)]
    founders = await start(["a", "b"], trainers[:2], [FP, FP], [b"same", b"same"], min_peers=2)
    joiner = None
    try:
        link(founders)
        await until(lambda: all(t.version >= 3 for t in trainers[:2]), timeout=20)
        trainers[0].busy = True  # a member whose trainer is between rounds makes the joiner wait, not fail
        asyncio.get_running_loop().call_later(0.5, setattr, trainers[0], "busy", False)
        # (min_peers=2 as the founders: alone before its links form, it must not train rounds of its own)
        (joiner,) = await start(["c"], trainers[2:], [FP], [b"other-start"], min_peers=2)
        link([*founders, joiner])
        await until(lambda: trainers[2].restored and 2 in {len(c.machine.table.live_synced()) - 1 for c in founders}
                    and trainers[2].version > trainers[2].restored[0] + 2, timeout=30)
        joiner.check()
        # from the snapshot on, the joiner holds the founders' parameters at every version
        joined = trainers[2].restored[0]
        assert joined >= 3
        # and the founders' History before it (a split older than the join is still told apart)
        older = joiner.machine.history.at(joined - 2)
        assert older is not None and older == founders[0].machine.history.at(joined - 2)
        for v, w in trainers[2].seen.items():
            assert v >= joined and torch.equal(w, trainers[0].seen[v]) and torch.equal(w, trainers[1].seen[v])
        # and the member that sent it the state learned how fast its link is (a view with it is timed so)
        assert any(f.machine._rates.get("c", 0) > 0 for f in founders)
        # and its samples count: rounds after the join sum three contributions (1 + 2 + 3)
        last = max(trainers[2].seen)
        assert torch.allclose(trainers[0].seen[last] - trainers[0].seen[last - 1], torch.full((LENGTH,), 2.0))
    finally:
        for c in [*founders, *([joiner] if joiner else [])]:
            await c.close()


async def test_a_download_longer_than_the_join_hold_still_joins(monkeypatch):
    # A big model over Wi-Fi: the snapshot takes longer to send than ``join_hold``. The leader
    # holds the boundary while it sends, so the joiner is not behind once it has loaded (it
    # used to load again, and again, never catching up).
    send_parts = statesync.StateTransfer._send_parts

    async def slow(self, peer, head, blob, on_sent):
        await asyncio.sleep(0.8)
        await send_parts(self, peer, head, blob, on_sent)

    monkeypatch.setattr(statesync.StateTransfer, "_send_parts", slow)
    trainers = [TensorTrainer(0), TensorTrainer(1), TensorTrainer(2, start=5.0)]
    founders = await start(["a", "b"], trainers[:2], [FP, FP], [b"same", b"same"], min_peers=2, join_hold=0.2)
    joiner = None
    try:
        link(founders)
        await until(lambda: all(t.version >= 3 for t in trainers[:2]), timeout=20)
        (joiner,) = await start(["c"], trainers[2:], [FP], [b"other-start"], min_peers=2, join_hold=0.2)
        link([*founders, joiner])
        await until(lambda: trainers[2].restored and trainers[2].version > trainers[2].restored[-1] + 2, timeout=20)
        joiner.check()
        # (a first load may come from b, which does not lead, if c's link to a forms last)
        assert len(trainers[2].restored) <= 2, trainers[2].restored
    finally:
        for c in [*founders, *([joiner] if joiner else [])]:
            await c.close()


async def test_a_fresh_peer_of_another_model_stops_naming_the_difference_and_the_members_go_on():
    other = [("w", (LENGTH + 1,), "float32")]
    trainers = [TensorTrainer(0), TensorTrainer(1), TensorTrainer(2)]
    clusters = await start(["a", "b", "c"], trainers, [FP, FP, other], [b"s", b"s", b"s"], min_peers=2)
    try:
        link(clusters)
        await until(lambda: clusters[2].failure is not None, timeout=20)
        with pytest.raises(FingerprintError, match=r"parameter .w. has shape \(3001,\) here and \(3000,\) on the other peer"):
            clusters[2].check()
        before = trainers[0].version
        await until(lambda: trainers[0].version >= before + 3, timeout=20)
        assert clusters[0].failure is None and clusters[1].failure is None
        assert "c" not in clusters[0].machine.table.live_synced()
    finally:
        for c in clusters:
            await c.close()


async def test_a_fresh_peer_that_meets_the_odd_one_out_before_its_partner_goes_on_with_the_partner():
    """Three peers started together: ``a`` meets ``c`` (another model) first, then ``b``. Only
    ``c`` stops; ``a`` waited for a peer of its own model instead of blaming itself."""
    other = [("w", (LENGTH + 1,), "float32")]
    trainers = [TensorTrainer(0), TensorTrainer(1), TensorTrainer(2)]
    clusters = await start(["a", "b", "c"], trainers, [FP, FP, other], [b"s", b"s", b"s"], min_peers=2)
    a, b, c = clusters
    try:
        link([a, c])
        await until(lambda: "c" in a.vetting.foreign, timeout=10)  # a, fresh, has met c
        await asyncio.sleep(0.5)  # (c's fingerprint told and heard)
        assert a.failure is None
        link([a, b])
        await until(lambda: c.failure is not None, timeout=20)
        with pytest.raises(FingerprintError, match="start every peer with the same model"):
            c.check()
        await until(lambda: trainers[0].version >= 3 and trainers[1].version >= 3, timeout=20)
        assert a.failure is None and b.failure is None
    finally:
        for x in clusters:
            await x.close()


def part(i, n, size, payload=b""):
    return {"t": "state", "k": "part", "id": 1, "i": i, "n": n, "size": size, "checksum": "x",
            "sync": [3, b"d" * 16, 4, 1]}, memoryview(payload)


def test_assembly_takes_parts_in_order_and_checks_every_length():
    size = statesync.PART_BYTES + 10
    head, _ = part(0, 2, size)
    a = statesync.Assembly(head, limit=1 << 30)
    assert a.sync.version == 3 and a.sync.round == 4
    assert not a.add(*part(0, 2, size, b"x" * statesync.PART_BYTES))
    with pytest.raises(RemoteProtocolError):
        a.add(*part(0, 2, size, b"x" * 10))  # a repeated part
    with pytest.raises(RemoteProtocolError):
        statesync.Assembly(part(0, 2, size)[0], limit=100)  # over the limit: refused before allocating
    with pytest.raises(RemoteProtocolError):
        statesync.Assembly(part(0, 3, size)[0], limit=1 << 30)  # a part count that does not match the size
    b = statesync.Assembly(head, limit=1 << 30)
    b.add(*part(0, 2, size, b"x" * statesync.PART_BYTES))
    with pytest.raises(RemoteProtocolError):
        b.add(*part(1, 2, size, b"y" * 9))  # short last part
    assert b.add(*part(1, 2, size, b"y" * 10))
    assert bytes(b.buffer[-11:]) == b"x" + b"y" * 10


class FakeMesh:
    """Two StateTransfers joined without sockets: a frame sent is the other one's ``on_frame``."""

    def __init__(self, me):
        self.me, self.other = me, None

    async def send(self, peer, header, payload=(), timeout=None):
        data = b"".join(bytes(p) for p in payload)
        self.other.transfer.on_frame(self.me, statesync.wire.Frame(header, memoryview(data)))


def joined(fp_asker, fp_member, on_ask):
    asker_mesh, member_mesh = FakeMesh("asker"), FakeMesh("member")
    asker = statesync.StateTransfer(asker_mesh, fp_asker, on_ask=None, on_foreign=lambda p, d: None)
    member = statesync.StateTransfer(member_mesh, fp_member, on_ask=on_ask, on_foreign=lambda p, d: None)
    asker_mesh.other, member_mesh.other = member_mesh, asker_mesh
    asker_mesh.transfer, member_mesh.transfer = asker, member
    return asker, member


async def test_a_refusal_for_another_model_is_told_apart_by_its_cause_not_its_words():
    other = [("w", (LENGTH + 1,), "float32")]
    asker, member = joined(other, FP, on_ask=lambda *a: pytest.fail("a peer of another model is served"))
    try:
        told = (r"peer member trains another model: another size: 3,001 parameters here, 3,000 on the other "
                r"peer; parameter .w. has shape \(3001,\) here and \(3000,\)")  # (in the asker's words)
        with pytest.raises(FingerprintError, match=told):
            await asker.fetch("member")
    finally:
        await member.close()
        await asker.close()


async def test_any_other_refusal_is_a_link_error_whatever_its_words():
    asker, member = None, None

    def on_ask(peer, ask_id, parameters_only):
        member.refuse(peer, ask_id, "another model, it says, but no cause: not synced itself")

    asker, member = joined(FP, FP, on_ask)
    try:
        with pytest.raises(LinkError, match="refused to send its state: another model, it says"):
            await asker.fetch("member")
    finally:
        await member.close()
        await asker.close()


async def test_what_an_event_posts_is_in_the_socket_before_the_next_event_is_handled():
    """The actor handles events back to back while they wait in its queue, and ``Mesh.post``
    sends from a task: without a yield between events, a leader's COMMIT waited in its outbox
    while it led the next round, and a lid closed then (SIGSTOP) left the other peers without a
    round the leader had applied: its chain and theirs split (seen in CI)."""
    from p2ptrain.cluster import roundmsg

    a, b = await start(["a", "b"], [TensorTrainer(0), TensorTrainer(1)], [FP, FP], [b"same", b"same"], min_peers=2)
    try:
        link([a, b])
        await until(lambda: "b" in a.mesh.peers and "a" in b.mesh.peers)
        waiting, on_tick = [], a.machine.on_tick

        def tick(now, moved):  # (the first posts a STATUS to b; each says what still waits for b)
            waiting.append(len(a.mesh._outbox.get("b", ())))
            return on_tick(now, moved) + ([roundmsg.Send("b", a.machine.lineage.status())] if len(waiting) == 1 else [])

        a.machine.on_tick = tick
        a._post("tick")
        a._post("tick")  # (both queued: handled one after the other)
        await until(lambda: len(waiting) >= 2)
        assert waiting[:2] == [0, 0]  # the STATUS was sent before the second event
    finally:
        for c in (a, b):
            await c.close()
