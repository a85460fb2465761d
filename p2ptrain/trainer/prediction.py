"""Weight prediction: compute each batch where the parameters will be when it is applied.

At staleness >= 1 a batch computed on version v is applied on top of version v + 1: its
gradient is one update late. With Adam and a learning rate near the edge of stability that
delay makes the loss jump and recover slowly (on the synthetic 10 M task, 77 updates to
reach a loss of 1.0 instead of 23 undelayed). Consecutive updates of a momentum optimizer
point nearly the same way, so the next parameters are well predicted by the last update
repeated: between steps the model holds ``w + Δ`` (``Δ``: the last update applied), and
the gradient computed there is nearly the one at ``w + Δ_next`` (there, 45 updates).
This is the weight prediction of PipeMare and SpecTrain, for one update in flight.

The true parameters ``w`` are kept in a copy and put back before anything that must see
them: an update (so every member applies the same update to bit-identical parameters), a
checksum, a snapshot, ``state_dict``, closing. Costs two more copies of the trainable
parameters on the model's device and four passes over them per update (``before_update``
after a prediction swaps the two copies instead of copying: 1 M parameters, one core, 1.55 ->
1.25 ms an update). Only while the member overlaps (``pacing``): in lockstep no batch is
late, and the passes cost more than the lookahead gives (2 cores, host idle 8 ms a batch: 15 %
fewer samples/s for 6 % fewer rounds to the loss); there the model holds the true parameters
(``pause``) and the rounds are staleness 0's.
"""

from __future__ import annotations

import torch


class WeightPredictor:
    """Holds the true parameters while the model holds the predicted ones (``predicted``).

    Calls, all with the state's ``params_lock`` held (no forward or backward runs): before
    each update ``before_update``; after the last of a run of updates ``predict`` (instead of
    both, ``pause`` where nothing is to be predicted); after a
    state load ``forget`` (the loaded parameters are true, and no update led to them);
    ``restore`` to leave the model on the true parameters."""

    def __init__(self, params: list[torch.Tensor]):
        self.params = params
        with torch.no_grad():
            self._true = [p.detach().clone() for p in params]
            self._before = [p.detach().clone() for p in params]  # the parameters before the last update
        self.predicted = False  # the model holds true + delta
        self._updated = False  # an update ran since the last predict or forget

    def before_update(self) -> None:
        if self.predicted:  # (restored, the true copies hold what the parameters hold: they are ``_before``)
            self.restore()
            self._true, self._before = self._before, self._true
        else:
            with torch.no_grad():
                torch._foreach_copy_(self._before, [p.detach() for p in self.params])
        self._updated = True

    def predict(self) -> None:
        """The model's parameters are true and the last update led to them: move them one update on."""
        if not self._updated:
            return
        self._updated = False
        now = [p.detach() for p in self.params]
        with torch.no_grad():
            torch._foreach_sub_(self._before, now)  # before - now = -delta
            torch._foreach_copy_(self._true, now)
            torch._foreach_sub_(now, self._before)  # now + delta
        self.predicted = True

    def restore(self) -> None:
        if self.predicted:
            with torch.no_grad():
                torch._foreach_copy_([p.detach() for p in self.params], self._true)
            self.predicted = False

    def pause(self) -> None:
        """No prediction for now (the batches are not late): the model holds the true
        parameters, and the next ``predict`` waits for an update that follows ``before_update``."""
        self.restore()
        self._updated = False

    def forget(self) -> None:
        """The parameters were just loaded: they are true, and there is no last update."""
        self.predicted = self._updated = False

    def true_state_dict(self, model: torch.nn.Module) -> dict:
        """``model.state_dict()`` with the true parameters in place of the predicted ones."""
        state = model.state_dict()
        if self.predicted:
            index = {id(p): i for i, p in enumerate(self.params)}
            for name, p in model.named_parameters(remove_duplicate=False):
                if id(p) in index:
                    state[name] = self._true[index[id(p)]]
        return state
