"""Model fingerprints (do two peers train the same architecture?) and parameter checksums
(are two replicas bit-identical?)."""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch

from p2ptrain.cluster.snapshot import tensors_checksum

# (name, shape, dtype, trainable): a checkpoint written before trainable was recorded has three.
Fingerprint = list[tuple[str, tuple[int, ...], str, bool]]


def model_fingerprint(model: torch.nn.Module) -> Fingerprint:
    """``[(name, shape, dtype, trainable), ...]`` of every parameter, in registration order.
    ``trainable`` (``requires_grad``) too: the gradients travel as one buffer of the trainable
    ones, so a peer that froze other layers cannot sum with this one.

    Plain strings, ints, bools and tuples, so it travels in a msgpack header (as lists)."""
    return [(name, tuple(int(n) for n in p.shape), str(p.dtype).removeprefix("torch."), bool(p.requires_grad))
            for name, p in model.named_parameters()]


def normalized(fingerprint: Any) -> Fingerprint | None:
    """The fingerprint with shapes as tuples (``trainable`` None where a checkpoint's does not
    say), or None if it is not one (e.g. from a bad peer)."""
    if not isinstance(fingerprint, (list, tuple)):
        return None
    out = []
    for entry in fingerprint:
        if not isinstance(entry, (list, tuple)) or len(entry) not in (3, 4):
            return None
        name, shape, dtype, trainable = (*entry, None)[:4]
        if not isinstance(name, str) or not isinstance(dtype, str) or not isinstance(shape, (list, tuple)) \
                or not all(isinstance(n, int) and not isinstance(n, bool) for n in shape) \
                or not isinstance(trainable, (bool, type(None))):
            return None
        out.append((name, tuple(shape), dtype, trainable))
    return out


def fingerprint_diff(here: Sequence, there: Sequence) -> str | None:
    """None when the fingerprints match, else one line naming the first difference, led by the
    two models' sizes where they differ (``another size: 999,526 parameters here, ...``: a
    newcomer's usual mistake, another ``--model-size``, said in its own terms).

    ``here`` is this peer's, ``there`` the other peer's; the order of parameters matters,
    since gradients travel as one flat buffer packed in that order."""
    mine, theirs = normalized(here), normalized(there)
    if mine is None:
        raise TypeError("fingerprint_diff: 'here' is not a model_fingerprint() list")
    if theirs is None:
        return "the other peer's model fingerprint is malformed"
    first = _first_difference(mine, theirs)
    size_here, size_there = _size(mine), _size(theirs)
    if first is None or size_here == size_there:
        return first
    return f"another size: {size_here:,} parameters here, {size_there:,} on the other peer; {first}"


def _size(fingerprint: Fingerprint) -> int:
    return sum(math.prod(shape) for _, shape, *_ in fingerprint)


def _first_difference(mine: Fingerprint, theirs: Fingerprint) -> str | None:
    their_names = {entry[0] for entry in theirs}
    my_names = {entry[0] for entry in mine}
    for index, (mine_entry, their_entry) in enumerate(zip(mine, theirs)):
        name, shape, dtype, trainable = mine_entry
        other_name, other_shape, other_dtype, other_trainable = their_entry
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
        if None not in (trainable, other_trainable) and trainable != other_trainable:
            return (f"parameter {name!r} is {'trained' if trainable else 'frozen'} here and "
                    f"{'trained' if other_trainable else 'frozen'} on the other peer (requires_grad): freeze the "
                    "same parameters on every peer")
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
