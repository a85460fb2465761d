"""numba, for the few passes p2ptrain compiles (``codecs._int8_kernels``, ``codecs._topk_kernels``,
``trainer._local_kernels``), where it is installed and ``P2PTRAIN_NUMBA`` is not 0.

Each kernel module compiles its loops on first use and caches them beside itself
(``cache=True``); where numba is missing, or cannot compile here, its caller runs torch's (or
numpy's) passes instead, the same floats bit for bit (each module's tests run both)."""

from __future__ import annotations

import logging

from p2ptrain.switches import env_switch

log = logging.getLogger(__name__)

ENV = "P2PTRAIN_NUMBA"


def enabled() -> bool:
    """``P2PTRAIN_NUMBA``: 1 (default) uses the compiled kernels where numba imports; 0 never
    does. Anything else is a ConfigError (``join`` checks at its start)."""
    return env_switch(ENV, default=True)


def compile_with(build, what: str):
    """``build(numba)``'s kernels, or None where numba is not installed, is switched off, or
    cannot compile them (said once, with what runs instead: torch's passes for ``what``)."""
    if not enabled():
        return None
    try:
        import numba
    except ImportError:
        log.debug("numba is not installed: %s runs on torch's kernels", what)
        return None
    try:
        return build(numba)
    except Exception as exc:  # (a numba that cannot compile here: the torch passes still work)
        log.warning("numba could not compile %s's kernels (%s): using torch's", what, exc)
        return None


def njit(numba):
    """The options every kernel compiles with: cached, no GIL, no bounds checks, and no
    fast-math (no reordering or fusing of float operations: the same floats as torch's)."""
    return numba.njit(cache=True, nogil=True, boundscheck=False)
