"""A peer refused for a setting (a wrong secret, another cluster) hears it once, with what to do,
however often it dials again; one that cannot train and whom every peer it knows refuses gives up
(``GroupError``) instead of dialing forever. Loopback only."""

import logging

import pytest
import torch
import torch.nn.functional as F
from helpers import ports, until

from p2ptrain import AsyncPeer, GroupError
from p2ptrain.cluster import vetting as vetting_module
from p2ptrain.net import auth, mesh as mesh_module
from p2ptrain.net.mesh import Mesh

pytestmark = pytest.mark.timeout(30)


def test_advice_names_the_setting_to_fix():
    assert "--secret" in auth.advice(auth.REASON_SECRET)
    assert "or none to all" in auth.advice(auth.REASON_SECRET_MODE)
    assert "--cluster" in auth.advice(auth.REASON_CLUSTER)
    assert auth.advice(auth.REASON_MALFORMED) is None and auth.advice(auth.REASON_TIMEOUT) is None
    assert auth.advice(f"refused by peer: {auth.REASON_SECRET}") is None  # a reason, not a message


async def test_a_wrong_secret_is_said_once_on_each_side_however_often_it_dials(monkeypatch, caplog):
    monkeypatch.setattr(mesh_module, "RETRY_AFTER", 0.05)  # many dials in a second (2 s in real life)
    caplog.set_level(logging.DEBUG, logger="p2ptrain.net")
    ours = Mesh(cluster="lab", peer_id="a", secret=b"wrong", host="127.0.0.1")
    theirs = Mesh(cluster="lab", peer_id="b", secret=b"right", host="127.0.0.1")
    await ours.start()
    await theirs.start()
    try:
        def dials():
            ours.propose("127.0.0.1", theirs.port)
            return len([r for r in caplog.records if "refused this peer again" in r.getMessage()]) >= 5

        await until(dials, timeout=10)
        assert ours.refusing() is not None and ours.refusing()[1] == [auth.REASON_SECRET]
        warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        dialer = [m for m in warned if "refused this peer" in m]
        listener = [m for m in warned if "refused connection from" in m]
        assert len(dialer) == 1 and "give every peer the same --secret" in dialer[0], warned
        assert len(listener) == 1 and "give every peer the same --secret" in listener[0], warned
    finally:
        await ours.close()
        await theirs.close()


def make():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


async def test_a_peer_that_cannot_train_and_that_everyone_refuses_gives_up(monkeypatch):
    monkeypatch.setattr(mesh_module, "RETRY_AFTER", 0.2)
    monkeypatch.setattr(vetting_module, "REFUSED_GIVE_UP", 1.0)  # (30 s in real life)
    a_port, b_port = ports(2)
    addrs = [f"127.0.0.1:{a_port}", f"127.0.0.1:{b_port}"]
    cluster = AsyncPeer(*make(), listen=addrs[0], peers=addrs, discovery=False, secret="right")
    lost = AsyncPeer(*make(), listen=addrs[1], peers=addrs, discovery=False, secret="wrong", min_peers=2,
                     step_timeout=20)
    async with cluster, lost:
        x = torch.randn(8, 4)
        F.cross_entropy(lost.model(x), torch.zeros(8, dtype=torch.long)).backward()
        with pytest.raises(GroupError, match=rf"127.0.0.1:{a_port}.*give every peer the same --secret"):
            await lost.step(batch_size=8)
        for _ in range(3):  # the other can train alone (min_peers 1): it goes on, refusing
            F.cross_entropy(cluster.model(x), torch.zeros(8, dtype=torch.long)).backward()
            await cluster.step(batch_size=8)
        assert cluster.version == 3 and cluster.cluster.failure is None
