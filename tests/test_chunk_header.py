"""A ring chunk's header, pure: what the sender writes is what the receiver accepts, and every
other header is refused with the error that names its cause."""

from __future__ import annotations

import pytest

from p2ptrain.collective.chunk_header import check_chunk_header, chunk_header
from p2ptrain.collective.ring import RingPlan
from p2ptrain.errors import GroupError, RemoteProtocolError
from p2ptrain.net import wire

T = RingPlan(rank=0, size=2, length=10_000, chunk_elems=1000).recvs[3]


def check(h: dict, spec: str = "int8", lossy: bool = True):
    return check_chunk_header(h, "b", 7, T, 10_000, spec, lossy)


@pytest.mark.parametrize("raw", [False, True])
def test_what_the_sender_writes_the_receiver_accepts(raw):
    assert check(chunk_header(7, T, 10_000, "int8", {"z": False}, raw)) == ({"z": False}, raw)


@pytest.mark.parametrize("change,error,says", [
    ({"n": 9_999}, GroupError, "b allreduces 9999 values and this peer 10000"),
    ({"z": "topk:0.01"}, GroupError, "b uses compression 'topk:0.01' and this peer 'int8'"),
    ({"op": 8}, RemoteProtocolError, "peers out of step"),
    ({"g": T.g + 1}, RemoteProtocolError, "peers out of step"),
    ({"c": T.chunk + 1}, RemoteProtocolError, "peers out of step"),
    ({"p": None}, RemoteProtocolError, "b sent a chunk without codec parameters"),
    ({"t": "ping"}, RemoteProtocolError, "b sent a 'ping' frame in the middle of an allreduce"),
    ({"raw": "yes"}, RemoteProtocolError, "b sent a chunk marked raw='yes'"),
    ({"raw": 1}, RemoteProtocolError, "b sent a chunk marked raw=1"),
])
def test_a_header_that_differs_is_refused_naming_the_peer_and_the_cause(change, error, says):
    with pytest.raises(error, match=says.replace("(", r"\(").replace(")", r"\)")):
        check({**chunk_header(7, T, 10_000, "int8", {"z": False}, False), **change})


def test_a_raw_mark_from_a_codec_that_never_sends_raw_is_refused():
    with pytest.raises(RemoteProtocolError, match="b sent a chunk marked raw=True, which 'none' never sends"):
        check(chunk_header(7, T, 10_000, "none", {}, True), spec="none", lossy=False)


def test_a_peer_that_closed_the_link_says_why():
    with pytest.raises(GroupError, match="b closed the link"):
        check({"t": wire.REJECT, "why": "another model"})
