"""Local-steps mode (DiLoCo): the outer loop of one peer, on the model's device.

Between rounds each peer takes inner steps with the user's optimizer on its own batches.
A round averages the *pseudo-gradient*, the parameter change not contributed yet
(``base - params``), weighted by samples, through the ring like a gradient (any codec,
error feedback); every peer then applies the same outer step, SGD with Nesterov momentum,
to the same *outer parameters*, so those stay bit-identical on every replica while the
inner optimizer's state stays local (Douillard et al., 2023: lr 0.7, momentum 0.9).

One round late. A peer forms its contribution once it has taken ``every`` inner steps since
the last one (``due``), or by time once ``window_s`` seconds passed since the last one (a fast
device then takes many inner steps a round, a slow one few: ``round_window``), and its previous
one is applied, then steps on while the ring runs
(at staleness >= 1; at 0 ``step`` waits for the round). When the outer update lands, the
progress made since the contribution is kept on top of the new outer parameters::

    params <- outer_new + (params - base);  base <- outer_new

``base`` is where uncontributed progress is measured from: the contributed point while a
contribution is out, the outer parameters otherwise. Every inner step is contributed
exactly once, and a peer that contributed nothing to a round (it was not stepping) keeps
its progress for a later one. A faster device takes more inner steps per round: it steps
on while the round waits for the slower peers' ``every`` steps.

Memory: three more copies of the trainable parameters (outer, base, momentum); they must be
float32 (``AsyncPeer`` says so).
Calls come from the peer with its state's ``params_lock`` held (no forward or backward runs).
"""

from __future__ import annotations

import itertools
import logging

import numpy as np
import torch

from p2ptrain.cluster.sync_every import parse_sync_every
from p2ptrain.switches import env_switch
from p2ptrain.trainer import _local_kernels
from p2ptrain.trainer.round_window import auto_window
from p2ptrain.trainer.flat import param_starts, param_views
from p2ptrain.trainer.finite import all_finite

log = logging.getLogger("p2ptrain.trainer.peer")  # (the peer's lines, under the peer's name)
LOOKAHEAD_ENV = "P2PTRAIN_LOOKAHEAD"  # 0 or 1: ``LocalSteps.lookahead`` off or on (default: on for rounds by time)
WHOLE_ENV = "P2PTRAIN_OUTER_WHOLE"  # 0 or 1: ``LocalSteps.whole`` off or on by time (default: off; measured there)


def local_steps(params: list[torch.Tensor], sync_every, outer_lr: float, outer_momentum: float,
                optimizer: torch.optim.Optimizer) -> LocalSteps | None:
    """The outer state for ``AsyncPeer``'s ``sync_every`` (checked: ``options``); None: gradient mode."""
    if sync_every is None:
        return None
    every = parse_sync_every(sync_every)
    window = auto_window(None, None, 0.0) if every.auto else every.seconds
    local = LocalSteps(params, every.steps, outer_lr, outer_momentum, optimizer, window_s=window, auto=every.auto)
    local.lookahead = env_switch(LOOKAHEAD_ENV, every.by_time)  # (measured: ``_look_ahead``)
    local.whole = outer_whole(sync_every)
    return local


def outer_whole(sync_every) -> bool:
    """Whether a round's largest contribution counts whole (``LocalSteps.divisor``, measured
    there): by time with ``P2PTRAIN_OUTER_WHOLE=1`` (a setting every peer shares); by count every
    member takes the same steps, and the plain mean is DiLoCo's."""
    return sync_every is not None and parse_sync_every(sync_every).by_time and env_switch(WHOLE_ENV, False)


class LocalSteps:
    """The outer state: ``outer`` parameters, their Nesterov ``velocity``, and ``base``."""

    def __init__(self, params: list[torch.Tensor], every: int | None, lr: float, momentum: float,
                 inner: torch.optim.Optimizer | None = None, window_s: float | None = None, auto: bool = False):
        self.params, self.every, self.lr, self.momentum = params, every, lr, momentum
        # Rounds by time (``every`` None): a contribution once ``window_s`` seconds passed since the
        # last (``round_window``); ``auto``: the peer sets the window at each contribution.
        self.window_s, self.auto = window_s, auto
        self.lookahead = False  # rebase local progress onto the next step's momentum (``_look_ahead``; on by time)
        self.whole = False  # the round's largest contribution counts whole (``divisor``; ``outer_whole``)
        self.inner = inner  # the user's optimizer: its state is cleared where the inner steps diverge
        numel = sum(p.numel() for p in params)
        device = params[0].device
        self._outer = torch.empty(numel, dtype=torch.float32, device=device)
        self._base = torch.empty_like(self._outer)
        self._velocity = torch.zeros_like(self._outer)
        self.outer, self.base, self.velocity = (param_views(t, self.params) for t in (self._outer, self._base, self._velocity))
        self.steps = self.samples = 0  # inner steps and their samples since the last contribution
        starts = param_starts(params)
        self._spans = list(zip(starts, starts[1:]))  # each parameter's range in the flat vectors
        self._kernels = _local_kernels.load() if device.type == "cpu" else None  # (``_compiled``)
        if self._kernels is not None:
            _local_kernels.warm()  # (now, not in the first round)
        self.reset()

    def _compiled(self, *tensors: list[torch.Tensor]):
        """The compiled kernels, where they can run on these tensors (float32, contiguous, on
        the CPU: a parameter may have been replaced since), else None: torch's passes."""
        k = self._kernels
        if k is None or not all(t.dtype == torch.float32 and t.is_contiguous() and t.device.type == "cpu"
                                for t in itertools.chain(*tensors)):
            return None
        return k

    def _live(self) -> list[torch.Tensor]:
        return [p.detach() for p in self.params]

    def reset(self, velocity: torch.Tensor | None = None) -> None:
        """The model's parameters are the outer ones now (start, a state loaded): no progress
        is owed, and the momentum is ``velocity`` (a snapshot's; None: zero)."""
        with torch.no_grad():
            torch._foreach_copy_(self.outer, self._live())
            self._base.copy_(self._outer)
            if velocity is None:
                self._velocity.zero_()
            else:
                self._velocity.copy_(velocity.reshape(-1).to(self._velocity.device, torch.float32))
        self.steps = self.samples = 0

    def stepped(self, batch_size: int) -> None:
        """The user's optimizer took one inner step on ``batch_size`` samples."""
        self.steps += 1
        self.samples += batch_size

    def due(self) -> bool:
        """(By count) ``every`` inner steps are owed; by time the peer asks ``pseudo_gradient_due``."""
        return self.every is not None and self.steps >= self.every

    def contribute(self, into: list[torch.Tensor] | None = None) -> tuple[list[torch.Tensor] | None, int]:
        """The pseudo-gradient owed (``base - params``, one tensor per parameter) and its samples;
        the contributed point becomes ``base``. None for the pseudo-gradient where the inner steps
        diverged (NaN or inf): no codec carries it, and every later change would carry it on, so
        the model starts again from the outer parameters and the inner optimizer from no state
        (one flag read back a contribution, once per round). ``into``: tensors shaped as the
        parameters to write it in, weighted (``samples x`` it: an empty sum's, which
        ``Accumulator.begin_writing`` gave), where a new one would cost as much again as the
        subtraction (a CPU faults in fresh pages: 13 ms for 40 MB)."""
        live, samples = self._live(), self.samples
        with torch.no_grad():
            k = self._compiled(live, into) if into is not None else None
            if k is not None:  # (one pass: the difference, its check, the weighting and the new base)
                base, weight = self._base.numpy(), np.float32(samples)
                finite = True
                for (a, b), d, p in zip(self._spans, into, live):
                    finite &= k.pseudo_gradient(base[a:b], p.view(-1).numpy(), d.view(-1).numpy(), weight)
                delta = into
            else:
                if into is None:
                    delta = torch._foreach_sub([b for b in self.base], live)
                else:  # (the same list: ``Accumulator.add_weighted`` knows its views by it)
                    for d, b, p in zip(into, self.base, live):
                        torch.sub(b, p, out=d)
                    delta = into
                finite = all_finite(delta)
                if finite:
                    torch._foreach_copy_(self.base, live)
                    if into is not None:
                        torch._foreach_mul_(delta, float(samples))
            if not finite:
                torch._foreach_copy_(live, self.outer)
                self._base.copy_(self._outer)
                if self.inner is not None:
                    self.inner.state.clear()
        self.steps = self.samples = 0
        if not finite:
            log.warning("the inner steps diverged (NaN or inf in the parameters after %d samples): they are left "
                        "out, and this peer starts again from the outer parameters with its optimizer's state "
                        "cleared; if it recurs, lower the learning rate or check the data", samples)
            return None, samples
        return delta, samples

    def divisor(self, total: int, spread: tuple | None) -> float:
        """What a round's weighted sum is divided by: its ``total`` samples, or with ``whole`` on,
        ``squares / largest`` of the members' samples (``roundmsg.spread_of``), which scales the
        mean by ``s = largest * total / squares``: 1 for members alike, up to their count. A
        round's mean weights each change by its samples, so beside a member 10x slower by time the
        fastest one's change counts 10/11 and the other's few steps fill the rest: a pair makes
        less progress a round than the fast peer alone would (0.92 of it where every step moves
        the model alike). Scaled, the mean moves as far as the fastest member's change whole,
        in the direction of all of them; equal members' changes are averaged as before (summing
        them instead diverged: bench/README, "The outer step, by regime"). Off by default, since
        it pays in one regime only (``bench/uneven.py --outer-whole 0|1``, paired runs; bench/README,
        "A round's fastest member counted whole"): a CPU pair at batch 64 reached the target in a
        mean 0.74x and 0.78x the fast peer's time alone beside a peer 3.7x and 10x slower, against
        0.79x and 0.82x with the plain mean (seven runs each), but the 9 M model in a GPU's regime
        took 1.10-2.03x against 0.91-1.16x (three runs, 3.7x), and a pair at batch 8 ended higher
        in four runs of four. ``spread`` None (not known): ``total``."""
        if not self.whole or spread is None:
            return float(total)
        largest, squares = spread
        return squares / largest

    def apply(self, mean_delta: torch.Tensor) -> None:
        """The round's averaged pseudo-gradient (flat, float32, on the device; it is overwritten):
        the outer Nesterov step (as ``torch.optim.SGD(nesterov=True)``), then local progress
        rebased onto it."""
        g, v, outer, mu = mean_delta, self._velocity, self._outer, self.momentum
        live = self._live()
        k = self._compiled(live, [g])
        if k is not None:  # (one pass per parameter, the same floats: ``_local_kernels``)
            gn, vn, on, bn = (t.numpy() for t in (g, v, outer, self._base))
            mu32, neg_lr = np.float32(mu), np.float32(-self.lr)
            for (a, b), p in zip(self._spans, live):
                k.outer_step(gn[a:b], vn[a:b], on[a:b], bn[a:b], p.view(-1).numpy(), mu32, neg_lr, bool(mu))
        else:
            with torch.no_grad():
                if mu:
                    v.mul_(mu).add_(g)
                    g.add_(v, alpha=mu)  # (the ring's mean is ours to use in place: no new vector a round)
                outer.sub_(g, alpha=self.lr)
                torch._foreach_sub_(live, self.base)  # progress since the contribution (0 if none) ...
                torch._foreach_add_(live, self.outer)  # ... on top of the new outer parameters
                self._base.copy_(outer)
        if self.lookahead and mu:
            self._look_ahead()

    def _look_ahead(self) -> None:
        """Local progress rebased onto where the next outer step's momentum alone takes the outer
        parameters (``outer - lr mu^2 v``: the part of that step known now), so the inner steps of
        the next round, whose change lands one round late, are taken about where it will land;
        ``base`` moves with them, so the next pseudo-gradient holds inner progress only and the
        outer parameters, identical on every replica, do not move. On for rounds by time
        (``P2PTRAIN_LOOKAHEAD=0`` turns it off): measured (``python bench/uneven.py --model 1m
        --slow 3.7,10 --reps 2 --runs "...--sync-every auto;... auto --lookahead"``, int8,
        staleness 1, 2 quiet cores), the pair reached the loss in 0.73x and 0.81x the fast
        peer's time alone beside a peer 3.7x slower (without: 1.01x, 0.89x), 0.96x and 1.00x
        beside one 10x slower (1.13x, 1.08x), and its loss after 100,000 samples was 0.978-0.995
        of synchronous fp32's (without: 0.967-1.015)."""
        with torch.no_grad():
            shift = self._velocity * (-self.lr * self.momentum * self.momentum)
            self._base.add_(shift)
            torch._foreach_add_(self._live(), param_views(shift, self.params))

    def shift(self, outer: list[torch.Tensor], velocity: torch.Tensor | None) -> None:
        """The leader's outer state at the same point (ours differs by rounding: another device
        kind): everything here moves by the difference, so no progress is lost."""
        with torch.no_grad():
            diff = torch._foreach_sub([o.to(self._outer.device, torch.float32) for o in outer], self.outer)
            for views in (self.outer, self.base, self._live()):
                torch._foreach_add_(views, diff)
            if velocity is not None:
                self._velocity.copy_(velocity.reshape(-1).to(self._velocity.device, torch.float32))

    def finish(self) -> None:
        """Leaving: the model ends on the outer parameters, identical on every replica."""
        with torch.no_grad():
            torch._foreach_copy_(self._live(), self.outer)
        self._base.copy_(self._outer)
        self.steps = self.samples = 0

    def state_dict(self, model: torch.nn.Module) -> dict:
        """``model.state_dict()`` with the outer parameters in place of the local ones."""
        state = model.state_dict()
        state.update(self.named_outer(model, remove_duplicate=False))
        return state

    def named_outer(self, model: torch.nn.Module, remove_duplicate: bool = True):
        """``model.named_parameters()``, the trainable ones replaced by their outer values."""
        index = {id(p): i for i, p in enumerate(self.params)}
        for name, p in model.named_parameters(remove_duplicate=remove_duplicate):
            yield name, self.outer[index[id(p)]] if id(p) in index else p

    def velocity_state(self) -> torch.Tensor:
        return self._velocity.detach().clone()
