"""Snapshots travel without pickle and come back exactly; a bad one is the sender's fault."""

import struct

import msgpack
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from p2ptrain.cluster import snapshot
from p2ptrain.errors import RemoteProtocolError

pytestmark = pytest.mark.timeout(60)


def trained(opt_cls, **kw):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = opt_cls(model.parameters(), **kw)
    for _ in range(2):
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
    return model, opt


def roundtrip(state):
    return snapshot.unpack(b"".join(bytes(b) for b in snapshot.pack(state)))


@pytest.mark.parametrize("opt_cls,kw", [(torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
                                        (torch.optim.Adam, {"lr": 1e-3, "betas": (0.8, 0.9)})])
def test_model_and_optimizer_come_back_bit_identical_and_keep_training_the_same(opt_cls, kw):
    model, opt = trained(opt_cls, **kw)
    back = roundtrip({"model": dict(model.named_parameters()), "optimizer": opt.state_dict(), "version": 7})
    assert back["version"] == 7
    twin, twin_opt = trained(opt_cls, **kw)
    with torch.no_grad():
        for p in twin.parameters():
            p.add_(1.0)  # make sure the load is what makes them equal
        for name, p in twin.named_parameters():
            p.copy_(back["model"][name])
    twin_opt.load_state_dict(back["optimizer"])
    assert twin_opt.state_dict()["param_groups"] == opt.state_dict()["param_groups"]  # tuples stay tuples
    x = torch.randn(5, 4)
    for m, o in ((model, opt), (twin, twin_opt)):
        m(x).sum().backward()
        o.step()
    assert snapshot.tensors_checksum(model.named_parameters()) == snapshot.tensors_checksum(twin.named_parameters())


def test_every_dtype_and_odd_shapes():
    state = {name: (torch.arange(6) % 2).to(dtype).reshape(2, 3) for name, dtype in snapshot.DTYPES.items()}
    state["scalar"] = torch.tensor(3.5)
    state["empty"] = torch.empty(0, 4)
    state[5] = [None, True, 1.5, "s", b"\x00", (1, 2)]
    back = roundtrip(state)
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            assert back[key].dtype == value.dtype and back[key].shape == value.shape and torch.equal(back[key], value)
    assert back[5] == [None, True, 1.5, "s", b"\x00", (1, 2)]


def test_what_cannot_travel_is_refused_at_the_sender():
    for bad in ({"x": object()}, {(1, 2): 3}, {"c": torch.zeros(2, dtype=torch.complex64)}):
        with pytest.raises(ValueError):
            snapshot.pack(bad)


def framed(meta: dict, data: bytes = b"") -> bytes:
    body = msgpack.packb(meta, use_bin_type=True)
    return struct.pack("<I", len(body)) + body + data


@pytest.mark.parametrize("payload", [
    b"", b"\x01\x00", struct.pack("<I", 1 << 30) + b"xx",
    framed({"state": 1}),
    framed({"state": {"__tensor__": 0}, "tensors": []}),
    framed({"state": {"__tensor__": 0}, "tensors": [["float32", [4], 16]]}, b"\0" * 8),  # data past the end
    framed({"state": {"__tensor__": 0}, "tensors": [["float32", [5], 16]]}, b"\0" * 16),  # shape vs bytes
    framed({"state": {"__tensor__": 0}, "tensors": [["object", [1], 8]]}, b"\0" * 8),
    framed({"state": {"__tensor__": 0}, "tensors": [["float32", [-1], 4]]}, b"\0" * 4),
    framed({"state": 1, "tensors": []}, b"extra"),
])
def test_malformed_snapshots_raise_remote_protocol_error(payload):
    with pytest.raises(RemoteProtocolError):
        snapshot.unpack(payload)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300))
def test_random_bytes_never_raise_anything_else(data):
    try:
        snapshot.unpack(data)
    except RemoteProtocolError:
        pass
