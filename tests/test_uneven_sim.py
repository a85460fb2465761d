"""bench/uneven_sim.py: its modes do what their rows say (in-process, a small model, a few ticks)."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import uneven_sim  # noqa: E402

pytestmark = [pytest.mark.timeout(120)]


def options(*argv):
    return uneven_sim.parse(["--model", "100k", "--ticks", "40", "--eval-every", "5", "--ring", "0", *argv])


def steps_taken(optimizer: torch.optim.Optimizer) -> int:
    return int(next(iter(optimizer.state.values()))["step"])


def test_gradient_mode_steps_once_a_slow_batch_and_a_round_lands_a_tick_later():
    run = uneven_sim.Run(options(), "gradients", 1)
    run.run()
    assert steps_taken(run.opts[0]) == 3  # (rounds close at ticks 10, 20, 30, 40; the last lands at 41)
    run = uneven_sim.Run(options("--slow", "4"), "gradients", 1)
    run.run()
    assert steps_taken(run.opts[0]) == 9


def test_a_round_takes_the_fast_peers_compute_for_its_ticks():
    run = uneven_sim.Run(options("--ring", "2"), "local", 1)
    run.run()
    assert steps_taken(run.opts[0]) == 40 - 2 * 3  # (rounds at 10, 20, 30 each cost 2 ticks; 40's is after the end)
    assert steps_taken(run.opts[1]) == 4  # (the slow peer: a step every 10 ticks)


def test_switch_and_accumulate_are_local_and_alone_until_their_tick_then_differ():
    a = options("--from", "1000")
    assert uneven_sim.Run(a, "switch", 1).run() == uneven_sim.Run(a, "local", 1).run()
    assert uneven_sim.Run(a, "accumulate", 1).run() == uneven_sim.Run(a, "alone", 1).run()
    a = options("--from", "20")
    switched = uneven_sim.Run(a, "switch", 1)
    assert switched.run() != uneven_sim.Run(a, "local", 1).run() and not switched.local
    accumulated = uneven_sim.Run(a, "accumulate", 1)
    accumulated.run()
    assert steps_taken(accumulated.opts[0]) == 19 + 2  # (a step a tick to 19, then one each 10 batches: at 29 and 39)


def test_the_table_reads_every_mode_against_the_alone_of_its_seed(capsys):
    assert uneven_sim.main(["--model", "100k", "--ticks", "60", "--eval-every", "5", "--seeds", "1,2",
                            "--modes", "local,alone", "--targets", "2.0,1.8"]) == 0
    rows = [l for l in capsys.readouterr().out.splitlines() if l.startswith("| 1 ") or l.startswith("| 2 ")]
    assert [r.split("|")[2].strip() for r in rows] == ["alone", "local"] * 2  # (alone first: the others' base)
    assert all(c.strip().endswith("(1.00x)") or c.strip() == "-" for r in rows[::2] for c in r.split("|")[3:5])
    with pytest.raises(SystemExit):
        uneven_sim.main(["--modes", "local,gradients"])  # (no alone to read them against)
