"""``synthetic``: a student MLP learns to classify like a fixed random teacher MLP.

For benchmarks and network stress: no files, data generated on the fly, any model size
(``model_size`` = ``100k``, ``1m`` (default), ``10m``, ``100m`` or a count; the student's
width is solved so the parameter count comes within a few percent). The teacher is
seeded by ``seed`` alone, so every peer labels the same way; inputs are seeded by
``(seed, rank_seed)``, so peers train on different samples; the validation set is fixed.
"""

from __future__ import annotations

import math
from typing import Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F

from p2ptrain.errors import ConfigError
from p2ptrain.tasks._optim import fused_when_possible
from p2ptrain.tasks._task import Task, evaluating, parse_model_size, seeded_generator

INPUTS = 32
CLASSES = 10
TEACHER_HIDDEN = 64
VALIDATION_SAMPLES = 2048
DEFAULT_SIZE = "1m"


def student_width(target: int) -> int:
    """Width ``w`` of ``INPUTS -> w -> w -> CLASSES`` whose parameter count is closest to ``target``."""
    # params = w^2 + (INPUTS + CLASSES + 2) w + CLASSES
    linear = INPUTS + CLASSES + 2
    width = (-linear + math.sqrt(linear ** 2 + 4 * max(target - CLASSES, 0))) / 2
    return max(4, round(width))


def make_student(width: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(INPUTS, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                         nn.Linear(width, CLASSES))


class Teacher:
    """A fixed random MLP (plain tensors, not a module: it is data, not something to train)."""

    def __init__(self, seed: int):
        gen = seeded_generator(seed, "synthetic-teacher")
        self.hidden = torch.randn(INPUTS, TEACHER_HIDDEN, generator=gen) / math.sqrt(INPUTS)
        self.out = torch.randn(TEACHER_HIDDEN, CLASSES, generator=gen) / math.sqrt(TEACHER_HIDDEN)

    def label(self, inputs: torch.Tensor) -> torch.Tensor:
        return (torch.tanh(inputs @ self.hidden) @ self.out).argmax(dim=1)

    def batch(self, size: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        inputs = torch.randn(size, INPUTS, generator=gen)
        return inputs, self.label(inputs)


def _loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor], device: torch.device) -> torch.Tensor:
    inputs, labels = (t.to(device, non_blocking=True) for t in batch)
    return F.cross_entropy(model(inputs), labels)


def make_task(options: dict) -> Task:
    """Build ``synthetic`` from ``options`` (``seed``, ``model_size``, ``batch_size``)."""
    if options.get("data") is not None:  # (it was ignored: a run on other data than the user meant)
        raise ConfigError(f"synthetic: --data {options['data']}: this task makes its own data (labels from a random "
                          "teacher); drop it, or train on text with the charlm task")
    target = parse_model_size(options.get("model_size") or DEFAULT_SIZE)
    width = student_width(target)
    seed = int(options.get("seed", 0))
    teacher = Teacher(seed)
    with torch.random.fork_rng(devices=[]):  # same initial weights on every peer, global RNG untouched
        torch.manual_seed(seed)
        model = make_student(width)
    validation = teacher.batch(VALIDATION_SAMPLES, seeded_generator(seed, "synthetic-validation"))

    def train_batches(rank_seed: int, world_hint: int, batch_size: int, seed: int) -> Iterator:
        # the batch seed is the caller's (it may differ from the one the teacher was built with)
        gen = seeded_generator(seed, rank_seed, "synthetic-train")
        while True:
            yield teacher.batch(batch_size, gen)

    def evaluate(model: nn.Module, device: torch.device) -> float:
        with evaluating(model):
            total = sum(_loss(model, (x, y), device).item() * len(x)
                        for x, y in zip(validation[0].split(512), validation[1].split(512)))
        return total / VALIDATION_SAMPLES

    def sample(model: nn.Module, device: torch.device) -> str:
        with evaluating(model):
            predicted = model(validation[0].to(device)).argmax(dim=1).cpu()
        accuracy = (predicted == validation[1]).float().mean().item()
        return f"validation accuracy {accuracy:.1%} ({VALIDATION_SAMPLES} samples, {CLASSES} classes)"

    count = sum(p.numel() for p in model.parameters())
    return Task(
        name="synthetic",
        model=model,
        make_optimizer=lambda params, lr: fused_when_possible(torch.optim.Adam, params, lr=lr),
        default_lr=1e-3,
        train_batches=train_batches,
        loss=_loss,
        batch_size=int(options.get("batch_size") or 128),
        batch_size_of=lambda batch: len(batch[0]),
        evaluate=evaluate,
        sample=sample,
        info=(f"synthetic: student MLP {INPUTS}->{width}->{width}->{CLASSES}, {count:,} parameters "
              f"(asked {target:,}), labels from a fixed random teacher"),
    )
