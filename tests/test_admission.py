"""Limits on connections not yet admitted: pure counters and a log gate, no sockets, no clock."""

import pytest

from p2ptrain.net import admission


def test_pending_handshakes_are_capped_per_source_and_in_all():
    pending = admission.PendingHandshakes(per_source=2, total=3)
    assert pending.begin("10.0.0.1") and pending.begin("10.0.0.1")
    assert not pending.begin("10.0.0.1")  # (a third from one address)
    assert pending.begin("10.0.0.2")
    assert not pending.begin("10.0.0.3") and len(pending) == 3  # (full)
    pending.end("10.0.0.1")
    assert pending.begin("10.0.0.3") and len(pending) == 3
    with pytest.raises(RuntimeError):
        pending.end("10.0.0.9")


def test_one_line_per_source_address_a_minute_with_the_count_kept_quiet():
    said = admission.SaidPerSource(every=60.0)
    assert said.say("10.0.0.1", now=0.0) == 0
    assert [said.say("10.0.0.1", now=t) for t in (1.0, 30.0, 59.0)] == [None, None, None]
    assert said.say("10.0.0.2", now=2.0) == 0  # (another address: its own line)
    assert said.say("10.0.0.1", now=60.0) == 3  # (a minute on: one line, saying 3 were kept quiet)
    assert said.say("10.0.0.1", now=61.0) is None


def test_the_log_gate_remembers_a_bounded_number_of_addresses():
    said = admission.SaidPerSource(every=60.0, remember=2)
    for i, host in enumerate(["a", "b", "c"]):
        assert said.say(host, now=float(i)) == 0
    assert len(said._last) == 2 and said.say("a", now=3.0) == 0  # (forgotten, said again)


@pytest.mark.parametrize("remote, source", [("127.0.0.1:5000", "127.0.0.1"), ("[::1]:7000", "::1"),
                                            ("fe80::1%eth0:7000", "fe80::1%eth0"), ("incoming", "incoming")])
def test_the_source_of_a_remote_is_its_address_without_the_port(remote, source):
    assert admission.source_of(remote) == source
