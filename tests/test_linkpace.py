"""``LinkPace``: a lossy codec's chunk goes raw only where the link carries raw bytes clearly
sooner than the codec turns them out, counting what the link must drain first. Pure: made-up times."""

from __future__ import annotations

import pytest

from p2ptrain.collective.linkpace import MARGIN, SETTLED_BYTES, TRIAL_EACH, TRIAL_EVERY, LinkPace, raw_chunks_enabled
from p2ptrain.errors import ConfigError

N = 256 * 1024          # values in a chunk
INT8 = N + 4 * (N // 256)  # its int8 payload


SETTLED = SETTLED_BYTES // (1 << 20) + 1  # 1 MiB sends before a rate is trusted


def drained_at(pace: LinkPace, rate: float, sends: int = SETTLED, nbytes: int = 1 << 20) -> None:
    """Sends that the kernel took whole and drained at ``rate`` while they ran (dry after each)."""
    t = 0.0
    for _ in range(sends):
        pace.sent(t, 0, t + nbytes / rate, 0, nbytes)
        t += 2 * nbytes / rate


def busy_at(pace: LinkPace, rate: float, sends: int = SETTLED + 1, nbytes: int = 1 << 20) -> float:
    """Sends into a link that stays behind: each gap drains ``nbytes`` at ``rate``, the queue
    never empty (the next send finds it back at 4 sends' worth). Returns when the next is due."""
    t, queued = 0.0, 4 * nbytes
    for _ in range(sends):
        pace.sent(t, queued, t + 1e-5, queued + nbytes, nbytes)
        t += 1e-5 + nbytes / rate
    return t


def codec(pace: LinkPace, ns_per_value: float) -> None:
    pace.encoded(N, ns_per_value * 1e-9 * N)


def test_nothing_measured_keeps_the_codec():
    pace = LinkPace()
    assert not pace.send_raw(N, INT8, 0)
    codec(pace, 20)
    assert not pace.send_raw(N, INT8, 0)  # (the codec's cost alone says nothing of the link)


def test_a_fast_link_beside_a_slow_codec_goes_raw_unless_its_queue_outlasts_the_codec_or_unknown():
    pace = LinkPace()
    drained_at(pace, 5e9)   # loopback: 5 GB/s, 3 bytes a value saved cost 0.6 ns
    codec(pace, 10)         # a codec at 10 ns a value (a busy machine's wall time): 2.6 ms a chunk
    assert pace.send_raw(N, INT8, 0)
    # Behind by a few chunks (the next peer busy reading): drained in 0.8 ms, long before the
    # codec would be done, so raw is still sooner. Encoding here made
    # int8 train 8-15 % slower than fp32 on loopback, both ends busier for bytes that cost nothing.
    assert pace.send_raw(N, INT8, 4 * 4 * N)
    # A queue that takes longer to drain than the codec takes: the link sets the pace, fewer
    # bytes are sooner.
    assert not pace.send_raw(N, INT8, int(5e9 * 3e-3))
    assert not pace.send_raw(N, INT8, None)      # the OS cannot tell: as asked


def test_a_rate_read_over_little_traffic_keeps_the_codec():
    """A few small calls' samples may be a burst's (one CI run of lan.py's quick 100 Mbit/s
    test, a few calls of at most 1 MiB, sent every int8 chunk raw): nothing goes raw before
    the link has drained SETTLED_BYTES in samples."""
    pace = LinkPace()
    drained_at(pace, 5e9, sends=4)   # 4 MiB at 5 GB/s
    codec(pace, 10)
    assert pace.rate > 1e9 and not pace.send_raw(N, INT8, 0)
    drained_at(pace, 5e9)            # and then enough of it
    assert pace.send_raw(N, INT8, 0)


def test_a_slow_link_keeps_the_codec_however_busy_the_cpu():
    pace = LinkPace()
    busy_at(pace, 125e6)    # 1 Gbit/s: 3 bytes a value saved cost 24 ns
    codec(pace, 20)
    assert not pace.send_raw(N, INT8, 0)
    codec(pace, 200)        # (a codec ten times slower than the wire saves: raw, then)
    codec(pace, 200)
    codec(pace, 200)
    codec(pace, 200)
    assert pace.send_raw(N, INT8, 0)


def test_bunched_acknowledgements_do_not_make_a_slow_link_look_fast():
    pace = LinkPace()
    t = busy_at(pace, 125e6)
    assert 120e6 < pace.rate < 130e6
    pace.sent(t, 1 << 22, t + 2e-4, (1 << 22) - (256 << 10), 0)  # then 256 KiB acked in 0.2 ms (1.3 GB/s)
    assert pace.rate < 150e6
    codec(pace, 20)
    assert not pace.send_raw(N, INT8, 0)


def test_a_token_buckets_burst_does_not_make_a_slow_link_look_fast():
    pace = LinkPace()
    t = busy_at(pace, 125e6)
    pace.sent(t + 1.0, 0, t + 1.0 + 2e-4, 0, 256 << 10)  # after an idle second, 256 KiB out at once
    assert pace.rate < 200e6
    codec(pace, 20)
    assert not pace.send_raw(N, INT8, 0)


def test_idle_time_between_rounds_does_not_make_a_fast_link_look_slow():
    pace = LinkPace()
    t = 0.0
    for _ in range(SETTLED // 2 + 1):  # 1 MiB sends at 5 GB/s, then the link idles 100 ms (a step's compute)
        pace.sent(t, 0, t + 2e-4, 0, 1 << 20)
        t += 0.1
        pace.sent(t, 64 << 10, t + 2e-4, 0, 1 << 20)  # (a frame of the next round still queued)
        t += 0.1
    assert pace.rate > 1e9
    codec(pace, 10)
    assert pace.send_raw(N, INT8, 0)


@pytest.mark.parametrize("times_saved, raw", [(MARGIN * 0.75, False), (MARGIN * 1.25, True)])
def test_raw_must_win_by_the_margin(times_saved, raw):
    pace = LinkPace()
    drained_at(pace, 1e9)
    saved_ns = (4 * N - INT8) / 1e9 / N * 1e9
    codec(pace, times_saved * saved_ns)
    assert pace.send_raw(N, INT8, 0) is raw


def test_the_codecs_cost_counts_both_ends():
    pace = LinkPace()
    drained_at(pace, 1e9)   # saving 3 bytes a value costs 3 ns
    codec(pace, 4)          # 4 ns to encode: under the margin alone
    assert not pace.send_raw(N, INT8, 0)
    pace.decoded(N, 4e-9 * N)  # ... and 4 to decode: 8 ns, over it
    assert pace.send_raw(N, INT8, 0)


def test_the_environment_switch(monkeypatch):
    monkeypatch.delenv("P2PTRAIN_RAW_CHUNKS", raising=False)
    assert raw_chunks_enabled()
    monkeypatch.setenv("P2PTRAIN_RAW_CHUNKS", "0")
    assert not raw_chunks_enabled()
    monkeypatch.setenv("P2PTRAIN_RAW_CHUNKS", "yes")
    with pytest.raises(ConfigError, match="P2PTRAIN_RAW_CHUNKS='yes': expected 0 or 1"):
        raw_chunks_enabled()


def test_a_peer_on_this_machine_times_whole_calls_both_ways_and_keeps_the_quicker():
    """Loopback: the figures say nothing there (the kernel copies on the cores the codec would
    use; which way is sooner depends on the machine: raw on one 2-core VM, the codec on another).
    Once settled, calls go raw and encoded by their parity, TRIAL_EACH each, timed from the
    first chunk's arrival; the quicker way is kept for TRIAL_EVERY calls, then timed again."""
    lan, local = LinkPace(), LinkPace(same_host=True)
    for pace in (lan, local):
        codec(pace, 0.5)
        drained_at(pace, 1e8, sends=SETTLED_BYTES // (1 << 20) - 1)
        pace.call_began(0)
        assert not pace.send_raw(N, INT8, 0)  # (a short run: as asked)
        pace.call_ended(N, 0.01)
        drained_at(pace, 1e8, sends=1)
    assert not lan.send_raw(N, INT8, 0)
    for quicker_raw in (False, True):
        ways = []
        for op in range(1, 1 + 2 * TRIAL_EACH):
            local.call_began(op)
            ways.append(local.send_raw(N, INT8, None))
            raw_s, coded_s = (1.0, 2.0) if quicker_raw else (2.0, 1.0)
            local.call_ended(N, raw_s if ways[-1] else coded_s)
        assert ways == [op % 2 == 0 for op in range(1, 1 + 2 * TRIAL_EACH)]  # (the same on every peer)
        assert local.chosen is quicker_raw
        for op in range(TRIAL_EVERY):  # kept, whatever the later calls take
            local.call_began(op)
            assert local.send_raw(N, INT8, 1 << 30) is quicker_raw
            local.call_ended(N, 9.0)
        local.call_began(1)  # (then timed again)
        assert local.chosen is None and not local.send_raw(N, INT8, None)
        local.call_ended(N, None)  # (a call where no chunk came is not a sample)
        local.call_began(2)
        assert local.send_raw(N, INT8, None)
        local.call_ended(N, 5.0)
        local._timed = {True: [], False: []}  # (the next round of the loop starts its trial clean)