"""Lines about the messages of linked peers that we refuse: at most one a peer a minute. Pure.

A peer that knows the secret may still send round messages we refuse (malformed, impossible):
each is dropped, and the warning that says so names the peer. A flood of them was a warning a
message, at the flood's rate; now it is one line a peer a minute, with the count since.
"""

from __future__ import annotations

EVERY_S = 60.0  # seconds between two lines about one peer's refused messages
MAX_PEERS = 1024  # peers remembered (authenticated ids; past this the memory starts over)


class FaultLog:
    """Call ``refused`` for each refused message; log a line only when it returns a count."""

    def __init__(self, every: float = EVERY_S) -> None:
        self.every = every
        self._said: dict[str, tuple[float, int]] = {}  # peer -> (when its last line was, refused since)

    def refused(self, peer: str, now: float) -> int | None:
        """A message of ``peer`` refused at ``now``: the number refused since its last line when
        a line is due now (0 for its first), else None (counted for the next line)."""
        said = self._said.get(peer)
        if said is not None and now - said[0] < self.every:
            self._said[peer] = (said[0], said[1] + 1)
            return None
        if said is None and len(self._said) >= MAX_PEERS:
            self._said.clear()
        self._said[peer] = (now, 0)
        return 0 if said is None else said[1]
