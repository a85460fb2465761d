"""Which peers are silent: stopped (a laptop's lid, SIGSTOP) or unplugged. Pure code, no I/O.

Keepalives come every 2 s on every link (``net.mesh.KEEPALIVE``), so a live peer is never
silent for long; a stopped or unplugged one is, while its links may stay open. The round
machine's parts act on that without waiting for ``--peer-timeout`` to mark it dead: a round we
lead leaves a silent member out, a takeover does not wait for a silent candidate's STATUS, a
joiner silent mid-download holds the boundary no more (``leader``), a joiner gives up a donor
silent mid-download and asks another (``Cluster``), and members give up a silent leader, and
the next peer to lead while it is as silent (``member``). Unsynced, not dead:
its links stay, and it shows its state when it runs again.
"""

from __future__ import annotations


def silence(config) -> float:
    """Seconds without a frame after which a peer is silent: half the peer timeout, the gap a
    peer takes for its own stillness (``RoundMachine._notice_stillness``), at least a phase's
    ``floor``. A member computing a slow batch still pings."""
    return max(config.floor, config.peer_timeout / 2)


def quiet_for(machine, peer: str, now: float) -> float:
    """Seconds ``peer`` has sent nothing while we listened (since ``listening_since``: after a
    gap in our own events, frames wait unread in our sockets)."""
    return now - max(machine.table.get(peer).last_heard, machine.listening_since)


def silent(machine, peers, now: float) -> list[str]:
    """Those of ``peers`` silent for ``silence`` seconds, sorted (never ourselves or a stranger)."""
    limit = silence(machine.config)
    return sorted(p for p in peers if p != machine.id and machine.table.get(p) is not None
                  and quiet_for(machine, p, now) > limit)
