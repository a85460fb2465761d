"""Every Python process a test starts loads this (tests/conftest.py puts this folder first on
PYTHONPATH): the network guard of tests/netguard.py, with a child's rule, and then the
``sitecustomize`` this one hides, if the environment has one."""

import importlib.machinery
import importlib.util
import os
import sys


def _load(name: str, spec) -> None:
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)


def _main() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    guard = os.path.join(os.path.dirname(here), "netguard.py")
    if os.environ.get("P2PTRAIN_NETGUARD_LOG") and os.path.exists(guard):
        # (as "netguard": a pytest-xdist worker's conftest then imports this same module)
        _load("netguard", importlib.util.spec_from_file_location("netguard", guard))
        sys.modules["netguard"].install(child=True)
    rest = [p for p in sys.path if os.path.abspath(p or ".") != here]
    hidden = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if hidden is not None:
        _load("sitecustomize", hidden)


_main()
