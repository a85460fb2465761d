"""Faults with real processes (``python -m p2ptrain join`` on loopback): a member killed with
SIGKILL, the coordinator killed, a laptop's lid closed and opened (SIGSTOP, SIGCONT), a peer joining mid-training from other parameters, a graceful
leave. After each, the survivors keep training, every sample they computed is applied (their
per-round contributions add up to what they stepped, less batches voided by a state load,
which are counted), and their parameters agree."""

import datetime
import json
import signal
import subprocess
import sys
import time

import pytest
from helpers import ports
from netns_util import make_lan, requires_netns  # noqa: F401  (make_lan is a fixture)

pytestmark = pytest.mark.timeout(240)



class Peers:
    """Join processes writing metrics and logs under tmp_path; all killed at the end."""

    def __init__(self, tmp_path, extra=(), lan=None):
        self.tmp, self.extra, self.procs, self.ports, self.lan = tmp_path, list(extra), {}, {}, lan

    def start(self, name, *, seed=0, max_rounds=100_000, host=None, args=("--secret", "s"), task="synthetic"):
        """On loopback with --peers (the peers started so far), or on ``lan`` host ``host`` by discovery."""
        port = ports(1)[0] if host is None else 7000
        others = ",".join(f"127.0.0.1:{q}" for n, q in self.ports.items() if n != name)
        self.ports[name] = port
        where = ["--no-discovery", *(["--peers", others] if others else [])] if host is None else []
        cmd = [sys.executable, "-m", "p2ptrain", "join", "--task", task, "--model-size", "100k",
               "--batch-size", "16", "--step-delay", "0.02",  # (a core left free: the tests beside run on)
               "--port", str(port), "--eval-every", "0", "--seed", str(seed),
               "--max-rounds", str(max_rounds), "--metrics", str(self.tmp / f"{name}.jsonl"), "--checksum-every", "1", *where, *args,
               "--save", str(self.tmp / f"{name}-model.pt"), *self.extra]  # (not in the checkout: the current folder)
        err = open(self.tmp / f"{name}.log", "w")
        if host is None:
            self.procs[name] = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, text=True)
        else:
            self.procs[name] = self.lan.popen(host, cmd, stdout=subprocess.DEVNULL, stderr=err, text=True)
        err.close()

    def records(self, name):
        path = self.tmp / f"{name}.jsonl"
        if not path.exists():
            return []
        out = []
        for line in open(path):
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:  # a line being written
                break
        return out

    def log(self, name):
        return (self.tmp / f"{name}.log").read_text()

    def wait(self, what, predicate, timeout=90):
        deadline = time.monotonic() + timeout
        while not predicate():
            dead = {n: p.returncode for n, p in self.procs.items() if p.poll() not in (None, 0, -9)}
            assert not dead, f"{dead} exited while waiting for {what}: {[self.log(n)[-1500:] for n in dead]}"
            assert time.monotonic() < deadline, f"timed out waiting for {what}: " + \
                " | ".join(f"{n}: {self.events(n)}" for n in self.procs)
            time.sleep(0.2)

    def events(self, name, count=20):
        """The last ``count`` lines of a peer's log that are not its status lines (what it did:
        links, views, loads, warnings), then its last status line."""
        lines = self.log(name).splitlines()
        status = [line for line in lines if "p2ptrain.join: round " in line]
        said = [line for line in lines if "p2ptrain.join: round " not in line]
        return "\n".join(said[-count:] + status[-1:])

    def rounds(self, name, since_load=False):
        """The per-round records; ``since_load``: only those after the peer last loaded state."""
        out = []
        for r in self.records(name):
            if r.get("event") == "loaded" and since_load:
                out = []
            elif "round" in r and "event" not in r:
                out.append(r)
        return out

    def coordinator(self):
        """The live peer whose log says it coordinates now: its last "coordinating from epoch"
        comes after its last "no longer coordinating" (every peer leads itself at first)."""
        leading = [n for n in self.procs if self.procs[n].poll() is None
                   and self.log(n).rfind("coordinating from epoch") > self.log(n).rfind("no longer coordinating")]
        return leading[0] if len(leading) == 1 else None  # (None: a takeover is under way)

    def stop_all(self):
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
        for p in self.procs.values():
            p.wait(timeout=30)


def load_reasons(peers, name, after):
    """Why peer ``name`` loaded state after wall time ``after``, from its log ("split: ...",
    "behind: ...")."""
    out = []
    for line in peers.log(name).splitlines():
        stamp, _, rest = line.partition(" WARNING p2ptrain.cluster.cluster: loading state again: ")
        if rest and datetime.datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp() > after:
            out.append(rest)
    return out


def checksums(peers, name):
    """Round -> parameter checksum, for the rounds after the peer last loaded state that carry one
    (a record written together with a later round's carries none: null)."""
    return {r["round"]: r["param_checksum"] for r in peers.rounds(name, since_load=True) if r["param_checksum"]}


def common_rounds(by_round) -> set:
    """The rounds every peer's ``checksums`` hold."""
    return set.intersection(*(set(b) for b in by_round))


def at_least(peers, names, n):
    return lambda: all(len(peers.rounds(x)) >= n for x in names)


def assert_nothing_lost_and_replicas_agree(peers, survivors):
    """Each survivor's contributions, round by round, add up to what it stepped, and nothing is
    dropped but at a state load; and every survivor holds the same parameters after each round
    they all applied."""
    for name in survivors:
        summary = peers.records(name)[-1]
        assert summary.get("event") == "summary", peers.log(name)[-1500:]
        applied = sum(r["own_samples"] for r in peers.rounds(name))
        # a batch computed before loading the cluster's state (at the start, or the smaller side of a
        # split) is void, and counted; at staleness 0 nothing else is ever dropped
        # (and the batch a stopped step had handed over, if no round took it before the peer left)
        assert applied + summary["dropped"] + summary["unapplied"] == summary["own_samples"], (name, applied, summary)
        assert summary["unapplied"] in (0, 16), summary  # (one batch at most, at staleness 0)
        since = peers.rounds(name, since_load=True)
        assert len(since) >= 3 and since[1]["dropped"] == summary["dropped"], (name, since[:3], summary)
    by_round = [checksums(peers, n) for n in survivors]
    common = common_rounds(by_round)
    assert len(common) >= 5
    for r in common:
        assert len({b[r] for b in by_round}) == 1, f"replicas differ after round {r}: " + " | ".join(
            f"{n}: {b[r]} {peers.events(n, 8)}" for n, b in zip(survivors, by_round))
    # (final checksums are not compared: peers stopped at once may differ by the round in flight when
    # they left, which a leaver cannot know committed, and by updates applied while leaving)


def test_sigstop_and_sigkill_of_a_member_then_sigkill_of_the_coordinator(tmp_path):
    """A member frozen (SIGSTOP: a laptop's lid) stalls the others' round for 5 s of its silence
    (half the 10 s peer timeout: ``Leader.silent_members``), not until the timeout expires it;
    woken, it tells its state at once, loads the cluster's (behind) and trains in the view again.
    Then it is killed, then the coordinator: the others go on each time, nothing lost."""
    peers = Peers(tmp_path, extra=["--min-peers", "2"])
    try:
        for name in "abcd":
            peers.start(name)
        peers.wait("4 members", lambda: any(r["members"] == 4 for r in peers.rounds("a")))
        peers.wait("rounds of 4", at_least(peers, "abcd", 8))
        peers.wait("one coordinator", lambda: peers.coordinator() is not None)
        boss = peers.coordinator()
        first = [n for n in "abcd" if n != boss][0]
        base = len(peers.rounds(boss))
        stopped_at = time.time()
        peers.procs[first].send_signal(signal.SIGSTOP)
        peers.wait("3 members without it", lambda: any(r["members"] == 3 for r in peers.rounds(boss)[base:]), 30)
        gone_on = next(r["time"] for r in peers.rounds(boss)[base:] if r["members"] == 3) - stopped_at
        woke_at = time.time()
        peers.procs[first].send_signal(signal.SIGCONT)
        assert gone_on < 8.0, (gone_on, peers.events(boss))  # (the peer timeout: 10 s)
        base = len(peers.rounds(first))
        peers.wait("4 members again", lambda: sum(r["members"] == 4 for r in peers.rounds(first)[base:]) >= 3)
        back = next(r["time"] for r in peers.rounds(first)[base:] if r["members"] == 4) - woke_at
        assert back < 4.0 and [x.split(":")[0] for x in load_reasons(peers, first, woke_at)] == ["behind"], \
            (back, peers.events(first))
        killed_at = time.time()
        peers.procs[first].send_signal(signal.SIGKILL)
        left = [n for n in "abcd" if n != first]
        base = {n: len(peers.rounds(n)) for n in left}
        peers.wait("3 members go on", lambda: all(
            sum(r["members"] == 3 for r in peers.rounds(n)[base[n]:]) >= 5 for n in left))
        peers.wait("one coordinator", lambda: peers.coordinator() is not None)
        boss = peers.coordinator()
        peers.procs[boss].send_signal(signal.SIGKILL)
        survivors = [n for n in left if n != boss]
        base = {n: len(peers.rounds(n)) for n in survivors}
        peers.wait("2 members go on", lambda: all(
            sum(r["members"] == 2 for r in peers.rounds(n)[base[n]:]) >= 5 for n in survivors))
        wait_agreeing(peers, survivors)
        finish_all(peers, survivors)  # (a graceful end: exit 0, summary written)
        assert_nothing_lost_and_replicas_agree(peers, survivors)
        for n in survivors:  # the kills split nobody off: the numbering went on, with no state loaded
            since = [r for r in peers.records(n) if r.get("time", 0) > killed_at and r.get("event") != "summary"]
            rounds = [r.get("round") for r in since if "event" not in r]
            assert not any("event" in r for r in since) and rounds == sorted(set(rounds)), \
                (n, [r.get("event", r["round"]) for r in since], peers.log(n)[-3000:])
    finally:
        peers.stop_all()


def test_a_stopped_coordinator_is_given_up_after_5_s_and_rejoins_by_loading_the_state(tmp_path):
    """The coordinator frozen (SIGSTOP: a laptop's lid) stalls the others for 5 s of its silence
    (``Member.give_up_silent_leader``), not the 10 s peer timeout: the next peer leads and the
    two commit rounds without it; woken, it loads the state (behind; split where it was stopped
    between committing a round and sending it) and trains in the view again, nothing lost, the
    replicas equal."""
    peers = Peers(tmp_path, extra=["--min-peers", "2"])
    try:
        for name in "abc":
            peers.start(name)
        peers.wait("rounds of 3", lambda: all(sum(r["members"] == 3 for r in peers.rounds(n)) >= 8 for n in "abc"))
        peers.wait("one coordinator", lambda: peers.coordinator() is not None)
        boss = peers.coordinator()
        others = [n for n in "abc" if n != boss]
        base = {n: len(peers.rounds(n)) for n in others}
        stopped_at = time.time()
        peers.procs[boss].send_signal(signal.SIGSTOP)
        peers.wait("2 members without it", lambda: all(
            sum(r["members"] == 2 for r in peers.rounds(n)[base[n]:]) >= 3 for n in others), 30)
        gone_on = min(next(r["time"] for r in peers.rounds(n)[base[n]:] if r["members"] == 2) for n in others)
        woke_at = time.time()
        peers.procs[boss].send_signal(signal.SIGCONT)
        assert gone_on - stopped_at < 8.0, (gone_on - stopped_at, peers.events(others[0]))  # (the peer timeout: 10 s)
        base = len(peers.rounds(boss))
        peers.wait("3 members again", lambda: sum(r["members"] == 3 for r in peers.rounds(boss)[base:]) >= 3)
        reasons = [x.split(":")[0] for x in load_reasons(peers, boss, woke_at)]
        if reasons == ["split"]:  # stopped between committing a round and sending it: the others decided
            mine = {r["round"]: r["members"] for r in peers.rounds(boss)}  # that round again without it
            twice = [r["round"] for r in peers.rounds(others[0]) if r["members"] == 2 and mine.get(r["round"]) == 3]
            assert twice, (peers.events(boss), sorted(mine.items())[-5:])
        else:
            assert reasons == ["behind"], peers.events(boss)
        wait_agreeing(peers, "abc")
        finish_all(peers, "abc")  # (a graceful end: exit 0, summary written)
        assert_nothing_lost_and_replicas_agree(peers, "abc")
    finally:
        peers.stop_all()  # (SIGKILL ends a stopped process too)


@pytest.mark.parametrize("mode", [(), ("--sync-every", "4", "--compression", "int8")], ids=["gradients", "local-steps"])
def test_a_laptop_lid_closed_then_opened_rejoins_by_loading_the_state(tmp_path, mode):
    """A frozen process (SIGSTOP: a lid closed, its sockets still open) stalls the other for
    one silence timeout, not for ever; when it wakes (SIGCONT) it is behind, loads the state,
    and trains in the view again, with nothing lost but its batch from before the lid closed.
    (b trains only with others, --min-peers 2: woken after the silence timeout, it finds itself
    alone too, and the synthetic task's ~1000 rounds a second alone could outrun a's lead.)
    In local-steps mode too (a's last inner steps were once lost as both left at once). b loaded
    a's state as from a split in two ways, both fixed (``RoundMachine._notice_stillness``): woken,
    it expired a before reading its messages; and, leading the round in flight at the freeze, it
    committed it on a's DONE that had waited in its socket, though a had aborted it in doubt
    (both params failed so in one CI run, where b started first and led)."""
    peers = Peers(tmp_path, extra=mode)
    try:
        for name, least in (("a", "1"), ("b", "2")):
            peers.start(name, args=("--secret", "s", "--min-peers", least))
        peers.wait("rounds of 2", lambda: all(sum(r["members"] == 2 for r in peers.rounds(n)) >= 5 for n in "ab"))
        peers.procs["b"].send_signal(signal.SIGSTOP)
        base = len(peers.rounds("a"))
        peers.wait("a goes on alone", lambda: sum(r["members"] == 1 for r in peers.rounds("a")[base:]) >= 5)
        woke_at = time.time()
        peers.procs["b"].send_signal(signal.SIGCONT)
        base = {n: len(peers.rounds(n)) for n in "ab"}
        peers.wait("rounds of 2 again", lambda: all(
            sum(r["members"] == 2 for r in peers.rounds(n)[base[n]:]) >= 5 for n in "ab"))
        wait_agreeing(peers, "ab")
        finish_all(peers, "ab")  # (a graceful end: exit 0, summary written)
        reasons = [reason.split(":")[0] for reason in load_reasons(peers, "b", woke_at)]
        # One split is right: b led, committed a round and froze before its COMMIT reached the
        # socket; a, which gave b up, aborted that round in doubt (no survivor had committed it), so
        # b's last update is not on a's chain. Seen once in CI, when b led the next round with the
        # COMMIT still in its outbox; the actor now yields before each event (``Cluster._serve_events``),
        # which leaves the moment between the decision and its send. Any other split is a bug above.
        led_at_freeze = "aborted: this peer stood still" in peers.log("b")
        assert reasons == ["behind"] or (reasons == ["split"] and led_at_freeze), (reasons, peers.log("b")[-3000:],
                                                                                    peers.log("a")[-3000:])
        assert_nothing_lost_and_replicas_agree(peers, "ab")
    finally:
        peers.stop_all()  # (SIGKILL ends a stopped process too)


def test_a_joiner_from_other_parameters_loads_the_state_and_a_graceful_leave(tmp_path):
    peers = Peers(tmp_path, extra=["--min-peers", "2"])
    try:
        peers.start("a")
        peers.start("b")
        peers.wait("rounds of 2", at_least(peers, "ab", 10))
        # Other initial parameters (not another --seed: that is another cluster's, and refused): only
        # the state transfer makes it match.
        other = tmp_path / "other_init.py"
        other.write_text("import torch\nfrom p2ptrain.tasks import load_task\n\n\ndef make_task(options):\n"
                         "    task = load_task('synthetic', options)\n    g = torch.Generator().manual_seed(7)\n"
                         "    with torch.no_grad():\n        for p in task.model.parameters():\n"
                         "            p.add_(torch.randn(p.shape, generator=g))\n    return task\n")
        peers.start("c", task=str(other))
        peers.wait("the joiner's rounds", at_least(peers, "c", 5))
        assert "loaded the cluster's state" in peers.log("c")
        peers.procs["a"].send_signal(signal.SIGTERM)
        assert peers.procs["a"].wait(timeout=60) == 0, peers.log("a")[-1500:]
        left = time.time()  # (its goodbye went out before it exited)
        base = {n: len(peers.rounds(n)) for n in "bc"}
        peers.wait("2 members go on", lambda: all(
            sum(r["members"] == 2 for r in peers.rounds(n)[base[n]:]) >= 5 for n in "bc"))
        reformed = min(r["time"] for r in peers.rounds("b") if r["time"] > left and r["members"] == 2)
        assert reformed - left < 5.0  # at once on its goodbye, not after the 10 s silence timeout
        wait_agreeing(peers, ["b", "c"])
        finish_all(peers, "bc")  # (a graceful end: exit 0, summary written)
        assert_nothing_lost_and_replicas_agree(peers, ["b", "c"])
        joined, founders = checksums(peers, "c"), checksums(peers, "a")
        shared = set(joined) & set(founders)
        assert shared and all(joined[r] == founders[r] for r in shared)  # from its first round on
    finally:
        peers.stop_all()


def wait_agreeing(peers, names, n=5):
    """Until ``names`` hold ``n`` checksummed rounds in common since their last loads, what
    ``assert_nothing_lost_and_replicas_agree`` compares: a record written together with a later
    round's carries no checksum, so a count of rounds alone can leave fewer (4 once, after a
    woken coordinator's 3 rounds back in the view)."""
    peers.wait(f"{n} checked rounds in common", lambda: len(common_rounds([checksums(peers, x) for x in names])) >= n)


def finish_all(peers, names):
    for n in names:
        peers.procs[n].send_signal(signal.SIGTERM)
    for n in names:
        assert peers.procs[n].wait(timeout=60) == 0, peers.log(n)[-1500:]


@requires_netns
def test_discovery_alone_forms_one_ring_and_keeps_strangers_out(tmp_path, make_lan):
    """Three hosts with no --peers find each other by beacons; a peer with the wrong secret and
    one of another cluster are heard but never become members."""
    lan = make_lan(5)
    peers = Peers(tmp_path, lan=lan)
    try:
        for i, name in enumerate("abc"):
            peers.start(name, host=i, args=("--secret", "s", "--min-peers", "3"))
        peers.start("wrong", host=3, args=("--secret", "other"))
        peers.start("elsewhere", host=4, args=("--secret", "s", "--cluster", "other"))
        peers.wait("rounds of 3", at_least(peers, "abc", 20), timeout=120)
        wait_agreeing(peers, ["a", "b", "c"])
        finish_all(peers, ["a", "b", "c", "wrong", "elsewhere"])
        assert all(r["members"] == 3 for n in "abc" for r in peers.rounds(n))
        assert all(r["members"] == 1 for n in ("wrong", "elsewhere") for r in peers.rounds(n))
        assert_nothing_lost_and_replicas_agree(peers, ["a", "b", "c"])
        assert "refused" in peers.log("wrong") or "secret" in peers.log("wrong")
    finally:
        peers.stop_all()


@requires_netns
def test_a_cable_pulled_splits_the_cluster_and_plugging_it_back_heals_it(tmp_path, make_lan):
    """Host c loses its link: a and b detect it and go on; c goes on alone (min peers 1).
    Replugged, the smaller side (c) loads the bigger side's state; then all three agree. The
    link's silence is noticed after ``--peer-timeout`` (5 s here; the default is 10)."""
    lan = make_lan(3)
    peers = Peers(tmp_path, lan=lan, extra=("--peer-timeout", "5"))
    try:
        for i, name in enumerate("abc"):
            peers.start(name, host=i)
        peers.wait("rounds of 3", lambda: all(sum(r["members"] == 3 for r in peers.rounds(n)) >= 10 for n in "abc"),
                    timeout=120)
        lan.set_link(2, False)
        pulled = time.monotonic()
        base = {n: len(peers.rounds(n)) for n in "abc"}
        peers.wait("both sides go on", lambda: all(sum(r["members"] == 2 for r in peers.rounds(n)[base[n]:]) >= 5
                                                   for n in "ab")
                   and sum(r["members"] == 1 for r in peers.rounds("c")[base["c"]:]) >= 5, timeout=120)
        detected = time.monotonic() - pulled
        assert detected < 10, f"--peer-timeout 5, yet both sides went on {detected:.1f} s after the cable was pulled"
        lan.set_link(2, True)
        replugged = time.time()
        base = {n: len(peers.rounds(n)) for n in "abc"}
        peers.wait("healed", lambda: all(sum(r["members"] == 3 for r in peers.rounds(n)[base[n]:]) >= 5
                                         for n in "abc"), timeout=120)
        wait_agreeing(peers, "abc")
        finish_all(peers, "abc")
        # the smaller side loaded the bigger side's state after the replug (its own solo rounds are discarded)
        assert any(r.get("event") == "loaded" and r["time"] > replugged for r in peers.records("c")), \
            peers.log("c")[-2000:]
        # and the bigger side kept its own: neither of a and b took the smaller side's state. (A member
        # may still catch up on its own side's rounds, "behind", when its link to c formed last and it
        # missed a round or two; that keeps the bigger side's state too.)
        for name in "ab":
            reasons = load_reasons(peers, name, after=replugged)
            assert not [why for why in reasons if why.startswith("split")] and len(reasons) <= 3, \
                (reasons, peers.log(name)[-3000:])
        # the smaller side's batches in flight when it loads the bigger side's state are void (and counted)
        assert_nothing_lost_and_replicas_agree(peers, ["a", "b", "c"])
        print(f"split detected and both sides training again {detected:.1f} s after the cable was pulled")
    finally:
        peers.stop_all()
