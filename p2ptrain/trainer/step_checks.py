"""What ``step`` refuses before it takes a batch, each with what to do instead: a ``batch_size``
that is not a count of samples (``sample_count``), a batch without gradients or parameters
frozen or unfrozen since the peer was made (``Trainable``), and, while the peer is open, the
training loop's own ``optimizer.step()`` (``StepGuard``; the peer's own steps run inside
``peer_steps``). Each of these once trained on, silently wrong."""

from __future__ import annotations

import contextlib
import operator
import threading
from typing import Iterator

import torch

from p2ptrain.errors import ConfigError

_stepping = threading.local()  # ``on``: this thread is inside ``peer_steps`` (the peer's own step)


def sample_count(batch_size) -> int:
    """``step``'s ``batch_size`` as an int: any integer, numpy's or a 0-d integer tensor's too
    (``mask.sum()``), but not a bool, a float or a string."""
    try:
        count = None if isinstance(batch_size, bool) else operator.index(batch_size)
    except TypeError:
        count = None
    if count is None or count < 1:
        raise ConfigError(f"batch_size must be an int >= 1 (the samples in this batch), got {batch_size!r}")
    return count


class Trainable:
    """The parameters that train: those with ``requires_grad`` when the peer was made, whose
    gradients travel as one buffer on every peer. One unfrozen since (fine-tuning's unfreezing)
    stepped on this peer's own gradient, one frozen since on the others' average, and the
    replicas parted without a word. ``check`` costs about 20 us for 300 tensors."""

    def __init__(self, module: torch.nn.Module):
        self.module = module
        self.params = [p for p in module.parameters() if p.requires_grad]
        self._frozen = [p for p in module.parameters() if not p.requires_grad]

    def check(self) -> None:
        """Raise ``ConfigError`` if this batch left no gradient (its samples would count as a
        zero gradient) or the parameters that train are not those of the peer's making."""
        if all(p.grad is None for p in self.params):
            raise ConfigError("step() found no gradient on any parameter: call loss.backward() on this batch first")
        if all(p.requires_grad for p in self.params) and not any(p.requires_grad for p in self._frozen):
            return
        names = {id(p): name for name, p in self.module.named_parameters()}
        thawed = [names[id(p)] for p in self._frozen if p.requires_grad]
        what = (f"parameter {thawed[0]!r} was unfrozen" if thawed else
                f"parameter {next(names[id(p)] for p in self.params if not p.requires_grad)!r} was frozen")
        raise ConfigError(f"{what} after the peer was made, and the peers train the parameters that required "
                          "gradients then: to change which train, save peer.state_dict(), close the peer, set "
                          "requires_grad, and make a new one that loads it (on every peer)")


class StepGuard:
    """While a peer is open, ``optimizer.step()`` is the peer's to call: a step of the training
    loop's own (the habit of a plain or DDP loop) would apply this peer's gradients alone, and
    the replicas would part without a word. Refused before anything changes."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self._handle = optimizer.register_step_pre_hook(self._check)

    @staticmethod
    def _check(optimizer, args, kwargs) -> None:
        if not getattr(_stepping, "on", False):
            raise ConfigError("optimizer.step() was called while its peer is open: peer.step(batch_size=...) "
                              "averages the gradients and steps the optimizer itself, so drop your "
                              "optimizer.step() (AMP's scaler.step calls it too: give GradScaler a "
                              "p2ptrain.DistributedOptimizer instead; close the peer first to train alone)")

    def close(self) -> None:
        self._handle.remove()


@contextlib.contextmanager
def peer_steps() -> Iterator[None]:
    """The peer's own ``optimizer.step()`` calls, which ``StepGuard`` lets through."""
    _stepping.on = True
    try:
        yield
    finally:
        _stepping.on = False
