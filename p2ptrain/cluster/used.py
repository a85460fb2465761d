"""Which parameters had a gradient in a round: one bit per parameter tensor. Pure code, no I/O.

DDP's rule (``find_unused_parameters=True``), and one process's: a parameter for which no
member had a gradient in a round keeps ``grad`` None, and the optimizer skips it (no momentum,
no weight decay); one that some members had a gradient for gets the weighted mean, the others
counting as zeros. The ring carries sums, not None-ness, so each member says which of its
parameters had a gradient in its DONE (``encode``: a bitmask, ``MASK_LIMIT`` bytes at most),
the leader ORs them (``merge``) into its COMMIT, and every member applies the same mask
(``decode``): replicas stay bit-identical.

A round that a new leader commits after its leader was lost (``Leader.resolve``) carries no
mask: every parameter is stepped that round. A member that had heard the lost leader's COMMIT
applied its mask, so the two can differ on a parameter nobody used; the parameter sketches
compared with the leader's (``reconcile``) load the leader's parameters where that passes the
tolerance.

Local steps need no mask: a round averages parameter changes, and a parameter no inner step
moved (its ``grad`` None: the user's optimizer skipped it, as in one process) changes by zero,
which is what it contributes (``Accumulator.add_weighted`` marks every parameter).

On the wire a mask is ``bytes``: bit ``i % 8`` of byte ``i // 8`` is parameter ``i`` (numpy's
``bitorder="little"``), padding bits zero. None (the field absent) means every parameter had a
gradient: the common case costs nothing, and a peer that sends no mask is read as before.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from p2ptrain.errors import RemoteProtocolError

NONE_YET = b""  # ``merge``'s start: no member's mask yet (never a mask: ``roundmsg`` refuses an empty one)
MASK_LIMIT = 1 << 17  # bytes: a model of up to 1,048,576 parameter tensors (a security limit)


def encode(flags: Sequence[bool] | np.ndarray) -> bytes | None:
    """``flags[i]``: parameter ``i`` had a gradient. None where all did (nothing to send)."""
    bits = np.asarray(flags, dtype=bool)
    if bits.all():
        return None
    if len(bits) > 8 * MASK_LIMIT:
        raise ValueError(f"{len(bits)} parameter tensors: a mask holds {8 * MASK_LIMIT} at most")
    return np.packbits(bits, bitorder="little").tobytes()


def merge(a: bytes | None, b: bytes | None) -> bytes | None:
    """The OR of two members' masks (None: all had a gradient, which absorbs the other;
    ``NONE_YET``: the other). Raises ``RemoteProtocolError`` on masks of different lengths
    (models of different sizes: the peer whose mask is ``b`` broke the fingerprint's promise)."""
    if a is None or b is None:
        return None
    if a == NONE_YET:
        return b
    if len(a) != len(b):
        raise RemoteProtocolError(f"a parameter mask of {len(b)} bytes after one of {len(a)}: the models differ")
    return (np.frombuffer(a, np.uint8) | np.frombuffer(b, np.uint8)).tobytes()


def decode(mask: bytes | None, count: int) -> np.ndarray | None:
    """The flags of ``count`` parameters as a bool array; None where every one had a gradient.
    Raises ``ValueError`` on a mask of another length, or with a padding bit set."""
    if mask is None:
        return None
    if len(mask) != (count + 7) // 8:
        raise ValueError(f"a mask of {len(mask)} bytes for {count} parameters")
    bits = np.unpackbits(np.frombuffer(mask, np.uint8), bitorder="little").astype(bool)
    if bits[count:].any():
        raise ValueError("a mask with a bit set past its parameters")
    bits = bits[:count]
    return None if bits.all() else bits
