"""Which linked peers the round machine hears of, and when a peer that nobody takes stops.

``Vetting`` is held by ``Cluster`` (``cluster.vetting``), the asyncio host of the round
machine; it reads no clock (the host hands it ``now``) and sends only through the state
transfer (``tell_model``: a peer of another model hears what differs). A peer whose handshake carries
another model digest is never handed to the machine: both sides log the first difference, and
a peer that has trained nothing yet stops with ``FingerprintError``.
So is a peer whose shared settings (compression, staleness, ...: ``settings``) differ from
ours, and a peer that has applied nothing and has no member stops with ``SettingsError``.
A peer below ``min_peers`` that every peer it knows refuses (a wrong secret) stops with
``GroupError``.

Call order: the mesh's ``on_admitted`` is ``admitted``, which posts the host's "connected"
event for a peer of our model and settings (its ``post``), "other_settings" for one of other
settings, and keeps both other kinds in ``foreign`` (linked, so not redialed; never a member:
the host drops their messages). The host's actor calls ``met_foreign`` when the state transfer
tells a peer of another model, ``other_settings`` for that event, and ``judge_foreign`` and
``give_up`` on every tick. Each of those returns the error that stops this peer, or None; the
host keeps the first (``Cluster.failure``) and says whether it has one (``failed``).
"""

from __future__ import annotations

import logging
from typing import Callable

from p2ptrain.net import auth
from p2ptrain.cluster import settings as shared_settings
from p2ptrain.errors import FingerprintError, GroupError, SettingsError
from p2ptrain.net.transport import hostport

log = logging.getLogger("p2ptrain.cluster.vetting")
REFUSED_GIVE_UP = 30.0  # seconds every peer we know may refuse us (a wrong secret) while we cannot train
FOREIGN_VERDICT = 3.0  # seconds a fresh peer that met another model looks for one of its own before it stops


class Vetting:
    """The peers of another model or settings, and the verdicts on them (see the module docstring)."""

    def __init__(self, peer_id: str, mesh, transfer, machine, settings: dict | None, post: Callable) -> None:
        self.peer_id, self.mesh, self.transfer, self.machine = peer_id, mesh, transfer, machine
        self._post = post  # the host's event queue: ``post(kind, *args)``
        self.settings = dict(settings or {})  # what every peer must share (``cluster.settings``)
        if settings:
            self.mesh.info["settings"] = self.settings
        self._refused: set[str] = set()  # peers refused for their settings, said once each
        self.foreign: set[str] = set()  # peers of another model: never handed to the machine
        self._foreign_met: dict[str, tuple[float, str]] = {}  # (met while fresh: since when, what differs)

    def admitted(self, peer: str, info: dict) -> None:
        theirs = info.get("model")
        if theirs is not None and "model" in self.mesh.info and theirs != self.mesh.info["model"]:
            self.foreign.add(peer)  # linked (so not redialed), never a member
            self.transfer.tell_model(peer)
            return
        diffs = shared_settings.differences(self.settings, info.get("settings"))
        if diffs:
            self.foreign.add(peer)  # (as a peer of another model)
            self._post("other_settings", peer, diffs)
            return
        self._post("connected", peer, info)

    def met_foreign(self, peer: str, diff: str, now: float) -> None:
        """The state transfer told ``peer`` of another model (``diff``: what differs)."""
        self._foreign_met.setdefault(peer, (now, diff))

    def judge_foreign(self, now: float, failed: bool) -> FingerprintError | None:
        """Peers of another model met: one that has trained nothing and found no peer of its own
        model FOREIGN_VERDICT seconds on stops (the mistake is most likely its own; peers started
        together meet the odd one out while fresh, some before each other); any other goes on."""
        if not self._foreign_met:
            return None
        failure = None
        fresh = self.machine.version == 0 and not [p for p in self.machine.table.live_synced() if p != self.peer_id]
        for peer, (since, diff) in list(self._foreign_met.items()):
            if fresh and now - since < FOREIGN_VERDICT:
                continue
            del self._foreign_met[peer]
            text = f"peer {peer} trains another model ({diff}); it is not admitted"
            if not fresh:
                log.error("%s; this peer keeps training with the others", text)
            elif not failed and failure is None:
                failure = FingerprintError(f"{text}: start every peer with the same model (join: the same "
                                           "--task and --model-size)")
                log.error("%s", failure)
        return failure

    def give_up(self, now: float, members: int, failed: bool) -> GroupError | None:
        """Below ``min_peers`` (``members``: live synced peers, us included), with every peer we
        know refusing our handshake for a setting (a wrong secret, another cluster) for
        REFUSED_GIVE_UP seconds: nobody will take us, so stop
        (``GroupError``, the owner's to raise) rather than wait, dialing, forever. (The mesh says
        each refusal once, with what to do.) A peer that can train alone goes on."""
        refusing = self.mesh.refusing()
        if refusing is None or failed or members >= self.machine.config.min_peers:
            return None
        since, reasons = refusing
        if now - since >= REFUSED_GIVE_UP:
            fixes = sorted({fix for reason in reasons if (fix := auth.advice(reason))})
            where = ", ".join(hostport(h, p) for h, p in sorted(self.mesh.refused))
            return GroupError(f"every peer this one knows ({where}) refused it for {REFUSED_GIVE_UP:.0f} s "
                              f"({'; '.join(reasons)}): {'; '.join(fixes)}")
        return None

    def other_settings(self, peer: str, diffs: list[str], applied: int) -> SettingsError | None:
        """A peer with other shared settings: a peer that has applied nothing (``applied``: rounds
        applied here) and has no member stops (its owner raises the one line); one that trains
        with others says it once."""
        text = shared_settings.refusal(peer, diffs)
        if applied == 0 and not [p for p in self.machine.table.live_synced() if p != self.peer_id]:
            return SettingsError(text)
        elif peer not in self._refused:
            self._refused.add(peer)
            log.error("%s; this peer keeps training with the others", text)
        return None
