"""A joiner's state download (``Cluster._fetch_state``): a member that refuses, say because it is
not synced itself while the joiner's table still says it is, is not asked forever; the next try
goes to another synced member, or, where the donor has no link any more (killed) and the table
shows no other synced member, to any linked peer. (Found by bench/soak.py: two peers asked the same refusing member
once a second for minutes and never rejoined.)"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from p2ptrain.cluster import cluster
from p2ptrain.errors import LinkError


def _joiner(refusing: set[str], members: list[str]):
    asked, posted = [], []

    class Transfer:
        async def fetch(self, donor):
            asked.append(donor)
            if donor in refusing:
                raise LinkError(f"{donor} refused to send its state: not synced itself; ask another member")
            return {"model": {}}, None

    fake = SimpleNamespace(transfer=Transfer(), peer_id="me", _post=lambda *a: posted.append(a),
                           machine=SimpleNamespace(table=SimpleNamespace(live_synced=lambda: [*members, "me"])),
                           mesh=SimpleNamespace(peers=dict.fromkeys(members)))
    return fake, asked, posted


async def test_a_refusing_donor_is_not_asked_again_while_another_member_is_synced(monkeypatch):
    monkeypatch.setattr(cluster, "RETRY_FETCH", 0.0)
    fake, asked, posted = _joiner({"a"}, ["a", "b", "c"])
    await asyncio.wait_for(cluster.Cluster._fetch_state(fake, "a"), 5)
    assert asked[0] == "a" and asked[1] in ("b", "c") and len(asked) == 2
    assert posted and posted[0][0] == "restored" and posted[0][3] == asked[1]


async def test_the_only_member_is_asked_again(monkeypatch):
    monkeypatch.setattr(cluster, "RETRY_FETCH", 0.0)
    fake, asked, posted = _joiner(set(), ["a"])
    calls = iter([LinkError("a sent no state for 20 s"), None])

    async def fetch(donor):
        asked.append(donor)
        exc = next(calls)
        if exc:
            raise exc
        return {"model": {}}, None

    fake.transfer.fetch = fetch
    await asyncio.wait_for(cluster.Cluster._fetch_state(fake, "a"), 5)
    assert asked == ["a", "a"] and posted[0][3] == "a"


async def test_a_donor_gone_is_not_asked_for_the_rest_of_the_run_when_another_peer_is_linked(monkeypatch):
    """The donor was killed: no link to it, and our table (lagging) shows no other synced member.
    bench/soak.py saw a peer ask the dead donor 757 times, for the last 13 minutes of its run."""
    monkeypatch.setattr(cluster, "RETRY_FETCH", 0.0)
    fake, asked, posted = _joiner(set(), [])
    fake.machine.table.live_synced = lambda: ["dead", "me"]
    fake.mesh.peers = {"b": None}

    async def fetch(donor):
        asked.append(donor)
        if donor not in fake.mesh.peers:
            raise LinkError(f"cannot ask {donor} for its state: no link")
        return {"model": {}}, None

    fake.transfer.fetch = fetch
    await asyncio.wait_for(cluster.Cluster._fetch_state(fake, "dead"), 5)
    assert asked == ["dead", "b"] and posted[0][3] == "b"
