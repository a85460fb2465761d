"""The lineage part of the round machine: comparing chains in STATUS, loading state. Pure code, no I/O.

``LineageKeeper`` is a part held by ``p2ptrain.cluster.rounds.RoundMachine``
(``machine.lineage``). It owns what peers' STATUS told us: a load put off (``load_later``), how
long a leader leaves us out (``out_until``), the leader of the side we load (``side_leader``),
the peers that showed another state, the STATUS still awaited after loading (``hello``) and
those put off while a round of ours was in flight. It reads the machine's core (``table``,
``history``, ``round``, the attempt log), sends through it (``_send``, ``_broadcast``,
``_emit``, ``_gone``), and where this peer leads calls the leader part (``takeover.resolve``, ``abort``,
``step_down``, the holds). ``rounds`` tells the round itself, ``member`` the member side,
``leader`` what the peer that sequences rounds does; this module is how peers find out whether
they hold the same state, and which of them loads another's. The machine calls ``on_status``
for a STATUS, ``compare_deferred`` once no round of ours is in flight, ``status`` for every
STATUS it sends, and ``tick`` on a tick.

Lineage. Committed rounds form a hash chain (``membership.History``). READY carries (version,
digest): a member whose chain differs from the leader's is dropped. Peers compare chains in
STATUS (on connect, after loading state, when told, when idle too long): on one chain the
peer behind loads state (``Resync``); across a split ``heal_decision`` picks the side. The
leader holds the boundary while it sends a joiner its state, and ``join_hold`` more while the
joiner loads it.

One chain, or a split. A peer compares the (version, digest) of another's STATUS with its own
chain (``membership.relation``). On one chain the peer behind loads state (it lacks updates that
exist), from the leader (which holds its rounds while it loads): a peer not yet linked to the
leader waits ``LEADER_WAIT`` for the link before it loads from the peer ahead (whose rounds go
on, so it would be behind again once loaded). The peer ahead just answers with its STATUS. Across a split ``membership.heal_decision``
picks the side that keeps its state: both sides weigh the same two lineages, so exactly one of
them loads.

Left out. A peer that the leader leaves out of its views (partial connectivity, ``leader``) is
told for how long in the leader's STATUS (``out``). Behind meanwhile, it does not load at once
(it would be behind again after every round it misses) but once its time out is over, and it
does not take the lead before then; the leader's STATUS at its end (``out`` 0) brings it back.
"""

from __future__ import annotations

from p2ptrain.cluster.leader import COLLECTING, RUNNING
from p2ptrain.cluster.membership import History, Lineage, heal_decision, relation
from p2ptrain.cluster.roundmsg import QUERY, RING, RINGED, STATUS, Log, Resync, Status, beats
from p2ptrain.cluster.silence import silent


LEADER_WAIT = 1.0  # seconds a peer that is behind waits for a link to the leader to load from it


class LineageKeeper:
    """Whether peers hold our state, and loading another's when we are behind or on the
    losing side of a split."""

    def __init__(self, machine) -> None:
        self.machine = machine  # the RoundMachine that holds us
        self.out_until = float("-inf")  # a leader leaves us out of its views until then
        self.load_later: tuple = ()  # (reason, donor, leader, what): a load put off, until _load_at (or left out)
        self._load_at = float("-inf")
        self.side_leader = ""  # the leader of the side whose state we load
        self._elsewhere: set = set()  # peers whose STATUS showed another state than ours
        self.hello: set = set()  # after on_synced: peers whose STATUS we still await (we do not lead before)
        self.hello_until = 0.0
        self._loading_side: frozenset | None = None  # the peers of the side whose state we load (its STATUS says)
        self.listen_until = 0.0  # after our start: we lead nothing before (``RoundConfig.listen``)
        self._deferred: dict[str, Status] = {}  # STATUS that arrived while our own version was in flight
        self._start: int | None = None  # the version we started from (genesis: 0, or a checkpoint's)
        self._alone = True  # no round with another peer yet, and no load: a first load is joining
        self._loads_in_a_row = 0  # loads since our last round with another peer (one: behind is catching up)
        self._before_load = (True, 0)  # (_alone, _loads_in_a_row) before the load asked for: one that failed

    def on_synced(self, peers, now: float) -> None:
        """We loaded state: our side is the one we loaded (see ``_side``), and we await the
        STATUS of those of ``peers`` on it (its STATUS named them; all, where none did)."""
        self._elsewhere = set()
        side, self._loading_side = self._loading_side, None
        if side is not None:  # the others held what we loaded over: synced with that, not with this
            for p in set(self.machine.table.live_synced()) - side - {self.machine.id}:
                self.machine.table.unsynced(p)  # (held synced, a peer stopped meanwhile is a candidate
                #   our takeover would query and wait for)
        self.await_hello(peers if side is None else side.intersection(peers), now)
        if self._start is None:  # (the first is our start: genesis or a checkpoint)
            self._start = self.machine.history.version
            self.listen_until = now + self.machine.config.listen

    def await_hello(self, peers, now: float) -> None:
        """We lead nothing before the STATUS of ``peers`` (for ``query_timeout`` at most): we
        do not know who else holds our state (we loaded it, started, or stood still)."""
        self.hello, self.hello_until = set(peers), now + self.machine.config.query_timeout

    def awaits_hello(self, now: float) -> bool:
        """Whether a STATUS in ``hello`` is still awaited: one of a silent peer (``silence``;
        stopped, unplugged) is not; it shows its state when it runs again, as any peer that meets us.
        Else a peer back from a stop that takes the lead waits up to ``query_timeout`` for another
        still stopped, and no round runs meanwhile."""
        self.hello.difference_update(silent(self.machine, self.hello, now))
        return bool(self.hello) and now < self.hello_until

    def shared_round(self, view) -> None:
        """The peers of ``view`` committed a round with us: they hold our state again."""
        self._elsewhere.difference_update(view)
        self.hello.difference_update(view)  # (they hold our state: no STATUS of theirs is awaited)
        if any(p != self.machine.id for p in view):
            self._alone, self._loads_in_a_row = False, 0

    def compare_deferred(self, now: float) -> None:
        """The STATUS put off while a round of ours was in flight, once none is."""
        machine = self.machine
        if self._deferred and machine.synced and not (machine.member.pending and machine.member.pending.started):
            deferred, self._deferred = self._deferred, {}
            for s in sorted(deferred):
                self._compare(s, deferred[s], now)

    def status(self, b=None, re=False, their: int | None = None, to: str | None = None) -> dict:
        """Our STATUS; in reply to a peer at version ``their``, with our digest there (``at``);
        to a peer our views leave out, for how many seconds more (``out``)."""
        machine = self.machine
        history, pending, ids = machine.history, machine.member.pending, self._side()
        at = history.at(their) if their is not None and their < history.version else None
        return {"t": STATUS, "synced": machine.synced, "version": history.version, "digest": history.digest,
                "round": machine.round, "members": len(ids), "min_id": ids[0] if ids else "", "re": re,
                "window": [list(e) for e in history.recent()], "b": list(b) if b else None,
                "promised": list(machine.member.promised) if machine.member.promised else None,
                "at": [their, at] if at is not None else None,
                "log": [[r, list(bb), c] for r, bb, c in machine._log],
                "masks": [[r, list(bb), m] for (r, bb), m in machine._masks.items()] or None,
                "pending": pending and {"r": pending.r, "b": list(pending.b), "phase": pending.phase, "ok": pending.ok,
                                  "view": list(pending.view), "total": pending.total, "spread": pending.spread},
                "out": (machine.leader.refusals.out_for(to) if to is not None and machine.leader.lead is not None
                        else None),
                "end": machine.ending.ended, "served": machine.table.get(machine.id).served, "side": ids}

    def on_status(self, sender: str, message: Status, now: float) -> None:
        machine = self.machine
        self.hello.discard(sender)
        if message.served is not None:  # (every table then names the same coordinator)
            machine.table.set_served(sender, message.served)
        if message.end is not None:  # its run is over (``ending``): ours too, unless we are ahead
            return machine.ending.heard_end(sender, message.end, now)
        if message.out is not None:  # its views leave us out a while: loading its state before then is
            self.out_until = now + message.out  # wasted; 0: back in, load now if behind
        lead, pd = machine.leader.lead, message.pending
        if machine.leader.take_status(sender, message):  # (our QUERY's answer)
            return
        if (lead is not None and lead.phase in (COLLECTING, RUNNING) and sender in lead.view
                and beats(message.promised, lead.b)):  # it obeys a newer leader: it sends us nothing more
            return machine.leader.superseded(sender, message.promised, now)  # for this round (as a NACK says)
        if lead is not None and message.synced and pd and pd.phase in (RING, RINGED) and (
                (pd.b != lead.b and self._ours_to_resolve(message))
                or (pd.b == lead.b and pd.r < lead.r)):  # (or an attempt of ours whose decision it missed)
            if lead.b != message.b and (message.promised or (0, None))[1] != machine.id:
                return machine._send(sender, {"t": QUERY, "b": list(lead.b)})  # in doubt, obeying another: ask it
            machine.leader.takeover.resolve({sender: message})  # in doubt and it obeys us: decide its attempt
            machine._tell.add(sender)
            if lead.phase in (COLLECTING, RUNNING) and sender in lead.view:
                machine.leader.abort(now, f"{sender} was in doubt about an earlier round", drop=[])
            return
        if not message.synced:
            machine.table.unsynced(sender)
            return machine._gone(sender, now, "is not synced")
        if machine.synced and machine.member.pending is not None and machine.member.pending.started:
            self._deferred[sender] = message  # our own version is about to change: compare after the round
        elif machine.synced:
            self._compare(sender, message, now)

    def _ours_to_resolve(self, m: Status) -> bool:
        """Whether the attempt a STATUS reports in doubt is ours to decide as leader: its peer
        is on our chain and the leader it obeys is not connected to us (lost). A peer of
        another side (a replugged cable), or one whose leader lives, is in that leader's
        round: asking it to obey us would abort a round its own leader may commit."""
        machine = self.machine
        owner = (m.promised or (0, None))[1]
        if owner is not None and owner != machine.id and machine.table.is_live(owner):
            return False
        return relation(machine.history, m.version, m.digest, m.window, m.at) in ("same", "behind")

    def _compare(self, s: str, m: Status, now: float) -> None:
        """Their chain against ours. On one chain the peer behind loads state (it lacks
        updates that exist); across a split, ``heal_decision``. They hear our STATUS."""
        machine = self.machine
        their_version, their_digest, pd = m.version, m.digest, m.pending
        if pd and pd.phase in (RING, RINGED) and (pd.r, pd.b, True) in machine._log:
            their_version, their_digest = History.after(  # about to commit it
                their_version, their_digest, pd.r, pd.view, pd.total)
        rel = relation(machine.history, their_version, their_digest, m.window, m.at, can_ask=not m.re)
        if rel == "unknown":  # they are ahead, too far for their window: ask, their reply says
            return machine._send(s, self.status())
        if rel == "behind" and m.round < machine.round and s in machine._last_view:
            machine.counters["stale_status"] += 1  # sent before a round we both took part in: it holds ours.
            #   Still answered: a joiner awaits our STATUS before it leads (``hello``); unanswered, a
            #   joiner with the smallest id, handed the lead, would lead only at the query timeout
        elif rel == "same":
            self._elsewhere.discard(s)
            machine.table.synced(s, their_version, their_digest, m.round, now)
            machine.leader.caught_up(s)
        else:
            if rel == "behind":  # (as leader, it holds the boundary while that peer loads)
                machine.leader.hold_for_joiner(s, their_version, now)
            machine.table.unsynced(s)
            self._elsewhere.add(s)
            machine._gone(s, now, f"holds another state ({rel})")
            sides = self._lineages(s, m, their_version, their_digest)
            if rel == "ahead" or (rel == "split" and heal_decision(*sides) == "resync"):
                why = "behind" if rel == "ahead" else "split"
                leader = (m.promised or (0, s))[1]  # load from the leader: it holds while we load
                donor = leader if leader != machine.id and machine.table.is_live(leader) else s
                reason = f"{why}: {s} has version {their_version}, its side {sides[1].members} peer(s)"
                what = (why, their_version, sides[1].members, m.side)  # (for ``_said``; its side's peers)
                if rel == "ahead" and now < self.out_until:  # stale again before we are in a view:
                    machine.counters["behind_left_out"] += 1  # load once our time left out is over
                    self.load_later = (reason, donor, leader, what)
                elif rel == "ahead" and donor != leader != machine.id:  # no link to its leader yet: wait for
                    if not self.load_later:  # one a moment (only a leader holds its rounds while we
                        self._load_at = now + LEADER_WAIT  # load; from another, we would end behind)
                    self.load_later = (reason, donor, leader, what)
                else:
                    return self._resync(reason, donor, now, leader, what)
        if not m.re:
            machine._send(s, self.status(re=True, their=their_version, to=s))

    def _lineages(self, s: str, m: Status, version: int, digest: bytes) -> tuple[Lineage, Lineage]:
        """Our side and s's, as a heal between them counts them: neither with a peer of the
        other, which holds the other state, whatever its side's last view says. (A leader frozen
        just after it committed a round, a laptop's lid, counted as its side the peer that went
        on alone, which had aborted that round, in doubt: that peer lost its rounds alone.) Ours
        leaves s out already (``_compare`` has just put it elsewhere); theirs leaves us out. The
        same two counts on both sides, so exactly one loads; a peer whose STATUS lists no side
        (an older one) is counted as it says."""
        machine = self.machine
        mine = self._side()
        ours = Lineage(len(mine), machine.history.digest, machine.history.version, mine[0] if mine else machine.id)
        if m.side is None:
            return ours, Lineage(m.members, digest, version, m.min_id or s)
        theirs = sorted(p for p in m.side if p != machine.id)
        return ours, Lineage(len(theirs), digest, version, theirs[0] if theirs else s)

    def _side(self) -> list:
        """The peers of our side, sorted: the live synced ones, and the live members of the
        last round we committed that showed no other state since. A count of synced peers
        alone, taken just after a round dropped a member, made a pair count one and lose a
        heal to a peer that had gone on alone."""
        machine = self.machine
        since = {q for q in machine._last_view if q not in self._elsewhere and machine.table.is_live(q)}
        return sorted(set(machine.table.live_synced()) | since)

    def _said(self, reason: str, donor: str, why: str, their_version: int, members: int) -> Log:
        """What a load says. Joining is no fault: a peer that has had no round with another
        and loaded nothing yet (it starts, or trained alone until it met the others: beacons
        take a moment) loads the cluster's state as every joiner does, or takes its initial
        parameters (peers that started from other random weights, as DDP broadcasts rank 0's).
        Said as a warning: the updates it made alone that the load drops, and any load after
        rounds with others ("again": it fell behind, or a split healed). Behind again after a load,
        before any round with others, it catches up once: the cluster moved on while it loaded (a
        LAN commits rounds faster than a snapshot loads), no fault either; a third load in a row is."""
        if self._catching_up(why):
            return Log("info", f"catching up: loading the cluster's state again (version {their_version}) from "
                               f"{donor}: it moved on while this peer loaded")
        if not self._alone:
            return Log("warning", f"loading state again: {reason}")
        ours = self.machine.history.version
        if why == "split" and their_version == ours == 0:
            return Log("info", f"taking the cluster's initial parameters from {donor}: this peer's own differ "
                               "(give every peer's model the same seed to skip this load)")
        joining = f"joining: loading the cluster's state (version {their_version}, {members} peer(s)) from {donor}"
        dropped = ours - (self._start or 0)
        if why == "behind" or dropped <= 0:  # (behind: our updates are the first of theirs)
            return Log("info", joining)
        return Log("warning", f"{joining}; the {dropped} update(s) this peer made alone before it met them are "
                              "dropped (give every peer --min-peers, min_peers=, to wait for the others first)")

    def _catching_up(self, why: str) -> bool:
        return why == "behind" and self._loads_in_a_row == 1

    def _resync(self, reason: str, donor: str, now: float, leader: str, what: tuple) -> None:
        """Load state from ``donor``, of the side that ``leader`` leads (``on_synced`` backs
        off from leading while that leader is not seen synced: the side has one). ``what``:
        (why, their version, their side's size, its peers or None), for what the load says
        (``_said``) and whose STATUS we await once loaded (``on_synced``: not a peer stopped
        meanwhile, still linked and held synced in our table)."""
        machine = self.machine
        said, joining = self._said(reason, donor, *what[:3]), self._alone or self._catching_up(what[0])
        self._loading_side = None if what[3] is None else frozenset(what[3]) - {machine.id}
        if self._alone:  # our rounds so far were solo, on a lineage we now drop: we served in no view
            machine.table.set_served(machine.id, False)  # of this side's (see ``coordinator``): else
            #   we took the lead from its leader while it held for a joiner
        self._before_load = (self._alone, self._loads_in_a_row)  # (``load_failed``: no load came)
        self._alone, self._loads_in_a_row = False, self._loads_in_a_row + 1
        self.load_later, self._load_at, self.side_leader = (), float("-inf"), leader
        if machine.leader.lead:  # (joining, the round it aborts is no fault: the load says what it drops)
            machine.leader.step_down(now, "loading state", routine=joining)
        machine.member.forget()  # (an in-doubt contribution is void: Resync says so)
        machine.synced = False
        machine._set_self()
        machine._emit(Resync(reason, donor))
        machine._emit(said)
        machine._broadcast(self.status(), machine._peers())

    def load_failed(self, asked: str, why: str, now: float) -> None:
        """No load (``_resync``) came: the host gave up on the peers it ``asked`` (``why``). We
        are synced again on our own chain, which nothing changed, as a peer that has just started
        is: we await the STATUS of the peers linked now before we lead (``hello``), and theirs
        decides, as between any peers that meet: one ahead is loaded from, a peer on our chain
        trains with us, a split heals; with nobody linked, we train on alone. Nothing waits on
        the donor: it is loaded from again only if its STATUS shows it ahead."""
        machine = self.machine
        if machine.synced:  # (a stale word from the host: nothing to go back to)
            return
        machine.synced, machine._heard_lead = True, now
        machine.member.reset()  # (the ballot we obeyed was the side's whose state we failed to load)
        machine._set_self()
        self.side_leader, (self._alone, self._loads_in_a_row) = "", self._before_load
        self._loading_side = None
        self.on_synced(machine._peers(), now)
        machine._tell.update(self.hello)
        peers = ", ".join(sorted(self.hello))
        machine._emit(Log("warning", f"gave up loading state from {asked}: {why}; this peer goes on from its own "
                                     f"state (version {machine.history.version})"
                                     + (f" and compares it with {peers}'s (one ahead is loaded from)" if peers
                                        else ", alone until a peer links")))

    def tick(self, now: float) -> None:
        """On a tick: a load put off, once the leader no longer leaves us out and the wait for
        a link to it is over (from it as soon as it is linked)."""
        machine = self.machine
        if not (self.load_later and now >= self.out_until and machine.synced):
            return
        reason, donor, leader, what = self.load_later
        if leader != machine.id and machine.table.is_live(leader):
            donor = leader
        elif now < self._load_at:
            return
        if machine.table.is_live(donor):
            self._resync(reason, donor, now, leader, what)
        self.load_later = ()  # (gone: the STATUS of whoever is ahead tells us again)
