"""``bench/fuzz.py --coverage`` (``bench/_fuzz_coverage.py``): without atheris it says how to install
it in one line and exits 2; with atheris, one parser's short run reports libFuzzer's counts (skipped
where atheris is not installed); a finding in libFuzzer's output is read as one."""

from __future__ import annotations

import importlib.util
import sys

import pytest

import _fuzz_coverage  # (bench/, on the path: conftest)
import fuzz

pytestmark = pytest.mark.timeout(60)


def test_coverage_without_atheris_says_how_to_install_it(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "atheris", None)  # (``import atheris`` fails, as where it is not installed)
    assert fuzz.main(["--coverage", "--targets", "frame"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert len(err.strip().splitlines()) == 1 and "pip install atheris" in err


@pytest.mark.skipif(importlib.util.find_spec("atheris") is None,
                    reason="atheris is not installed (pip install -e .[fuzz])")
def test_a_short_coverage_guided_run_of_the_frame_decoder(tmp_path, capsys):
    found = tmp_path / "found"
    assert fuzz.main(["--coverage", "--targets", "frame", "--inputs", "3000", "--seconds", "30",
                      "--findings", str(found), "--corpus", str(tmp_path / "corpus")]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("| frame "))
    name, inputs, rate, cov, ft, corpus, rss, findings = [c.strip() for c in row.strip("| ").split("|")]
    assert inputs == "3,000" and findings == "0"
    assert int(cov) > 20  # (edges of p2ptrain.net.wire: the package is instrumented, not only the target)
    assert len(list((tmp_path / "corpus" / "frame").iterdir())) >= 3  # (the samples seeded it)
    assert not found.exists()  # (made for the run, and removed: nothing found)


CRASH_LOG = """\
#903\tREDUCE cov: 25 ft: 49 corp: 8/226b lim: 4096 exec/s: 0 rss: 458Mb L: 17/50 MS: 1 Custom-

 === Uncaught Python exception: ===
KeyError: 'planted'
Traceback (most recent call last):
  File "bench/_fuzz_coverage.py", line 201, in one_input
KeyError: 'planted'

finding written to /tmp/found/keepalive-crash-98656572f09ce093a070329af7de8b71c092090c
==28955== ERROR: libFuzzer: fuzz target exited
artifact_prefix='/tmp/found/keepalive-'; Test unit written to /tmp/found/keepalive-crash-98656572f09ce093a070329af7de8b71c092090c
stat::number_of_executed_units: 782
stat::average_exec_per_sec:     391
stat::peak_rss_mb:              458
"""


def test_a_crash_in_libfuzzers_output_is_one_finding_with_its_input():
    r = _fuzz_coverage.parse(CRASH_LOG, 77)
    assert r["findings"] == ["/tmp/found/keepalive-crash-98656572f09ce093a070329af7de8b71c092090c"]
    assert r["error"] == "KeyError: 'planted'"
    assert (r["inputs"], r["cov"], r["ft"], r["rss_mb"]) == (782, "25", "49", 458)
