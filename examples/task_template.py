"""A complete p2ptrain task file: copy it, then replace the model, data and loss with yours.

Train it on every machine of the LAN (the same file and flags everywhere):

    python -m p2ptrain join --task examples/task_template.py

Check it alone first, with no network (builds, dry-runs one batch, trains 300 steps):

    python examples/task_template.py

The one thing p2ptrain looks for is ``make_task(options) -> p2ptrain.tasks.Task``. It runs
on every peer and must build the same thing on each: same architecture, same initial
weights (seed them from ``options["seed"]``), same validation data. The example task:
tell which of three interleaved spirals a 2-D point belongs to, with a tiny MLP; its
data set is generated right here, so the file needs nothing else.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from p2ptrain.tasks import Task, seeded_generator

ARMS = 3


def spiral_points(count: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``count`` noisy points on ``ARMS`` spiral arms, and the arm of each: the data set."""
    arm = torch.randint(0, ARMS, (count,), generator=gen)
    radius = torch.rand(count, generator=gen)
    angle = radius * 4.0 + arm * (2 * math.pi / ARMS) + 0.15 * torch.randn(count, generator=gen)
    points = torch.stack([radius * torch.cos(angle), radius * torch.sin(angle)], dim=1)
    return points, arm


def make_task(options: dict) -> Task:
    """Called once per peer. ``options``: ``seed`` (int, equal on all peers), ``data`` (the
    ``--data`` path or None), ``model_size`` (``--model-size`` or None), ``batch_size``
    (``--batch-size`` or None; p2ptrain applies it for you), ``device`` (the ``--device`` spec)."""
    seed = options["seed"]

    # The model. Build it under a fixed seed so that every peer starts from the same weights
    # (a joining peer also receives the current weights, but equal starts cost nothing).
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(2, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, ARMS))

    # The data: a fixed training set and a fixed held-out set, identical on every peer.
    # A real task would load files here (options["data"]), the same files on every machine.
    train_points, train_arms = spiral_points(4000, seeded_generator(seed, "spirals-train"))
    val_points, val_arms = spiral_points(1000, seeded_generator(seed, "spirals-validation"))

    def train_batches(rank_seed: int, world_hint: int, batch_size: int, seed: int):
        """An endless iterator of batches for one peer. ``rank_seed`` differs between peers,
        so each draws its own random order; the same (seed, rank_seed) repeats the same
        batches. (``world_hint``, the number of peers expected, lets a task shard a data set
        instead: e.g. keep indices where index % world_hint == rank_seed % world_hint.)"""
        gen = seeded_generator(seed, rank_seed, "spirals-order")
        while True:  # endless: a new shuffled epoch each time round
            order = torch.randperm(len(train_points), generator=gen)
            for start in range(0, len(order) - batch_size + 1, batch_size):
                index = order[start:start + batch_size]
                yield train_points[index], train_arms[index]

    def loss(model: nn.Module, batch, device: torch.device) -> torch.Tensor:
        """Move the batch to the device; return the mean loss over it (a scalar tensor)."""
        points, arms = (t.to(device) for t in batch)
        return F.cross_entropy(model(points), arms)

    def batch_size_of(batch) -> int:
        """Samples in a batch: how much this peer's gradient weighs in the average."""
        return len(batch[0])

    def evaluate(model: nn.Module, device: torch.device) -> float:
        """Validation loss on the fixed held-out set; put the model's mode back as it was."""
        was_training = model.training
        model.eval()
        with torch.no_grad():
            value = F.cross_entropy(model(val_points.to(device)), val_arms.to(device)).item()
        model.train(was_training)
        return value

    def sample(model: nn.Module, device: torch.device) -> str:
        """Something to show at the end (generated text, an accuracy, ...); optional."""
        was_training = model.training
        model.eval()
        with torch.no_grad():
            predicted = model(val_points.to(device)).argmax(dim=1).cpu()
        model.train(was_training)
        return f"held-out accuracy {(predicted == val_arms).float().mean().item():.1%}"

    return Task(
        name="spirals",
        model=model,
        make_optimizer=lambda params, lr: torch.optim.Adam(params, lr=lr),  # (params, lr) -> optimizer
        default_lr=1e-2,            # the learning rate join trains with
        train_batches=train_batches,
        loss=loss,
        batch_size=64,              # per peer and step; --batch-size overrides it
        batch_size_of=batch_size_of,  # optional: the default reads the first tensor's first dimension
        evaluate=evaluate,          # optional (None): validation loss, logged now and then
        sample=sample,              # optional (None): shown when training ends
        info=f"spirals: MLP with {sum(p.numel() for p in model.parameters()):,} parameters, {ARMS} arms",
    )


if __name__ == "__main__":
    # A local self-check: what `join` does, minus the network.
    from p2ptrain.tasks import load_task, validate_task

    task = load_task(__file__, {"seed": 0})
    validate_task(task, "cpu")  # one dry-run batch: raises a one-line ConfigError on a mistake
    print(task.info)
    optimizer = task.make_optimizer(task.model.parameters(), task.default_lr)
    batches = task.train_batches(0, 1, task.batch_size, 0)
    print(f"before: validation loss {task.evaluate(task.model, torch.device('cpu')):.3f}")
    for step in range(300):
        optimizer.zero_grad()
        task.loss(task.model, next(batches), torch.device("cpu")).backward()
        optimizer.step()
    print(f"after 300 steps: validation loss {task.evaluate(task.model, torch.device('cpu')):.3f}; "
          f"{task.sample(task.model, torch.device('cpu'))}")
