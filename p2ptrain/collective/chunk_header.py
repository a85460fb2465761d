"""A ring chunk's frame header: what the sender writes and what the receiver accepts. Pure.

``{"t": CHUNK, "op": call, "g": step, "c": chunk, "n": values in the call, "z": codec spec,
"p": codec params}``, and ``"raw": true`` where the chunk is float32 values as they are
(``linkpace``). The receiver refuses anything else with the error that names the cause: a
peer allreducing other shapes or with another codec (``GroupError``: the user's to fix), a
frame out of step or malformed (``RemoteProtocolError``), a link the peer closed.
"""

from __future__ import annotations

from p2ptrain.collective.ring import Transfer
from p2ptrain.errors import GroupError, RemoteProtocolError
from p2ptrain.net import wire
from p2ptrain.net.auth import refusal_reason


def chunk_header(op: int, t: Transfer, length: int, spec: str, params: dict, raw: bool) -> dict:
    header = {"t": wire.CHUNK, "op": op, "g": t.g, "c": t.chunk, "n": length, "z": spec, "p": params}
    if raw:
        header["raw"] = True
    return header


def check_chunk_header(h: dict, who: str, op: int, t: Transfer, length: int, spec: str,
                       may_be_raw: bool) -> tuple[dict, bool]:
    """The codec params of the chunk ``t`` of call ``op`` from ``who``, and whether it came raw
    (``may_be_raw``: the codec is lossy, so its chunks may)."""
    if h.get("t") == wire.REJECT:  # (it closes the link, and may say why: ``Group``)
        raise GroupError(f"{who} closed the link: {refusal_reason(h)}")
    if h.get("t") != wire.CHUNK:
        raise RemoteProtocolError(f"{who} sent a {h.get('t')!r} frame in the middle of an allreduce")
    if h.get("n") != length:
        raise GroupError(f"{who} allreduces {h.get('n')} values and this peer {length}: "
                         "every peer must pass tensors of the same shapes, in the same order")
    if h.get("z") != spec:
        raise GroupError(f"{who} uses compression {h.get('z')!r} and this peer {spec!r}: "
                         "pass the same compression everywhere")
    if (h.get("op"), h.get("g"), h.get("c")) != (op, t.g, t.chunk):
        raise RemoteProtocolError(f"{who} sent chunk {(h.get('op'), h.get('g'), h.get('c'))} where "
                                  f"{(op, t.g, t.chunk)} was due: peers out of step")
    params = h.get("p")
    if not isinstance(params, dict):
        raise RemoteProtocolError(f"{who} sent a chunk without codec parameters")
    raw = h.get("raw", False)
    if raw is not False and (raw is not True or not may_be_raw):
        raise RemoteProtocolError(f"{who} sent a chunk marked raw={raw!r}, which {spec!r} never sends")
    return params, raw
