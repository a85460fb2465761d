"""Which peers are silent: stopped (a laptop's lid, SIGSTOP) or unplugged. Pure code, no I/O.

Keepalives come every half second on every link (``net.wire.KEEPALIVE``), so a live peer is
never silent for long; a stopped or unplugged one is, while its links may stay open. The round
machine's parts act on that without waiting for ``--peer-timeout`` to mark it dead: a round we
lead leaves a silent member out, a takeover does not wait for a silent candidate's STATUS, a
joiner silent mid-download holds the boundary no more (``leader``), a joiner gives up a donor
silent mid-download and asks another (``Cluster``), and members give up a silent leader, and
the next peer to lead while it is as silent (``member``). Unsynced, not dead:
its links stay, and it shows its state when it runs again.

Why 2.5 s (a quarter of the default peer timeout): every silence is a gap in the rounds of all
the others (a lid closed, a cable pulled), so it is kept short, yet five keepalives long, so
that a live peer on a loaded machine is not left out for a late one. A process notices its own
stillness a keepalive sooner (``stillness``): a peer the others found silent (its last frame
up to a keepalive before it stopped) finds it stood still, and a round it led is void, not
committed on the answers that waited in its sockets meanwhile.
"""

from __future__ import annotations

from p2ptrain.net.wire import KEEPALIVE

SILENT_AFTER = 2.5  # seconds without a frame: silent (the least; a quarter of --peer-timeout if longer)


def silence(config) -> float:
    """Seconds without a frame after which a peer is silent: a quarter of the peer timeout, at
    least ``SILENT_AFTER``. A member computing a slow batch still pings."""
    return max(SILENT_AFTER, config.peer_timeout / 4)


def stillness(config) -> float:
    """The gap between this process's own events past which it stood still (a lid closed,
    SIGSTOP: ``RoundMachine._notice_stillness``): a keepalive less than ``silence``."""
    return silence(config) - KEEPALIVE


def quiet_for(machine, peer: str, now: float) -> float:
    """Seconds ``peer`` has sent nothing while we listened (since ``listening_since``: after a
    gap in our own events, frames wait unread in our sockets)."""
    return now - max(machine.table.get(peer).last_heard, machine.listening_since)


def speaks(machine, peer: str, now: float) -> bool:
    """Whether ``peer`` was heard within ``silence`` less two keepalives while we listened: it
    is not the silent one a takeover replaces (a candidate gives it up after ``silence``; its
    keepalives to us and to the candidate go on separate links, up to a keepalive apart)."""
    last = machine.table.get(peer).last_heard
    return last >= machine.listening_since and now - last < lately(machine.config)


def lately(config) -> float:
    """Seconds within which a peer heard is surely not the silent one (``speaks``)."""
    return silence(config) - 2 * KEEPALIVE


def silent(machine, peers, now: float) -> list[str]:
    """Those of ``peers`` silent for ``silence`` seconds, sorted (never ourselves or a stranger)."""
    limit = silence(machine.config)
    return sorted(p for p in peers if p != machine.id and machine.table.get(p) is not None
                  and quiet_for(machine, p, now) > limit)
