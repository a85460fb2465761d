"""Model fingerprints (do two peers train the same architecture?) and parameter checksums
(are two replicas bit-identical?)."""

from __future__ import annotations

from typing import Any, Sequence

import torch

from p2ptrain.cluster.snapshot import tensors_checksum

Fingerprint = list[tuple[str, tuple[int, ...], str]]


def model_fingerprint(model: torch.nn.Module) -> Fingerprint:
    """``[(name, shape, dtype), ...]`` of every parameter, in registration order.

    Plain strings, ints and tuples, so it travels in a msgpack header (as lists)."""
    return [(name, tuple(int(n) for n in p.shape), str(p.dtype).removeprefix("torch."))
            for name, p in model.named_parameters()]


def _normalized(fingerprint: Any) -> Fingerprint | None:
    """The fingerprint with shapes as tuples, or None if it is not one (e.g. from a bad peer)."""
    if not isinstance(fingerprint, (list, tuple)):
        return None
    out = []
    for entry in fingerprint:
        if not isinstance(entry, (list, tuple)) or len(entry) != 3:
            return None
        name, shape, dtype = entry
        if not isinstance(name, str) or not isinstance(dtype, str) or not isinstance(shape, (list, tuple)) \
                or not all(isinstance(n, int) and not isinstance(n, bool) for n in shape):
            return None
        out.append((name, tuple(shape), dtype))
    return out


def fingerprint_diff(here: Sequence, there: Sequence) -> str | None:
    """None when the fingerprints match, else one line naming the first difference.

    ``here`` is this peer's, ``there`` the other peer's; the order of parameters matters,
    since gradients travel as one flat buffer packed in that order."""
    mine, theirs = _normalized(here), _normalized(there)
    if mine is None:
        raise TypeError("fingerprint_diff: 'here' is not a model_fingerprint() list")
    if theirs is None:
        return "the other peer's model fingerprint is malformed"
    their_names = {name for name, _, _ in theirs}
    my_names = {name for name, _, _ in mine}
    for index, (mine_entry, their_entry) in enumerate(zip(mine, theirs)):
        name, shape, dtype = mine_entry
        other_name, other_shape, other_dtype = their_entry
        if name != other_name:
            if name not in their_names:
                return f"parameter {name!r} exists here but not on the other peer"
            if other_name not in my_names:
                return f"parameter {other_name!r} exists on the other peer but not here"
            return (f"parameter #{index} is {name!r} here and {other_name!r} on the other peer "
                    f"(the same parameters, registered in a different order)")
        if shape != other_shape:
            return f"parameter {name!r} has shape {shape} here and {other_shape} on the other peer"
        if dtype != other_dtype:
            return f"parameter {name!r} has dtype {dtype} here and {other_dtype} on the other peer"
    if len(mine) > len(theirs):
        return f"parameter {mine[len(theirs)][0]!r} exists here but not on the other peer"
    if len(theirs) > len(mine):
        return f"parameter {theirs[len(mine)][0]!r} exists on the other peer but not here"
    return None


def param_checksum(model: torch.nn.Module) -> str:
    """A hex digest of every parameter's name, shape, dtype and raw bytes, in registration order.

    Equal exactly when the replicas are bit-identical (-0.0 and 0.0 differ, as do NaN
    payloads). Copies each parameter to the host: costs about a second per GB."""
    return tensors_checksum(model.named_parameters())
