"""The checks of ``join``'s task options that need no torch: a bad ``--model-size``, a missing
``--data`` or ``--task`` file said in the first second, not after torch's import and the task's
build (2.5-18 s). Pure code: no torch, no task imported (``tasks/__init__`` loads the rest only
when asked for it). A task file's own options are its own: checked as it builds.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

from p2ptrain.errors import ConfigError

BUILTIN_NAMES = ("charlm", "synthetic")  # (``_loader.BUILTINS``)
CHARLM_PRESETS = ("tiny", "small", "medium", "large")  # (``charlm.PRESETS``)
SYNTHETIC_DEFAULT_SIZE = "1m"  # (``synthetic.DEFAULT_SIZE``)

_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?(?:e\d+)?)\s*([kmgb]?)\s*$", re.IGNORECASE)
_SCALE = {"": 1, "k": 10 ** 3, "m": 10 ** 6, "g": 10 ** 9, "b": 10 ** 9}


def parse_model_size(text: str | int, option: str = "--model-size") -> int:
    """``"100k"``, ``"1.5m"``, ``"1e6"``, ``"2b"`` or an int to a parameter count."""
    match = _SIZE.match(str(text))
    count = float(match[1]) * _SCALE[match[2].lower()] if match else 0
    if not match or not 1 <= count < 1e12 or not math.isfinite(count):
        raise ConfigError(f"{option} {text!r}: not a parameter count; use e.g. 100k, 1m, 10m, 100m or an integer")
    return int(count)


def check_task_options(spec: str | None, data: str | None = None, model_size: str | None = None) -> None:
    """ConfigError for what is wrong with a built-in task's ``--data`` or ``--model-size``, or a
    ``--task`` file that is not there; nothing for a task file's or module's own options."""
    spec = (spec or "charlm").strip()
    if spec == "charlm":
        if model_size is not None and str(model_size).lower() not in CHARLM_PRESETS:
            parse_model_size(model_size)
        if data is not None and not Path(data).expanduser().exists():
            raise ConfigError(f"--data {data}: no such file or folder; give a text file or a folder of text files")
    elif spec == "synthetic":
        if data is not None:  # (it would be ignored: a run on other data than the user meant)
            raise ConfigError(f"synthetic: --data {data}: this task makes its own data (labels from a random "
                              "teacher); drop it, or train on text with the charlm task")
        parse_model_size(model_size or SYNTHETIC_DEFAULT_SIZE)
    elif spec.endswith(".py") and not Path(spec).expanduser().is_file():
        raise ConfigError(f"--task {spec}: no such file; give a path to a .py task file, module:function, "
                          f"or a built-in ({', '.join(BUILTIN_NAMES)})")
