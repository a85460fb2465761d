"""A peer alone (``cluster.trainer_api.SoloTrainer``): the round its next batch applied at once
will be committed as, the batches applied and not committed yet, and the version where that
stops. Pure bookkeeping: ``state.TrainerState`` holds one, used under its ``lock``; the caller's
thread lists batches (``applied``), the cluster's thread starts it (``begin``), takes the list
(``take``) and stops it (``stop``)."""

from __future__ import annotations


class SoloLane:
    """See the module docstring. ``on``: batches are applied at once now."""

    def __init__(self):
        self.next_round: int | None = None  # the round of the next batch applied alone (None: not alone)
        self.last_version = 0  # the cluster's last version (0: none): no batch alone goes past it
        self.listed: list[tuple[int, int, float]] = []  # (round, samples, wall time) applied, not committed
        self.flush = False  # stopped here at the last version: step waits until the run is over

    @property
    def on(self) -> bool:
        return self.next_round is not None

    def begin(self, r: int, last_version: int) -> None:
        self.next_round, self.last_version, self.flush = r, last_version, False

    def stop(self) -> None:
        self.next_round = None

    def applied(self, samples: int, version: int, when: float) -> tuple[int, bool]:
        """A batch of ``samples`` was applied at once (the parameters are at ``version`` now):
        listed under its round. Returns that round, and whether it was the run's last version
        (then this lane stops, and ``flush`` says the cluster must commit and end the run)."""
        r = self.next_round
        if r is None:
            raise RuntimeError("a batch applied alone while not alone")  # our bug
        self.next_round = r + 1
        self.listed.append((r, samples, when))
        last = bool(self.last_version) and version >= self.last_version
        if last:
            self.next_round, self.flush = None, True
        return r, last

    def take(self) -> list[tuple[int, int, float]]:
        """The batches listed so far, handed over (the cluster commits their rounds)."""
        listed, self.listed = self.listed, []
        return listed
