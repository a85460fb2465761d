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

from p2ptrain.cluster.fingerprint import Fingerprint, fingerprint_diff, model_fingerprint, param_checksum
from p2ptrain.tasks._loader import BUILTINS, DEFAULT_TASK, check_task_options, load_task
from p2ptrain.tasks._task import Task, parse_model_size, printable_text, seeded_generator, validate_task

__all__ = [
    "BUILTINS",
    "DEFAULT_TASK",
    "Fingerprint",
    "Task",
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
