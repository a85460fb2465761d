"""The parsers ``fuzz.py`` runs, each as a ``Target``: valid samples of its input and a function
that feeds it one input (the network's path: frame bytes, or a frame header's msgpack, decoded
the way a link decodes them). The list is ``tests/test_fuzz.py``'s: the frame decoder, the
handshake (both ends, with and without a secret), beacons, round messages (parsed, then handled
by a round machine), ring chunk headers, state-transfer frames, keepalives, codec payloads
(decode and decode_add), snapshots, parameter sketches.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Callable

import msgpack
import numpy as np

from p2ptrain.errors import GroupError, RemoteProtocolError
from p2ptrain.net import wire


@dataclass
class Target:
    """A parser: valid samples of its input, and ``run(data)``, which feeds it one input and raises
    only ``allowed`` types (or a finding: an assertion about limits, any other exception)."""

    name: str
    samples: list[bytes]
    run: Callable[[bytes], None]
    allowed: tuple = (RemoteProtocolError,)
    structured: bool = False  # the samples are msgpack: half the edits are ``mutate_structure``'s


def _frames(*frames) -> bytes:
    return b"".join(wire.frame_bytes(h, p) for h, p in frames)


# -- the targets ---------------------------------------------------------------------------------
def frame_target() -> Target:
    limit = 1 << 12

    def allocate(header, size):
        assert 0 < size <= limit, f"allocated {size} bytes past the limit {limit}"
        return memoryview(bytearray(size))

    def run(data):
        dec = wire.FrameDecoder(max_payload=limit, allocate=allocate)
        cut = len(data) // 3
        dec.feed(data[:cut])
        dec.feed(data[cut:])
        pending = wire.FrameDecoder(max_payload=limit, allocate=allocate, admitted=False)
        pending.feed(data)  # (before admission: held at a payload's prefix, nothing allocated)

    samples = [_frames(({"t": wire.CHUNK, "op": 3, "g": 1, "c": 0, "n": 100, "z": "int8", "p": {"s": 1}}, b"x" * 300),
                       ({"t": wire.PING, "at": [["10.0.0.2", 7000]]}, b"")),
               _frames(({"t": wire.STATE, "k": "part", "id": 1, "i": 0, "n": 1}, b"\0" * 64)),
               _frames(({"t": "propose", "r": 3, "b": [1, "a"], "view": ["a", "b"]}, b""))]
    return Target("frame", samples, run)


def handshake_end(pid: str, secret, info: dict):
    """A handshake of peer ``pid`` ("d" the dialer, "l" the listener) with a fixed nonce."""
    from p2ptrain.net import auth

    nonce = (b"D" if pid == "d" else b"L") * auth.NONCE_BYTES
    return auth.Handshake(cluster="lab", peer_id=pid, secret=secret, info=info, nonce=nonce)


def honest_transcript(secret, info: dict):
    """What an honest dialer sends to the listener, and the listener to it (both end admitted)."""
    d, lst = handshake_end("d", secret, info), handshake_end("l", secret, info)
    d_hello, l_hello = d.start(dialer=True), lst.start(dialer=False)
    d_proof = d.receive(l_hello[0])
    lst.receive(d_hello[0])
    l_proof = lst.receive(d_proof[0])
    welcome = d.receive(l_proof[0])
    assert d.done and lst.receive(welcome[0]) == [] and lst.done
    return d_hello + d_proof + welcome, l_hello + l_proof


def handshake_targets() -> list[Target]:
    from p2ptrain.cluster import settings as shared_settings
    from p2ptrain.net import auth

    ours = shared_settings.shared(compression="int8", staleness=1)
    info = {"port": 7000, "settings": ours, "model": b"m" * 16}

    def end(pid, secret):
        return handshake_end(pid, secret, info)

    def transcript(secret):
        return honest_transcript(secret, info)

    def make(name, secret, dialer):
        to_listener, to_dialer = transcript(secret)
        honest = to_dialer if dialer else to_listener
        sample = _frames(*[(h, b"") for h in honest])

        def run(data):
            hs = end("d" if dialer else "l", secret)
            hs.start(dialer=dialer)
            got = []
            for f in wire.FrameDecoder(max_payload=1 << 16, admitted=False).feed(data):
                if hs.done:  # (what follows is the mesh's)
                    break
                got.append(f.header)
                hs.receive(f.header)
            if hs.done:
                if secret is not None:  # (the hello's ``info`` is not under the proofs: auth's docstring)
                    assert [_proven(h) for h in got] == [_proven(h) for h in honest[:len(got)]], \
                        "admitted on a transcript that is not the honest one"
                theirs = hs.peer.info
                shared_settings.refusal(hs.peer.peer_id, shared_settings.differences(ours, theirs.get("settings")))
                auth.sanitise(hs.peer.peer_id)

        return Target(name, [sample], run)

    return [make("handshake-listener", b"secret", False), make("handshake-dialer", b"secret", True),
            make("handshake-open", None, False)]


def _proven(header: dict) -> list:
    """The fields of a handshake message that its proofs cover, with their types."""
    return [(type(header.get(k)), header.get(k)) for k in ("t", "v", "cluster", "id", "nonce", "auth", "mac")]


def beacon_target() -> Target:
    from p2ptrain.net import beacon

    b = beacon.Beacon(cluster="lab", peer_id="p" * 16, port=7000, device="cuda", round=12, state="synced")
    seen = beacon.BeaconFilter(cluster="lab", peer_id="me", secret=b"secret")
    clock = [0.0]

    def run(data):
        clock[0] += 0.01
        seen.accept(data, "192.0.2.1", clock[0])  # (never raises; its memory stays bounded)
        seen.take_log_lines(clock[0])
        try:
            beacon.decode_beacon(data, None)
        except RemoteProtocolError:
            pass
        beacon.decode_beacon(data, b"secret")

    return Target("beacon", [beacon.encode_beacon(b, None), beacon.encode_beacon(b, b"secret")], run)


def round_target() -> Target:
    from p2ptrain.cluster import roundmsg as M
    from p2ptrain.cluster.rounds import RoundMachine

    d = b"d" * 16
    msgs = [{"t": M.QUERY, "b": [2, "a"]},
            {"t": M.STATUS, "synced": True, "version": 4, "digest": d, "round": 3, "members": 2, "min_id": "a",
             "window": [[4, d]], "log": [[3, [1, "a"], True]], "re": False, "promised": [1, "a"],
             "pending": {"r": 5, "b": [1, "a"], "phase": "ready", "ok": True, "view": ["a", "b"], "total": 64},
             "at": [4, d], "out": 1.5, "end": None, "served": True, "side": ["a", "b"]},
            {"t": M.PROPOSE, "r": 5, "b": [1, "a"], "view": ["a", "b"], "end": [0, 12.5]},
            {"t": M.READY, "r": 5, "b": [1, "a"], "samples": 32, "version": 4, "digest": d},
            {"t": M.START, "r": 5, "b": [1, "a"], "view": ["a", "b"], "total": 64},
            {"t": M.DONE, "r": 5, "b": [1, "a"], "ok": True, "checksum": d, "used": b"\x03"},
            {"t": M.COMMIT, "r": 5, "b": [1, "a"], "total": 64, "used": b"\x03"},
            {"t": M.ABORT, "r": 5, "b": [1, "a"], "reason": "x", "drop": ["b"], "void": M.NOT_FINITE},
            {"t": M.NACK, "r": 5, "b": [1, "a"], "reason": "x", "missing": ["c"]},
            {"t": M.GOODBYE, "end": 9}, {"t": M.END, "b": [1, "a"], "version": 9, "digest": d, "why": "max rounds"}]
    box = {"n": 0}

    def machine():
        m = RoundMachine("b")
        for peer in ("a", "c"):
            m.on_connected(peer, 0.0)
        return m

    def run(data):
        header = wire.unpack_header(data)
        M.parse(header)
        box["n"] += 1
        if box["n"] % 5000 == 1:  # (a fresh machine now and then: its tables are bounded, not empty)
            box["m"] = machine()
        box["m"].on_message("a", header, 1.0 + box["n"] * 1e-3)

    return Target("round-messages", [msgpack.packb(m, use_bin_type=True) for m in msgs], run, structured=True)


def chunk_target() -> Target:
    from p2ptrain.collective.chunk_header import check_chunk_header, chunk_header
    from p2ptrain.collective.ring import Transfer

    t = Transfer(1, 2, 0, 100, True, 1)
    samples = [msgpack.packb(chunk_header(3, t, 100, "int8", {"s": 1, "b": 32}, raw), use_bin_type=True)
               for raw in (False, True)]

    def run(data):
        check_chunk_header(wire.unpack_header(data), "b", 3, t, 100, "int8", True)

    return Target("chunk-header", samples, run, (RemoteProtocolError, GroupError), structured=True)


def state_target() -> Target:
    from p2ptrain.cluster import statesync

    fingerprint = [("w", (4, 3), "float32", True), ("b", (3,), "float32", True)]

    class Mesh:
        def post(self, *args):
            pass

    box = {"n": 0}
    part = {"t": wire.STATE, "k": statesync.PART, "id": 1, "i": 0, "n": 1, "size": 40, "sync": [3, b"d" * 16, 2, 0],
            "checksum": "ab"}
    samples = [_frames(({"t": wire.STATE, "k": statesync.ASK, "id": 7, "only": "parameters"},
                        statesync._fp_bytes(fingerprint))),
               _frames((part, b"\1" * 40)),
               _frames(({"t": wire.STATE, "k": statesync.REFUSE, "id": 1, "why": "busy", "cause": "model"}, b"")),
               _frames(({"t": wire.STATE, "k": statesync.MODEL}, statesync._fp_bytes(fingerprint)))]

    def run(data):
        box["n"] += 1
        if box["n"] % 5000 == 1:
            box["t"] = statesync.StateTransfer(Mesh(), fingerprint, on_ask=lambda *a: None, on_foreign=lambda *a: None)
            box["t"].refuse = lambda *a, **k: None  # (its answer is sent by a task: the I/O side)
        for frame in wire.FrameDecoder(max_payload=1 << 16).feed(data):
            box["t"].on_frame("b", frame)
            if frame.header.get("k") == statesync.PART:
                statesync.Assembly(frame.header, 1 << 16).add(frame.header, frame.payload)

    return Target("state-frames", samples, run)


def keepalive_target() -> Target:
    from p2ptrain.net.mesh import Mesh

    class Stub:
        proposed = 0

        def propose(self, host, port):
            Stub.proposed += 1

    def run(data):
        Mesh._heard_of(Stub(), wire.unpack_header(data).get("at"))

    sample = msgpack.packb({"t": wire.PING, "at": [["10.0.0.2", 7000], ["fe80::1%eth0", 7001]]}, use_bin_type=True)
    return Target("keepalive", [sample], run, structured=True)


CODEC_SPECS = ["none", "fp16", "bf16", "int8", "topk:0.01", "fp16+nozstd", "int8+nozstd", "topk:0.5+nozstd"]


def codec_target() -> Target:
    """Input: the spec's index (1 byte), the params' length (u16), the params (msgpack), the payload."""
    from p2ptrain.codecs import parse_codec

    n = 600
    codecs = [parse_codec(s) for s in CODEC_SPECS]
    samples = []
    for i, codec in enumerate(codecs):
        enc = codec.encode(np.random.default_rng(i).standard_normal(n).astype(np.float32))
        params = msgpack.packb(dict(enc.params), use_bin_type=True)
        samples.append(bytes([i]) + struct.pack("<H", len(params)) + params + enc.tobytes())
    out, dst, scratch = np.empty(n, np.float32), np.zeros(n, np.float32), np.empty(n, np.float32)

    def run(data):
        if len(data) < 3:
            raise RemoteProtocolError("short")  # (the frame's header would not parse)
        codec = codecs[data[0] % len(codecs)]
        (plen,) = struct.unpack_from("<H", data, 1)
        params = wire.unpack_header(msgpack.packb({"t": "p", "p": _params(data[3:3 + plen])}))["p"]
        payload = data[3 + plen:]
        dst.fill(0.0)  # (a fresh sum: adding to what earlier inputs left would overflow there)
        with np.errstate(all="raise"):
            try:
                codec.decode(params, payload, out)
            finally:
                codec.decode_add(params, payload, dst, scratch)

    return Target("codec-payloads", samples, run)


def _params(raw: bytes):
    try:
        return msgpack.unpackb(raw, raw=False, max_ext_len=0)
    except Exception:  # noqa: BLE001 - not msgpack: the peer's header would not have parsed
        raise RemoteProtocolError("params") from None


def valid_snapshot() -> bytes:
    """An honest snapshot: a small model's and its optimizer's state after one step."""
    import torch

    from p2ptrain.cluster import snapshot

    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    state = {"model": model.state_dict(), "optim": opt.state_dict(), "round": 7, "lineage": [[1, b"x" * 16]]}
    return b"".join(bytes(b) for b in snapshot.pack(state))


def snapshot_target() -> Target:
    from p2ptrain.cluster import snapshot

    return Target("snapshot", [valid_snapshot()], lambda data: snapshot.unpack(data))


def sketch_target() -> Target:
    import torch

    from p2ptrain.cluster import drift

    torch.manual_seed(0)
    mine = drift.param_sketch([torch.randn(50, 20), torch.randn(20)])
    theirs = drift.param_sketch([torch.randn(50, 20), torch.randn(20)])

    def run(data):
        with np.errstate(all="raise"):
            drift.compare(mine, data)
            drift.sketch_finite(data)
            drift.sketch_checksum(data)

    return Target("param-sketch", [mine, theirs], run, (ValueError,))


def targets() -> list[Target]:
    return [frame_target(), *handshake_targets(), beacon_target(), round_target(), chunk_target(), state_target(),
            keepalive_target(), codec_target(), snapshot_target(), sketch_target()]


def target(name: str) -> Target:
    """The one parser ``name``, built alone (a process that fuzzes one builds only its own)."""
    if name.startswith("handshake-"):
        return next(t for t in handshake_targets() if t.name == name)
    return {"frame": frame_target, "beacon": beacon_target, "round-messages": round_target,
            "chunk-header": chunk_target, "state-frames": state_target, "keepalive": keepalive_target,
            "codec-payloads": codec_target, "snapshot": snapshot_target, "param-sketch": sketch_target}[name]()


TARGET_NAMES = ["frame", "handshake-listener", "handshake-dialer", "handshake-open", "beacon", "round-messages",
                "chunk-header", "state-frames", "keepalive", "codec-payloads", "snapshot", "param-sketch"]
