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


class Kernels:
    """One module's compiled kernels: ``build(numba)`` once a process (``load``: its namespace,
    or None as ``compile_with`` says), and ``run(kernels)`` once on tiny arrays (``warm``), so
    that compiling, or loading from the cache (about 2 s and 0.8 s), is done before any round.
    Two threads at once would both build them: the same kernels, the first kept."""

    def __init__(self, build, run, what: str):
        self._build, self._run, self._what = build, run, what
        self._loaded: list = []  # [namespace or None], once ``load`` has run
        self._warmed = False

    def load(self):
        """The compiled kernels (a namespace of functions), or None where numba is not installed
        or ``P2PTRAIN_NUMBA=0``. Read once a process: a run uses one kind throughout."""
        if not self._loaded:
            self._loaded.append(compile_with(self._build, self._what))
        return self._loaded[0]

    def warm(self) -> bool:
        """Run every kernel now, on tiny arrays; after the first call it costs nothing. True
        where the kernels are in use."""
        k = self.load()
        if k is not None and not self._warmed:
            self._run(k)
            self._warmed = True
        return k is not None


def njit(numba):
    """The options every kernel compiles with: cached, no GIL, no bounds checks, and no
    fast-math (no reordering or fusing of float operations: the same floats as torch's)."""
    return numba.njit(cache=True, nogil=True, boundscheck=False)
