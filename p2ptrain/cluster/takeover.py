"""Taking the lead: whether this peer may, and its decisions on attempts in doubt. Pure code, no I/O.

``Takeover`` is held by the leader part of the round machine (``machine.leader.takeover``,
``p2ptrain.cluster.leader``). It owns the back-off from a rival leader and the decisions this
peer took as leader (attempt -> committed). It reads the machine's ``table``, ``lineage``,
``member`` and attempt log (``_log``), and sends through it (``_send``). The leader asks
``may_lead`` on a tick while it leads nothing, calls ``back_off`` when a rival supersedes it,
``refused`` when a member refuses its QUERY, ``peer_gone`` when a peer is lost, ``decide`` when
it commits or aborts a running round (``decision`` answers a late READY), and ``resolve`` once
its QUERY is answered; the lineage calls ``resolve`` for a member in doubt that obeys us.

Ballots. A leader holds b = (epoch, its id). A member obeys the best ballot it has seen
(higher epoch; on a tie the smaller id) and answers a worse one with NACK, so two peers that
lead "for a moment" resolve deterministically and the loser steps down. A new leader takes a
fresh epoch and first asks every candidate for its STATUS (QUERY): once a member answered,
the old leader's COMMIT no longer reaches it (fencing). An attempt left in doubt by a lost
leader commits where a survivor already committed it and aborts everywhere else; a leader's
decision, once taken, is final. A member refuses the QUERY of a peer its table shows out of
the cluster while its own leader leads it (``Member._led_on``), as Raft's followers refuse a
vote while their leader is live: a peer back from a cut cable, its link to that leader quiet a
while longer (TCP's back-off), found the leader silent and deposed it for its newer epoch.

Who leads. The smallest live synced peer (``PeerTable.coordinator``), on a tick, once it heard
who else is synced. A leader superseded by a rival it does not see as synced backs off for
``query_timeout`` instead of flip-flopping with it every round; the back-off ends as soon as
that rival is lost (link lost, goodbye, silent), so that a rival that dies costs a tick.
"""

from __future__ import annotations

from collections import OrderedDict

from p2ptrain.cluster.membership import SYNCED, History
from p2ptrain.cluster.roundmsg import ABORT, COMMIT, RING, RINGED, Status, with_used


class Takeover:
    """Whether we may take the lead, and what we decided as leader (see the module docstring)."""

    def __init__(self, machine) -> None:
        self.machine = machine  # the RoundMachine whose leader holds us
        self._decided: OrderedDict = OrderedDict()  # attempt -> committed, as decided by us as leader
        self._rival, self._no_lead_until = "", float("-inf")  # back off from a leader we cannot see

    def back_off(self, rival: str, now: float) -> None:
        """Do not take the lead for ``query_timeout`` while ``rival``, which leads, is not seen synced."""
        self._rival, self._no_lead_until = rival, now + self.machine.config.query_timeout

    def refused(self, sender: str, leader: str, reason: str, now: float) -> None:
        """``sender`` refused our QUERY: ``leader``, the one it obeys, leads it now (the member's
        ``_led_on``: we were cut off and found that leader silent). We step down, our ballot is
        void (we obey whoever leads), and show our state: that leader admits us, or we load."""
        machine = self.machine
        b = machine.leader.lead.b
        machine.leader.step_down(now, f"{sender} refused: {reason}", rival=leader)
        if machine.member.promised == b:
            machine.member.promised = None
        machine._broadcast(machine.lineage.status(), machine._peers())

    def peer_gone(self, s: str) -> None:
        """Peer s can no longer take part: a rival we backed off from that is lost (link,
        goodbye, silence), not just behind, is forgotten."""
        if s == self._rival and not self.machine.table.is_live(s):
            self._rival, self._no_lead_until = "", float("-inf")  # the leader we backed off from is gone

    def may_lead(self, now: float) -> bool:
        """On a tick, leading nothing: whether we take the lead now (see "Who leads")."""
        machine = self.machine
        if machine.table.coordinator() != machine.id or machine.lineage.awaits_hello(now):
            return False  # (not before we heard who else is synced)
        if machine.ending.wondering(now):  # (nor while the run may have ended as we stood still)
            return False
        if now < machine.lineage.listen_until:  # (nor in our first moment: peers started with us, found by
            return False  # their beacons, are at genesis too, and none loads anything)
        if now < machine.lineage.out_until or machine.lineage.load_later:
            return False  # a leader leaves us out, or we are behind and load soon: do not fork
        owner, pending = (machine.member.promised or (0, None))[1], machine.member.pending
        owner_alive = owner != machine.id and machine.table.state(owner) == SYNCED
        led_since = owner not in (None, self._rival, machine.id)  # (a leader we see led us: the side has one,
        #   the rival was given up, stopped, and that leader may hand us the lead)
        if now < self._no_lead_until and machine.table.state(self._rival) != SYNCED and not led_since:
            return False  # a rival we cannot see leads: do not flip-flop with it every round
        if pending is not None and pending.started:  # in doubt: only once its leader is gone
            return not owner_alive
        # A smaller live leader keeps the lead, where it may coordinate too: one that has served
        # (the coordinator puts those first, and every STATUS says it). One that has not may
        # have stepped down since (a load): deferring to it, no peer led, for ever.
        return not (owner_alive and owner < machine.id and machine.table.get(owner).served)

    def decide(self, key: tuple, committed: bool) -> None:
        """Our decision on attempt ``key`` (round, ballot), as leader: final (the last 64 kept)."""
        self._decided[key] = committed
        while len(self._decided) > 64:
            self._decided.popitem(last=False)

    def decision(self, key: tuple) -> bool | None:
        """What we decided of attempt ``key`` (round, ballot) as leader; None: nothing (or long ago)."""
        return self._decided.get(key)

    def resolve(self, got: dict[str, Status]) -> dict:
        """Decide the attempts that members report pending: commit where anyone committed it,
        abort otherwise; our decision, once taken, is final. A member that did not finish
        the ring of a committed attempt is told ABORT (it is behind, and will load state).
        Returns each member's (version, digest) after the decision."""
        machine = self.machine
        learned, after = {}, {}
        for r, b, c in [e for st in got.values() for e in st.log] + list(machine._log):
            learned[(r, b)] = learned.get((r, b), False) or c
        masks = dict(machine._masks)  # (the COMMIT's mask, from a member that had it: the same for all)
        for st in got.values():
            masks.update({(r, b): m for r, b, m in st.masks or ()})
        totals, spreads = {}, {}  # (a member whose START was lost knows none: a member that heard it does)
        for st in got.values():
            if st.pending is not None:
                key = (st.pending.r, st.pending.b)
                totals[key] = max(totals.get(key, 0), st.pending.total)
                spreads[key] = spreads.get(key) or st.pending.spread
        for peer, st in got.items():
            version, digest, pd = st.version, st.digest, st.pending
            if pd is not None:
                key = (pd.r, pd.b)
                outcome = self._decided.get(key, learned.get(key, False))
                if pd.phase in (RING, RINGED):
                    self.decide(key, outcome)
                if outcome and pd.phase == RINGED and pd.ok and totals[key]:  # (no total known: it loads state)
                    version, digest = History.after(version, digest, pd.r, pd.view, totals[key])
                    machine._send(peer, with_used({"t": COMMIT, "r": pd.r, "b": list(pd.b), "total": totals[key],
                                                   "spread": spreads[key]}, masks.get(key)))
                else:
                    machine._send(peer, {"t": ABORT, "r": pd.r, "b": list(pd.b), "drop": [],
                                         "reason": "its leader was lost"})
            after[peer] = (version, digest)
        return after
