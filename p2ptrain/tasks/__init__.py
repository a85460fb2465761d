"""Tasks: what ``python -m p2ptrain join`` trains.

A ``Task`` bundles a model, an optimizer factory, an endless per-peer batch stream, a loss,
and optionally a validation loss and a sample. ``load_task(spec, options)`` builds one from
a built-in name, a ``.py`` file defining ``make_task(options)`` (see
``examples/task_template.py``) or ``module:function``; ``validate_task(task, device)``
dry-runs one batch so that a mistake is reported before a peer joins a cluster.

Built-ins: ``charlm`` (default: a byte-level transformer LM on the Python standard
library's source) and ``synthetic`` (teacher-student MLP of any size, for benchmarks).

``model_fingerprint`` / ``fingerprint_diff`` check that a joining peer has the same
architecture; ``param_checksum`` proves replicas bit-identical.
"""

from __future__ import annotations

import importlib

from p2ptrain.tasks._options import check_task_options, parse_model_size

# The rest loads torch: imported on first use (PEP 562), so that ``join`` checks its options
# (``check_task_options``) in the first second, before torch's import.
_LAZY = {"Fingerprint": "p2ptrain.cluster.fingerprint", "fingerprint_diff": "p2ptrain.cluster.fingerprint",
         "model_fingerprint": "p2ptrain.cluster.fingerprint", "param_checksum": "p2ptrain.cluster.fingerprint",
         "BUILTINS": "p2ptrain.tasks._loader", "DEFAULT_TASK": "p2ptrain.tasks._loader", "builtin": "p2ptrain.tasks._loader",
         "load_task": "p2ptrain.tasks._loader", "Task": "p2ptrain.tasks._task",
         "printable_text": "p2ptrain.tasks._task", "seeded_generator": "p2ptrain.tasks._task",
         "validate_task": "p2ptrain.tasks._task"}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


__all__ = [
    "BUILTINS",
    "DEFAULT_TASK",
    "Fingerprint",
    "Task",
    "builtin",
    "check_task_options",
    "fingerprint_diff",
    "load_task",
    "model_fingerprint",
    "param_checksum",
    "parse_model_size",
    "printable_text",
    "seeded_generator",
    "validate_task",
]
