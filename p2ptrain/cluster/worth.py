"""Which member costs the cluster more time than its samples bring. Pure code, no I/O.

The leader knows, for every round it commits, when each member's READY came (seconds after the
proposal) and the samples each brought. A round's collecting ends with the last READY; without
its last member it would have ended with the one before: the time the round was *held* for that
member. Its samples are worth, in the others' time, what the others take to compute as many: its
samples over the others' samples per second in the same rounds made as long as they would be
without it (each less its hold). Over its last ``WINDOW`` rounds,
a member that held them more in all than its samples are worth, and at least ``MIN_HELD_S``, slows
the cluster: ``Worth.round`` returns the one line the leader logs, once; it is said again only
after the member paid for itself over a whole window (or left).

The line says what to do (``ADVICE``). (A member waited for costs the others their update rate
even where they compute meanwhile, so held time is the cost counted.)

Call order: ``Leader.on_ready`` keeps each READY's time; at COMMIT the leader calls ``round``
with the round's view, and logs what it returns; ``forget`` when a member leaves.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

WINDOW = 20  # rounds a member is judged over
MIN_HELD_S = 5.0  # held less than this in all over a window: not worth a line
ADVICE = ("let it leave, or train in local-steps mode by time (--sync-every auto, or a window such as 2s), "
          "where each peer takes the steps that fit in a round and nobody waits for a count of them")


@dataclass(frozen=True)
class _Round:
    held: float  # seconds the round waited for this member after every other READY was in
    samples: int  # its samples in the round
    others: int  # the other members' samples
    seconds: float  # the round, from its proposal to its commit


class Worth:
    """Each member's last ``window`` rounds, and whom a line was said of (see the module docstring)."""

    def __init__(self, window: int = WINDOW, min_held: float = MIN_HELD_S):
        self.window, self.min_held = window, min_held
        self._rounds: dict[str, deque] = {}
        self._said: set[str] = set()

    def round(self, ready_at: dict[str, float], samples: dict[str, int], seconds: float) -> str | None:
        """One committed round of two or more members: ``ready_at`` (seconds from its proposal to
        each member's READY), ``samples`` (each one's), ``seconds`` (proposal to commit). Returns
        the line to log about a member that slows the cluster (the first such), or None."""
        if len(ready_at) < 2 or seconds <= 0:
            return None
        line = None
        total = sum(samples.get(p, 0) for p in ready_at)
        for peer, at in sorted(ready_at.items()):
            before = max(t for p, t in ready_at.items() if p != peer)
            mine = samples.get(peer, 0)
            kept = self._rounds.setdefault(peer, deque(maxlen=self.window))
            kept.append(_Round(max(0.0, at - before), mine, total - mine, seconds))
            said = self._judge(peer, kept)
            line = line or said
        return line

    def forget(self, peer: str) -> None:
        """``peer`` left: its rounds and whether it was said of go with it."""
        self._rounds.pop(peer, None)
        self._said.discard(peer)

    def _judge(self, peer: str, kept: deque) -> str | None:
        if len(kept) < self.window:
            return None
        held = sum(r.held for r in kept)
        mine, others, seconds = (sum(getattr(r, k) for r in kept) for k in ("samples", "others", "seconds"))
        rate = others / max(seconds - held, 1e-9)  # the others' samples per second, without waiting for it
        worth = mine / rate if rate > 0 else float("inf")
        if held < self.min_held or held <= worth:
            self._said.discard(peer)  # (paid for itself: a relapse is said again)
            return None
        if peer in self._said:
            return None
        self._said.add(peer)
        return (f"peer {peer} held the last {len(kept)} rounds {held:.1f} s in all for {mine} samples, worth "
                f"{worth:.1f} s of the others' training: it slows the cluster; {ADVICE}")
