"""The ``Task`` interface: everything ``join`` needs to train a model, and its dry-run check."""

from __future__ import annotations

import contextlib
import hashlib
import math
import numbers
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import torch

from p2ptrain.errors import ConfigError
from p2ptrain.tasks._options import parse_model_size  # noqa: F401 (its home before: tasks.parse_model_size)

TEMPLATE_HINT = "see examples/task_template.py"


def batch_size_of_first(batch: Any) -> int:
    """Samples in ``batch``: the first dimension of its first tensor (a tensor, tuple, list or dict)."""
    while not isinstance(batch, torch.Tensor):
        if isinstance(batch, dict) and batch:
            batch = next(iter(batch.values()))
        elif isinstance(batch, (tuple, list)) and batch:
            batch = batch[0]
        else:
            raise TypeError(f"cannot find a tensor in a batch of type {type(batch).__name__}")
    return int(batch.shape[0]) if batch.dim() else 1


@dataclass
class Task:
    """A model, its data and its loss, built the same way on every peer.

    Every callable must be deterministic given its arguments, so that peers agree:

    - ``make_optimizer(params, lr)``: a torch optimizer over ``params``.
    - ``train_batches(rank_seed, world_hint, batch_size, seed)``: an endless iterator of
      batches. ``rank_seed`` differs between peers, so peers draw different samples; the
      same ``(seed, rank_seed)`` gives the same batches. ``world_hint`` is the number of
      peers expected (for tasks that shard a fixed dataset; it may change while training).
    - ``loss(model, batch, device)``: moves the batch to ``device``; returns a scalar loss
      tensor with a graph to backpropagate (the mean over the batch).
    - ``batch_size_of(batch)``: samples in a batch (weights this peer's contribution).
    - ``evaluate(model, device)``: validation loss on a fixed held-out set, the same on
      every peer; leaves the model's mode and the global random state as they were.
    - ``sample(model, device)``: a short human-readable output (e.g. generated text),
      deterministic for given parameters.

    ``batch_size`` is the per-step batch of one peer (``--batch-size`` overrides it);
    ``info`` is one line on what was built (data, parameter count) for logs; ``source``
    is filled in by ``load_task`` (the built-in name, file or module) for error messages.
    """

    name: str
    model: torch.nn.Module
    make_optimizer: Callable[[Iterable[torch.nn.Parameter], float], torch.optim.Optimizer]
    default_lr: float
    train_batches: Callable[[int, int, int, int], Iterator[Any]]
    loss: Callable[[torch.nn.Module, Any, torch.device], torch.Tensor]
    batch_size: int = 32
    batch_size_of: Callable[[Any], int] = batch_size_of_first
    evaluate: Callable[[torch.nn.Module, torch.device], float] | None = None
    sample: Callable[[torch.nn.Module, torch.device], str] | None = None
    info: str = ""
    source: str = ""

    def num_parameters(self) -> int:
        """Trainable parameters of the model (shared ones counted once)."""
        return sum(p.numel() for p in self.model.parameters() if p.requires_grad)


def printable_text(text: str) -> str:
    """``text`` safe for a terminal: line breaks and tabs kept, every other control or
    unprintable character (an escape sequence, a C1 control, a lone surrogate) written as
    its escape, ``\x1b``; so a sampled model's bytes never drive the terminal."""
    return "".join(c if c.isprintable() or c in "\n\t" else c.encode("unicode_escape", "backslashreplace").decode("ascii")
                   for c in text)


def seeded_generator(*parts: Any) -> torch.Generator:
    """A CPU generator seeded from ``parts`` (e.g. ``seed, rank_seed, "train"``), stable across runs and machines."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)


@contextlib.contextmanager
def evaluating(model: torch.nn.Module):
    """Eval mode and no grad for the block, then the model's mode as it was."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was_training)


def validate_task(task: Any, device: str | torch.device = "cpu", sample: bool = True) -> None:
    """Check ``task`` by running one batch on ``device``: ConfigError naming what is wrong.

    Moves ``task.model`` to ``device`` (where it trains anyway). Runs train_batches, loss
    and a backward pass, evaluate and sample once; leaves no gradients behind and does not
    step the optimizer, so the parameters are unchanged. ``sample=False`` leaves ``task.sample``
    to the end of the run (``join`` does for a built-in task, whose sample is tested here: the
    charlm's 200 characters took 0.9 s of every start, on a CPU)."""
    device = torch.device(device)
    where = getattr(task, "source", "") or getattr(task, "name", "") or "task"
    if not isinstance(task, Task):
        raise ConfigError(f"{where}: got {type(task).__name__}, not p2ptrain.tasks.Task: "
                          f"return Task(name=..., model=..., ...) ({TEMPLATE_HINT})")

    def bad(what: str, fix: str, hint: bool = True) -> ConfigError:
        return ConfigError(f"{where}: {what}: {fix}" + (f" ({TEMPLATE_HINT})" if hint else ""))

    def call(piece: str, fn: Callable, *args: Any) -> Any:
        try:
            return fn(*args)
        except ConfigError:
            raise
        except Exception as exc:
            text = " ".join(str(exc).split())
            # (torch says so in its text only: a RuntimeError on CPU and MPS, its own type on CUDA)
            short = isinstance(exc, (MemoryError, torch.cuda.OutOfMemoryError)) or "out of memory" in text.lower() \
                or "can't allocate memory" in text
            if short:
                raise bad(f"{piece} ran out of memory ({type(exc).__name__}: {text})", "give a smaller --batch-size",
                          hint=False) from exc
            raise bad(f"{piece} raised {type(exc).__name__}: {text}", f"fix {piece}") from exc

    if not isinstance(task.model, torch.nn.Module):
        raise bad(f"model is a {type(task.model).__name__}", "set Task.model to a torch.nn.Module")
    params = [p for p in task.model.parameters() if p.requires_grad]
    if not params:
        raise bad("model has no trainable parameters", "give Task.model parameters with requires_grad=True")
    for piece in ("make_optimizer", "train_batches", "loss", "batch_size_of"):
        if not callable(getattr(task, piece)):
            raise bad(f"{piece} is not callable", f"set Task.{piece} to a function")
    for piece in ("evaluate", "sample"):
        if getattr(task, piece) is not None and not callable(getattr(task, piece)):
            raise bad(f"{piece} is not callable", f"set Task.{piece} to a function or None")
    if isinstance(task.default_lr, bool) or not isinstance(task.default_lr, (int, float)) \
            or not 0 < task.default_lr < math.inf:
        raise bad(f"default_lr is {task.default_lr!r}", "set it to a positive float such as 1e-3")
    if isinstance(task.batch_size, bool) or not isinstance(task.batch_size, int) or task.batch_size < 1:
        raise bad(f"batch_size is {task.batch_size!r}", "set it to a positive int")

    task.model.to(device)
    params = [p for p in task.model.parameters() if p.requires_grad]
    optimizer = call("make_optimizer(params, lr)", task.make_optimizer, params, float(task.default_lr))
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise bad(f"make_optimizer(params, lr) returned {type(optimizer).__name__}",
                  "return a torch.optim.Optimizer over params")
    batches = call("train_batches(rank_seed, world_hint, batch_size, seed)", task.train_batches,
                   0, 1, task.batch_size, 0)
    if not isinstance(batches, Iterator):
        raise bad(f"train_batches(...) returned {type(batches).__name__}, not an iterator",
                  "make it a generator that yields batches in a `while True:` loop")
    batch = call("train_batches(...) iterator", next, batches, _EMPTY)
    if batch is _EMPTY:
        raise bad("train_batches(...) gave no batch", "return an endless iterator (loop over your data forever)")
    size = call("batch_size_of(batch)", task.batch_size_of, batch)
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise bad(f"batch_size_of(batch) returned {size!r}", "return the number of samples as a positive int")

    task.model.train()
    loss = call("loss(model, batch, device)", task.loss, task.model, batch, device)
    if not isinstance(loss, torch.Tensor):
        raise bad(f"loss(model, batch, device) returned {type(loss).__name__}", "return a scalar torch.Tensor")
    if loss.dim() != 0:
        raise bad(f"loss(model, batch, device) returned a tensor of shape {tuple(loss.shape)}",
                  "return a scalar (e.g. reduce with .mean())")
    if not loss.is_floating_point() or not loss.requires_grad:
        raise bad("loss(model, batch, device) returned a tensor without a graph to the parameters",
                  "compute it from model(...) outside torch.no_grad()")
    if not math.isfinite(loss.item()):
        raise bad(f"loss(model, batch, device) is {loss.item()} on the first batch", "check the data and the model")
    try:
        loss.backward()
        if all(p.grad is None for p in params):
            raise bad("loss(model, batch, device) does not depend on any model parameter",
                      "compute it from the output of task.model")
    finally:
        task.model.zero_grad(set_to_none=True)
    if task.evaluate is not None:
        value = call("evaluate(model, device)", task.evaluate, task.model, device)
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
            raise bad(f"evaluate(model, device) returned {value!r}", "return the validation loss as a finite float")
    if task.sample is not None and sample:
        text = call("sample(model, device)", task.sample, task.model, device)
        if not isinstance(text, str):
            raise bad(f"sample(model, device) returned {type(text).__name__}", "return a str")


_EMPTY = object()
