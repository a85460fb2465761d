"""The round machine's test bench: 2-5 ``RoundMachine`` joined by a fake message bus with a fake
clock, and a fake host that answers their actions (contributions, rings, state transfer).

Shared by the tests of the round machine and its roles (``test_rounds``, ``test_member``,
``test_leader``, ``test_lineage``, ``test_roundmsg``, ``test_ending``); import it as
``from roundnet import Net, cluster``. Every test builds its own ``Net``: nothing here is
shared state.
"""

from collections import Counter, defaultdict, deque

import msgpack

from p2ptrain.cluster.membership import DEAD, genesis
from p2ptrain.cluster.roundmsg import Apply, Broadcast, Contribute, PutBack, Resync, Send, StartRing
from p2ptrain.cluster.rounds import RoundConfig, RoundMachine, SyncPoint


GENESIS = SyncPoint(0, genesis(b"same init"), -1, 0)


class Net:
    """Machines on a fake bus: messages go through msgpack and stay in order per directed link.

    The fake host answers ``Contribute`` and runs rings: a ring ends ok once every member of
    its view started it, and fails where a member crashed or gave its round back. With
    ``auto=False`` a test (or hypothesis) drives every step itself.
    """

    def __init__(self, ids, *, auto=True, **cfg):
        self.now = 0.0
        self.asleep = Counter()  # peer -> seconds its machine slept: its monotonic clock is behind by that
        self.cfg = RoundConfig(**cfg)
        self.auto = auto
        self.m: dict[str, RoundMachine] = {}
        self.q = defaultdict(deque)  # (src, dst) -> messages in flight
        self.down = set()  # frozenset({a, b}): links that are cut
        self.unplugged = set()  # frozenset({a, b}): links whose cable is out (``unplug``)
        self.crashed = set()
        self.still = set()  # peers standing still (``stand_still``): not run, what comes to them waits
        self.held = set()  # (src, dst) links whose messages wait until released
        self.drops = []  # (src, dst, type) to drop once
        self.crash_at = {}  # peer -> round: crash when it starts that ring
        self.actions = defaultdict(list)
        self.asked = defaultdict(Counter)  # Contribute(r) not answered yet
        self.out = defaultdict(Counter)  # contributions handed over, not applied or put back
        self.chain = defaultdict(dict)  # peer -> {round: digest after applying it}
        self.outcome = defaultdict(dict)  # peer -> {round: ("commit", view, total) | "abort"} (started ones)
        self.applied_at = defaultdict(list)  # peer -> [(time, round)] of its Apply actions
        self.started = defaultdict(dict)  # (r, view) -> members that started the ring
        self.ring_bad = set()  # (r, view) rings that cannot finish ok
        self.running = defaultdict(list)  # peer -> [(r, view)] rings it runs
        self.ringed = defaultdict(set)  # peer -> rounds whose ring it started
        self.resyncs = defaultdict(list)
        self.needs_sync = {}  # peers told to load state -> from whom: the auto host does it
        self.manual_sync = set()  # ... except for these
        self.budget = Counter()  # auto host: one batch per peer per tick (compute takes time)
        self.compute = {}  # peer -> seconds from a Contribute to its contribution (auto host; else a tick)
        self.asked_at = {}  # (peer, r) -> when Contribute(r) came
        self.nbytes = 4000  # each contribution's buffer (the ring deadlines scale with it)
        self.ring_time = 0.0  # seconds a ring takes once all of its view started it (or a function of the view)
        self.full_at = {}  # (r, view) -> when the last member started it
        self.report_moving = True  # rings whose members all started, none failed, receive chunks (False: they stop)
        self.moved_at = {}  # (peer, r) -> when its ring of r last received a chunk
        for p in ids:
            self.add(p)

    def clock(self, p):
        """The time as peer p's machine reads it (its host's monotonic clock stopped while it slept)."""
        return self.now - self.asleep[p]

    # -- building -----------------------------------------------------------------------------
    def add(self, p):
        self.m[p] = RoundMachine(p, self.cfg)
        for o in list(self.m):
            if o != p:
                self.m[o].table.heard(p, None, self.clock(o))
                self.m[p].table.heard(o, None, self.clock(p))
                self.handle(o, self.m[o].on_connected(p, self.clock(o)))
                self.handle(p, self.m[p].on_connected(o, self.clock(p)))
        return self.m[p]

    def found(self, *ids):
        for p in ids or list(self.m):
            self.handle(p, self.m[p].on_synced(GENESIS, self.clock(p)))
        self.settle()

    def sync_from(self, p, server):
        """State transfer (the I/O layer's job): p gets server's state."""
        self.needs_sync.pop(p, None)
        self.chain[p] = dict(self.chain[server])
        self.out[p].clear()
        self.handle(p, self.m[p].on_synced(self.m[server].sync_point(), self.clock(p), server))

    # -- fault injection (fluent) -------------------------------------------------------------
    def fail_at(self, peer, round):
        """``peer`` crashes silently when it starts the ring of ``round``."""
        self.crash_at[peer] = round
        return self

    def drop(self, src, dst, mtype):
        self.drops.append((src, dst, mtype))
        return self

    def hold(self, src, dst):
        self.held.add((src, dst))
        return self

    def release(self, src, dst):
        self.held.discard((src, dst))
        return self

    def crash(self, p, sent_arrive=False):
        """``p`` stops; what is in flight to it is lost, and what it sent too unless ``sent_arrive``
        (a peer that dies after sending: its last messages were on the wire)."""
        self.crashed.add(p)
        for k in list(self.q):
            if k[1] == p or (p in k and not sent_arrive):
                del self.q[k]
        for key in self.started:
            if p in key[1] and p in self.started[key]:
                self.ring_bad.add(key)
        return self

    def stand_still(self, p, seconds, slept=False, dt=0.5):
        """p stands still ``seconds`` (a lid closed): SIGSTOP, or with ``slept`` a suspended
        machine, whose clock stops too (its host then tells it first, ``on_woken``). The others
        go on, ticking every ``dt``; what they send p waits in its sockets, what it sent before
        arrives. Then p runs again. ``p`` may name several peers ("ab"): they stand still together."""
        still = [p] if p in self.m else list(p)
        into = {(o, q) for q in still for o in self.m if o != q} - self.held
        self.held |= into
        self.still.update(still)
        for _ in range(round(seconds / dt)):
            self.tick(dt)
        self.still.difference_update(still)
        self.held -= into
        for q in still if slept else ():
            self.asleep[q] += seconds
            self.handle(q, self.m[q].on_woken(self.clock(q), seconds))
        self.settle()  # (p reads what waited in its sockets)
        for q in still:
            for o in sorted(self.m):  # a host closes the link to a peer its machine found dead, and
                if o != q and DEAD in (self.m[o].table.state(q), self.m[q].table.state(o)) \
                        and frozenset((o, q)) not in self.down:  # the two dial each other again
                    self.cut(o, q).reconnect(o, q)
        return self

    def cut(self, a, b):
        """The link a-b breaks: messages in flight are lost and both ends notice."""
        self.down.add(frozenset((a, b)))
        self.q.pop((a, b), None)
        self.q.pop((b, a), None)
        for key in self.started:
            if a in key[1] and b in key[1]:
                self.ring_bad.add(key)
        self.handle(a, self.m[a].on_peer_lost(b, self.clock(a)))
        self.handle(b, self.m[b].on_peer_lost(a, self.clock(b)))
        return self

    def reconnect(self, a, b):
        self.down.discard(frozenset((a, b)))
        self.handle(a, self.m[a].on_connected(b, self.clock(a)))
        self.handle(b, self.m[b].on_connected(a, self.clock(b)))
        return self

    def unplug(self, a, b):
        """The cable between a and b is out: the connection stays open, what either sends
        waits (TCP retransmits it later) and neither hears the other."""
        self.unplugged.add(frozenset((a, b)))
        self.held |= {(a, b), (b, a)}
        return self

    def replug(self, a, b):
        self.unplugged.discard(frozenset((a, b)))
        self.held -= {(a, b), (b, a)}
        return self

    # -- the fake host ------------------------------------------------------------------------
    def handle(self, p, actions):
        for a in actions:
            self.actions[p].append(a)
            if isinstance(a, Send):
                self.post(p, a.to, a.msg)
            elif isinstance(a, Broadcast):
                assert p not in a.to
                for to in a.to:
                    self.post(p, to, a.msg)
            elif isinstance(a, Contribute):
                self.asked[p][a.r] += 1
                self.asked_at[(p, a.r)] = self.now
            elif isinstance(a, StartRing):
                assert self.out[p][a.r] > 0, "a ring without a contribution"
                self.started[(a.r, a.view)] = self.started.get((a.r, a.view), set()) | {p}
                if self.started[(a.r, a.view)] >= set(a.view):
                    self.full_at.setdefault((a.r, a.view), self.now)
                self.running[p].append((a.r, a.view))
                self.ringed[p].add(a.r)
                if self.crash_at.get(p) == a.r:  # (its READY, sent just before, is on the wire)
                    self.crash(p, sent_arrive=True)
            elif isinstance(a, Apply):
                self.close(p, a.r)
                self.applied_at[p].append((self.now, a.r))
                assert self.started.get((a.r, a.view), set()) == set(a.view), "applied a ring that did not run"
                self.chain[p][a.r] = self.m[p].history.digest
                self.ringed[p].discard(a.r)
                self.outcome[p][a.r] = ("commit", a.view, a.total_samples)
                self.running[p] = [x for x in self.running[p] if x[0] != a.r]
            elif isinstance(a, PutBack):
                self.close(p, a.r)
                if a.r in self.ringed[p]:  # (not a late contribution handed back)
                    self.outcome[p][a.r] = "abort"
                    self.ringed[p].discard(a.r)
                for key in [x for x in self.running[p] if x[0] == a.r]:
                    self.ring_bad.add(key)
                    self.running[p].remove(key)
            elif isinstance(a, Resync):
                self.resyncs[p].append(a.reason)
                self.needs_sync[p] = a.donor
                self.out[p].clear()
                self.asked[p].clear()
                self.running[p].clear()
                self.ringed[p].clear()

    def close(self, p, r):
        assert self.out[p][r] > 0, f"{p}: round {r} closed twice or never contributed"
        self.out[p][r] -= 1

    def post(self, src, dst, msg):
        if src in self.crashed or dst in self.crashed or frozenset((src, dst)) in self.down:
            return
        for d in self.drops:
            if d[:2] == (src, dst) and d[2] == msg["t"]:
                self.drops.remove(d)
                return
        self.q[(src, dst)].append(msgpack.packb(msg, use_bin_type=True))

    def deliver(self, src, dst):
        msg = msgpack.unpackb(self.q[(src, dst)].popleft(), raw=False)
        self.handle(dst, self.m[dst].on_message(src, msg, self.clock(dst)))

    def contribute(self, p, samples=None):
        r = min(r for r, n in self.asked[p].items() if n)
        self.asked[p][r] -= 1
        self.out[p][r] += 1
        n = samples if samples is not None else 10 + sorted(self.m).index(p)
        self.handle(p, self.m[p].on_contribution_ready(r, n, self.clock(p), nbytes=self.nbytes))

    def computed(self, p):
        """Whether p's contribution to its oldest asked round is computed (``compute``)."""
        r = min(r for r, n in self.asked[p].items() if n)
        return self.now - self.asked_at.get((p, r), self.now) >= self.compute.get(p, 0.0) - 1e-9

    def ring_ready(self, p):
        """The first ring p runs that can end now: (r, view, ok) or None."""
        for r, view in self.running[p]:
            key = (r, view)
            if key in self.ring_bad:
                return r, view, False
            took = self.ring_time(view) if callable(self.ring_time) else self.ring_time
            if self.started.get(key, set()) >= set(view) and self.now >= self.full_at[key] + took:
                return r, view, True
        return None

    def finish_ring(self, p, ok=None, void=None, used=None):
        r, view, good = self.ring_ready(p)
        self.running[p].remove((r, view))
        self.handle(p, self.m[p].on_ring_done(r, good if ok is None else ok, self.clock(p), checksum=b"\x07",
                                              void=void, used=used))

    def live(self):
        return [p for p in sorted(self.m) if p not in self.crashed and p not in self.still and not self.m[p]._left]

    def commit_unheard(self, leader, unheard, used=None):
        """One round of every peer: ``leader`` commits it, and its COMMIT to ``unheard`` is held
        (not sent yet: those members are left in doubt). A net of ``auto=False``, just founded.
        ``used``: peer -> the ``used`` mask its DONE carries."""
        self.tick()
        self.settle()
        for p in self.m:
            self.contribute(p)
        self.settle()
        for p in self.m:
            self.finish_ring(p, used=(used or {}).get(p))
        for p in unheard:
            self.hold(leader, p)
        self.settle()

    def hold_a_round(self, peers):
        """Stop driving contributions by itself, then let one round get in flight with ``peers``."""
        self.auto = False
        self.tick()
        for p in peers:
            self.contribute(p)
        self.settle()

    def settle(self, limit=10_000):
        """Deliver everything (links in a fixed order) and let the host answer, until quiet."""
        for _ in range(limit):
            links = [k for k in sorted(self.q) if self.q[k] and k not in self.held]
            if links:
                self.deliver(*links[0])
                continue
            if not self.auto:
                return
            p = next((p for p in self.live() if any(self.asked[p].values()) and self.budget[p]
                      and self.computed(p)), None)
            if p:
                self.budget[p] -= 1
                self.contribute(p)
                continue
            p = next((p for p in self.live() if self.ring_ready(p)), None)
            if p:
                self.finish_ring(p)
                continue
            for p, s in sorted(self.needs_sync.items()):
                if p in self.live() and p not in self.manual_sync and s in self.live() and self.m[s].synced and frozenset((p, s)) not in self.down:
                    self.sync_from(p, s)
                    break
            else:
                return
            continue
        raise AssertionError("the bus did not settle")

    def tick(self, dt=0.1):
        self.now += dt
        self.budget = Counter({p: 1 for p in self.m})
        for p in self.live():  # beacons: every live peer hears every other live one
            for o in self.live():
                if o != p and frozenset((o, p)) not in self.down | self.unplugged:
                    self.m[p].table.heard(o, None, self.clock(p))
        for p in self.live():
            self.handle(p, self.m[p].on_tick(self.clock(p), self.moving(p)))
        self.settle()

    def moving(self, p):
        """When each ring p runs last received a chunk (``on_tick``'s ``ring_moved``): now, while
        every member started it, none failed and ``report_moving``; else when it last did."""
        for r, view in self.running[p]:
            if self.report_moving and (r, view) in self.full_at and (r, view) not in self.ring_bad:
                self.moved_at[(p, r)] = self.clock(p)
        return {r: self.moved_at[(p, r)] for r, _ in self.running[p] if (p, r) in self.moved_at}

    def run(self, seconds, dt=0.1):
        for _ in range(round(seconds / dt)):
            self.tick(dt)

    # -- what the tests look at ---------------------------------------------------------------
    def applied(self, p):
        return [(a.r, a.view, a.total_samples) for a in self.actions[p] if isinstance(a, Apply)]

    def of(self, p, kind):
        return [a for a in self.actions[p] if isinstance(a, kind)]

    def sent(self, p, mtype):
        msgs = [a.msg for a in self.actions[p] if isinstance(a, (Send, Broadcast))]
        return [m for m in msgs if m["t"] == mtype]

    def check_safety(self):
        """Any round two peers both applied was applied on the same history, identically."""
        peers = sorted(self.chain)
        for i, a in enumerate(peers):
            for b in peers[i + 1:]:
                for r in set(self.chain[a]) & set(self.chain[b]):
                    assert self.chain[a][r] == self.chain[b][r], f"{a} and {b} differ at round {r}"

    def check_nothing_lost(self):
        """Every contribution handed over was applied or put back, but the one in flight."""
        for p in self.live():
            pend = self.m[p].pending
            in_flight = {pend.r: 1} if pend is not None and pend.samples is not None else {}
            assert +self.out[p] == Counter(in_flight), (p, +self.out[p], pend)

    def check_same_outcomes(self):
        """Every round that started has one outcome everywhere (no commit here, abort there)."""
        by_round = defaultdict(set)
        for p, d in self.outcome.items():
            for r, o in d.items():
                by_round[r].add(o)
        assert all(len(o) == 1 for o in by_round.values()), dict(by_round)


def cluster(ids="abc", run=1.0, **cfg):
    net = Net(ids, **cfg)
    net.found()
    net.run(run)
    return net
