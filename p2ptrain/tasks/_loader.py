"""``load_task(spec, options)``: a built-in by name, a task file, or ``module:function``.

A task file is any ``.py`` file defining ``make_task(options) -> Task``; it is imported
under a private module name with its folder on ``sys.path`` (as ``python file.py`` would
have it), so it may import its neighbours. Every mistake in it (it does not import, has
no ``make_task``, returns something else) is a one-line ConfigError naming the file.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

from p2ptrain.errors import ConfigError
from p2ptrain.tasks import charlm, synthetic
from p2ptrain.tasks._task import TEMPLATE_HINT, Task

BUILTINS: dict[str, Callable[[dict], Task]] = {"charlm": charlm.make_task, "synthetic": synthetic.make_task}
DEFAULT_TASK = "charlm"
DEFAULT_OPTIONS = {"seed": 0, "data": None, "model_size": None, "batch_size": None, "device": "auto"}


def _one_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())}".rstrip(": ")


def _checked_options(options: dict | None) -> dict:
    merged = {**DEFAULT_OPTIONS, **(options or {})}
    seed, batch_size = merged["seed"], merged["batch_size"]
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ConfigError(f"--seed {seed!r}: not an integer; use e.g. --seed 0 (the same on every peer)")
    if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1):
        raise ConfigError(f"--batch-size {batch_size!r}: not a positive integer; use e.g. --batch-size 32")
    return merged


def _import_file(path: Path, shown: str) -> ModuleType:
    """Import ``path`` as a fresh module; any failure is a ConfigError naming ``shown``."""
    resolved = path.resolve()
    tag = hashlib.blake2b(str(resolved).encode(), digest_size=4).hexdigest()
    name = f"_p2ptrain_task_{path.stem.replace('-', '_')}_{tag}"
    spec = importlib.util.spec_from_file_location(name, resolved)
    if spec is None or spec.loader is None:
        raise ConfigError(f"{shown}: cannot be imported as Python; give a .py file ({TEMPLATE_HINT})")
    module = importlib.util.module_from_spec(spec)
    folder = str(resolved.parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    sys.modules[name] = module  # dataclasses defined in the file look their module up here
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[name]
        raise ConfigError(f"{shown}: failed to import: {_one_line(exc)}; fix the file "
                          f"(`python {shown}` shows the traceback)") from exc
    return module


def _factory_from_spec(spec: str) -> tuple[Callable[..., Any], str, str]:
    """(make_task function, name to show in errors, the name it was looked up by)."""
    path = Path(spec).expanduser()
    if spec.endswith(".py") or path.is_file():
        if not path.is_file():
            raise ConfigError(f"--task {spec}: no such file; give a path to a .py task file, module:function, "
                              f"or a built-in ({', '.join(BUILTINS)})")
        module = _import_file(path, spec)
        factory = getattr(module, "make_task", None)
        if factory is None:
            raise ConfigError(f"{spec}: no make_task(options) function: define make_task returning "
                              f"p2ptrain.tasks.Task ({TEMPLATE_HINT})")
        return factory, spec, "make_task"
    module_name, sep, function_name = spec.partition(":")
    if not sep or not module_name or not function_name:
        raise ConfigError(f"--task {spec!r}: not a built-in ({', '.join(BUILTINS)}), a .py file or module:function")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise ConfigError(f"--task {spec}: cannot import module {module_name!r}: {_one_line(exc)}; "
                          f"check the name and that it is on PYTHONPATH") from exc
    factory = getattr(module, function_name, None)
    if factory is None:
        raise ConfigError(f"--task {spec}: module {module_name!r} has no {function_name!r}: define "
                          f"{function_name}(options) returning p2ptrain.tasks.Task ({TEMPLATE_HINT})")
    return factory, spec, function_name


def builtin(spec: str | None) -> str | None:
    """The built-in task ``spec`` names (None: the default one), or None where it names a file or
    a ``module:function``."""
    name = (spec or DEFAULT_TASK).strip()
    return name if name in BUILTINS else None


def load_task(spec: str | None = None, options: dict | None = None) -> Task:
    """Build the task named by ``spec``: a built-in (``charlm``, ``synthetic``; None means
    charlm), a path to a ``.py`` file defining ``make_task(options)``, or ``module:function``.

    ``options`` may hold ``seed`` (int, the same on every peer), ``data`` (a path),
    ``model_size``, ``batch_size`` (overrides the task's) and ``device``; missing keys get
    defaults and the factory receives them all. Raises ConfigError for every mistake.
    Call ``validate_task(task, device)`` next to dry-run it."""
    options = _checked_options(options)
    spec = (spec or DEFAULT_TASK).strip()
    if builtin(spec) is not None:
        task = BUILTINS[spec](options)
        task.source = f"built-in task {spec}"
    else:
        factory, shown, function_name = _factory_from_spec(spec)
        if not callable(factory):
            raise ConfigError(f"{shown}: {function_name} is a {type(factory).__name__}, not a function: define "
                              f"{function_name}(options) returning p2ptrain.tasks.Task ({TEMPLATE_HINT})")
        try:
            takes_options = bool(inspect.signature(factory).parameters)
        except (TypeError, ValueError):
            takes_options = True
        try:
            task = factory(options) if takes_options else factory()
        except ConfigError:
            raise
        except Exception as exc:
            raise ConfigError(f"{shown}: {function_name}(options) raised {_one_line(exc)}; "
                              f"fix {function_name}") from exc
        if not isinstance(task, Task):
            raise ConfigError(f"{shown}: {function_name}(options) returned {type(task).__name__}, not "
                              f"p2ptrain.tasks.Task: return Task(name=..., model=..., ...) ({TEMPLATE_HINT})")
        task.source = shown
    if options["batch_size"] is not None:
        task.batch_size = options["batch_size"]
    return task
