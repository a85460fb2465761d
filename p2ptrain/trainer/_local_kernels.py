"""Local-steps mode's two passes a round over the whole model as compiled loops (numba), for
float32 parameters on the CPU, where numba is installed and ``P2PTRAIN_NUMBA`` is not 0
(``p2ptrain.jit``); ``load()`` returns None otherwise, and ``LocalSteps`` runs torch's.

Why. ``LocalSteps.contribute`` (the pseudo-gradient, its finiteness, the new base, the
weighting by samples) and ``LocalSteps.apply`` (the outer Nesterov step and local progress
rebased onto it) were four and seven passes of torch over the model's size: 1.4 and 2.2 ms a
round for 1 M parameters on one core, memory traffic mostly. Each is one loop here. Four
peers on 2 cores spend them at once, while every training thread waits for the update.

The same floats, bit for bit, as torch's passes (``tests/test_local_kernels``): each
operation on its own, in torch's order, except where torch itself fuses one. Its ``add``
and ``sub`` with an ``alpha`` compute ``self + alpha * other`` as one fused multiply-add on
the CPU (its vectorized kernels' ``fmadd``, measured: 0 of 10^6 values differ from an exact
FMA, 250,000 from a product then a sum), so those two are an FMA here too (``_fma``).
"""

from __future__ import annotations

import numpy as np

from p2ptrain import jit


def _warm(k) -> None:
    """Both kernels once, on tiny arrays (``jit.Kernels.warm``: a local-steps peer on the CPU calls
    it as it is made)."""
    x = np.ones(3, np.float32)
    k.pseudo_gradient(x.copy(), x.copy(), x.copy(), np.float32(2))
    k.outer_step(x.copy(), x.copy(), x.copy(), x.copy(), x.copy(), np.float32(0.5), np.float32(-0.5), True)


def _compile(numba):
    import types

    from numba.core import types as nbtypes
    from numba.extending import intrinsic

    njit = jit.njit(numba)

    @intrinsic
    def _fma(typingctx, a, b, c):
        """a * b + c rounded once (LLVM's ``fma``: the instruction where the CPU has it)."""
        if not all(t == nbtypes.float32 for t in (a, b, c)):
            return None
        return nbtypes.float32(nbtypes.float32, nbtypes.float32, nbtypes.float32), \
            lambda context, builder, sig, args: builder.fma(*args)

    @njit
    def pseudo_gradient(base, live, into, samples):
        """into = samples * (base - live), base = live; False where a difference is NaN or inf."""
        finite = True
        for i in range(base.size):
            d = base[i] - live[i]
            finite &= np.isfinite(d)
            into[i] = d * samples
            base[i] = live[i]
        return finite

    @njit
    def outer_step(g, v, outer, base, live, mu, neg_lr, momentum):
        """The outer Nesterov step on one parameter's values, as ``LocalSteps.apply``'s torch
        passes: v = v * mu + g; g = g + mu * v (fused); outer = outer - lr * g (fused); live =
        (live - base) + outer; base = outer."""
        for i in range(g.size):
            gi = g[i]
            if momentum:
                vi = v[i] * mu + gi
                v[i] = vi
                gi = _fma(vi, mu, gi)
            o = _fma(gi, neg_lr, outer[i])
            outer[i] = o
            live[i] = (live[i] - base[i]) + o
            base[i] = o

    return types.SimpleNamespace(pseudo_gradient=pseudo_gradient, outer_step=outer_step)


_KERNELS = jit.Kernels(_compile, _warm, "local steps")
load, warm = _KERNELS.load, _KERNELS.warm  # (``jit.Kernels``: None / False where numba is not in use)
