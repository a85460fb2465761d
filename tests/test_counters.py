"""What ``join`` counts (``p2ptrain.commands.counters``): this run's rounds, the cluster's round
numbers, and rates over the last seconds, however the run began (a resume, a state load, a late
join). Pure, with a fake clock; then the status line as ``join`` writes it."""

import argparse
from types import SimpleNamespace

import pytest

from p2ptrain.cluster.records import RoundRecord
from p2ptrain.commands.counters import Rate, RunCounters
from p2ptrain.commands.join import _Join
from p2ptrain.commands.join_output import JoinOutput

pytestmark = pytest.mark.timeout(10)


def record(r, samples=64, wire=1000):
    return RoundRecord(r, 2, samples, samples // 2, wire, 4 * wire, 0.1, 0.0)


def test_a_rate_is_measured_over_the_last_window_not_since_the_start():
    rate = Rate(start=0.0, window=10.0)
    assert rate.per_second(0.0) == 0.0
    for t in range(1, 31):  # idle for the first 20 s (waiting, loading state), then 100 per second
        rate.add(100 if t > 20 else 0, float(t))
    assert rate.per_second(30.0) == pytest.approx(100.0)  # (the whole run's mean: 33)
    assert rate.per_second(35.0) == pytest.approx(50.0)  # nothing for 5 s: half the window was idle
    early = Rate(start=0.0, window=10.0)
    early.add(50, 2.0)
    assert early.per_second(2.0) == pytest.approx(25.0)  # younger than the window: since the start
    assert len(rate._points) <= 12  # bounded by the window


def test_a_late_joiner_counts_its_own_rounds_and_shows_the_clusters_round():
    count = RunCounters(start=0.0)
    count.stepped(32, 1.0)
    for k, r in enumerate((176, 177, 179)):  # it loaded round 175, then applied these (178 aborted)
        count.applied(record(r), 2.0 + k)
    assert (count.rounds, count.samples, count.own_samples, count.round) == (3, 192, 32, 179)


class Status:
    def show(self, text):
        self.text = text


def joined():
    job = _Join(argparse.Namespace(), None)
    job.output = JoinOutput(status=Status())
    job.output.batch_loss(1.5)
    return job


def fake_peer(version):
    cluster = SimpleNamespace(wire_bytes=3000, raw_bytes=12000)
    return SimpleNamespace(cluster=cluster, version=version, members=2, staleness_max=0)


def test_the_status_line_shows_the_clusters_update_of_the_last_and_when_it_ends():
    """One counter, the cluster's update (the version the metrics and the summary give), out of
    the run's last one, and an ETA from the updates of the last seconds."""
    job = joined()
    job.count = RunCounters(start=100.0)  # (a resumed peer: nothing of its checkpoint is counted)
    for k in range(10):
        job.count.stepped(32, 111.5 + k)
        job.count.applied(record(250 + k), 111.5 + k)
    job.output.report(fake_peer(version=551), job.count, 121.0, last_version=600)
    text = job.output.status.text
    assert text.startswith("update 551/600  eta 49s  members 2"), text  # (1 update a second, 49 to go)
    assert "samples/s 32 own, 64 cluster" in text and "wire 0.00 MB/s" in text, text
    assert job.count.rounds == 10 and job.count.samples == 640
    job.output.report(fake_peer(version=551), job.count, 121.0, elapsed=75.0, duration=600.0)
    assert job.output.status.text.startswith("update 551  time 1m15s/10m00s  eta 8m45s  members 2")


def test_validation_is_at_the_clusters_updates_whoever_counts(caplog):
    """A joiner that loaded update 75 validates at 100 and 200, as the founders do, not after
    its own 100th round."""
    import logging

    from p2ptrain.cluster.records import RoundLog

    job = joined()
    job.args = argparse.Namespace(eval_every=100, checkpoint_dir=None)
    log, evaluated = RoundLog(), []
    peer = fake_peer(version=75)
    peer.cluster.rounds, peer.cluster.loads = log, []
    task = SimpleNamespace(evaluate=lambda model, device: evaluated.append(peer.version) or 0.5)
    peer.model = None
    job.count, job._evaluated = RunCounters(start=0.0), peer.version
    caplog.set_level(logging.INFO, logger="p2ptrain.join")
    for k in range(150):  # rounds 176.. applied as updates 76..225
        log.append(RoundRecord(176 + k, 2, 64, 32, 0, 0, 0.1, 0.0, log.total))
        peer.version = 76 + k
        job._take_records(peer, task, None, None)
    assert evaluated == [100, 200]
    said = [r.getMessage() for r in caplog.records if "validation loss" in r.getMessage()]
    assert said == ["update 100  validation loss 0.5000", "update 200  validation loss 0.5000"]


def test_the_round_log_reads_safely_while_the_clusters_thread_appends():
    """``join`` reads the rounds on its own thread while the cluster's appends: every record
    comes once, in order, and a read never fails (iterating the old deque raised RuntimeError
    when an append came meanwhile, and join retried in a loop)."""
    import threading

    from p2ptrain.cluster.records import RoundLog

    log, n = RoundLog(keep=100_000), 50_000
    writer = threading.Thread(target=lambda: [log.append(RoundRecord(r, 2, 64, 32, 0, 0, 0.1, 0.0))
                                              for r in range(n)])
    seen: list[int] = []
    writer.start()
    while writer.is_alive() or len(seen) < n:
        seen += [record.index for record in log.since(len(seen))]
    writer.join()
    assert seen == list(range(n))
    assert [r.round for r in log.since(n - 2)] == [n - 2, n - 1] and log.last().round == n - 1


def test_the_round_log_keeps_the_last_records_and_reads_from_what_it_kept():
    from p2ptrain.cluster.records import RoundLog

    log = RoundLog(keep=3)
    assert log.since(0) == [] and log.last() is None
    for r in range(5):
        log.append(RoundRecord(r, 2, 64, 32, 0, 0, 0.1, 0.0))
    assert [r.index for r in log.since(0)] == [2, 3, 4]  # (what was dropped is gone)
    assert [r.index for r in log.since(4)] == [4] and log.since(5) == [] and len(log) == 3 and log.total == 5


def _metrics_lines(tmp_path, log, loads, model, looks, checksum_every=1):
    """``join``'s metrics file after ``_take_records`` at each of ``looks`` (callables that append
    to the round log and to the loads between two looks)."""
    import json

    import torch

    from p2ptrain.commands.join_output import MetricsFile
    from p2ptrain.tasks import param_checksum

    job = joined()
    job.args = argparse.Namespace(eval_every=0, checkpoint_dir=None, checksum_every=checksum_every)
    job.count = RunCounters(start=0.0)
    peer = fake_peer(version=0)
    peer.cluster.rounds, peer.cluster.loads = log, loads
    peer.param_checksum = lambda: param_checksum(model)
    metrics = MetricsFile(str(tmp_path / "m.jsonl"))
    for look in looks:
        with torch.no_grad():
            model.weight.add_(1.0)  # (every look sees other parameters)
        holds = look()  # (the round whose update the parameters hold last: None, the newest record's)
        newest = log.last()
        peer.metrics = SimpleNamespace(round=holds if holds is not None else newest and newest.round)
        peer.version = newest.round if newest else 0  # (one update a round, in these logs)
        job._take_records(peer, SimpleNamespace(evaluate=None), None, metrics)
    metrics.close()
    return [json.loads(line) for line in open(tmp_path / "m.jsonl")]


def test_a_state_load_is_recorded_where_it_fell_among_the_rounds(tmp_path):
    """A peer alone commits its last solo rounds as it rejoins, then loads the cluster's state,
    and join looks only after both: the solo rounds come before the "loaded" event in the
    metrics file, not after it among the cluster's rounds (where they were taken for rounds of
    the loaded lineage, and the cable test saw "replicas differ")."""
    import torch

    from p2ptrain.cluster.records import Loaded, RoundLog
    from p2ptrain.cluster.rounds import SyncPoint

    log, loads = RoundLog(), []

    def rejoin():
        for r in (3109, 3110):  # (solo rounds, committed as the peer stops being alone)
            log.append(RoundRecord(r, 1, 16, 16, 0, 0, 0.0, 0.0))
        loads.append(Loaded(SyncPoint(2990, b"d" * 16, 2990, 2990), log.total))

    def rounds_again():
        log.append(RoundRecord(2991, 3, 48, 16, 0, 0, 0.1, 0.0))

    lines = _metrics_lines(tmp_path, log, loads, torch.nn.Linear(2, 2), [rejoin, rounds_again])
    assert [x.get("event") or x["round"] for x in lines] == [3109, 3110, "loaded", 2991]
    assert lines[2]["round"] == 2990


def test_a_round_record_carries_a_checksum_only_of_the_parameters_after_that_round(tmp_path):
    """Several rounds applied between two looks (a peer alone commits a tick's worth): only the
    newest record is of the parameters join sees; the earlier ones carry none (null), and so
    does a round followed by a state load in the same look, and one committed but not applied
    yet (staleness >= 1: the parameters still hold the round before)."""
    import torch

    from p2ptrain.cluster.records import Loaded, RoundLog
    from p2ptrain.cluster.rounds import SyncPoint
    from p2ptrain.tasks import param_checksum

    log, loads, model = RoundLog(), [], torch.nn.Linear(2, 2)
    seen = []  # the parameters' checksum at each look

    def rounds(*rs, holds=None):
        def look():
            for r in rs:
                log.append(RoundRecord(r, 1, 16, 16, 0, 0, 0.0, 0.0))
            seen.append(param_checksum(model))
            return holds
        return look

    def round_then_load():
        rounds(7)()
        loads.append(Loaded(SyncPoint(5, b"d" * 16, 5, 5), log.total))

    lines = _metrics_lines(tmp_path, log, loads, model, [rounds(1, 2, 3), rounds(4), rounds(5, holds=4),
                                                         round_then_load])
    assert [x.get("event") or x["round"] for x in lines] == [1, 2, 3, 4, 5, 7, "loaded"]
    assert [x["param_checksum"] for x in lines[:6]] == [None, None, seen[0], seen[1], None, None]
    assert seen[0] != seen[1]


def test_records_carry_the_parameters_checksum_at_every_checksum_every_th_update_only(tmp_path):
    """``--checksum-every 3``: the checksum (a hash of every parameter, off the device) is in the
    records of updates 3, 6, ... only, the same ones on every peer; the others carry null."""
    import torch

    from p2ptrain.cluster.records import RoundLog

    log = RoundLog()

    def one(r):
        return lambda: log.append(RoundRecord(r, 2, 32, 16, 0, 0, 0.0, 0.0))

    lines = _metrics_lines(tmp_path, log, [], torch.nn.Linear(2, 2), [one(r) for r in range(1, 8)], checksum_every=3)
    assert [x["round"] for x in lines] == list(range(1, 8))
    assert [x["round"] for x in lines if x["param_checksum"]] == [3, 6]


def test_the_losses_between_records_take_the_same_memory_however_many_batches():
    """Without --metrics no record is ever written, so the losses since the last one are never
    taken: they are a sum and a count, not one float a batch kept for the whole run."""
    import tracemalloc

    class Out:
        def write(self, record):
            self.record = record

    output = JoinOutput(status=Status())
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for k in range(100_000):
            output.batch_loss(float(k % 7))
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown < 10_000, grown  # (a list of the floats: about 3.2 MB)
    out, peer = Out(), SimpleNamespace(param_checksum=lambda: "x")
    output.write_metrics(out, peer, record(1))
    assert out.record["loss"] == pytest.approx(sum(k % 7 for k in range(100_000)) / 100_000)
    output.batch_loss(2.0)
    output.write_metrics(out, peer, record(2))
    assert out.record["loss"] == 2.0  # (since the last record only)
    output.write_metrics(out, peer, record(3))
    assert out.record["loss"] == 2.0  # (no batch since: the last batch's)
