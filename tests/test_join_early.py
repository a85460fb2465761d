"""``join``'s mistakes said at once, in the user's words: before the task loads (seconds of torch
work), naming the flag typed (``--data``, not the library's ``data=``); no abbreviations; one
line of ``--help`` per option."""

import socket
import subprocess
import sys

import pytest
from helpers import ports, run_cli

from p2ptrain.commands import cli

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def no_task(monkeypatch):
    """A join that gets as far as loading its task fails the test: the check came too late."""
    import p2ptrain.tasks

    def loaded(*_, **__):
        raise AssertionError("the task was loaded before the mistake was said")

    monkeypatch.setattr(p2ptrain.tasks, "load_task", loaded)


def test_a_port_in_use_is_refused_before_the_task_loads(capsys, no_task):
    port = ports(1)[0]
    with socket.socket() as held:
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        held.bind(("0.0.0.0", port))
        held.listen()
        code, _, err = run_cli(capsys, "join", "--no-discovery", "--port", str(port), "--max-rounds", "1")
    assert code == 2 and len(err) == 1, err
    assert f"--port {port}: in use on this machine" in err[0] and "pick another --port" in err[0], err


@pytest.mark.parametrize("args, said", [
    (["--data", "/nonexistent/corpus.txt"], "--data /nonexistent/corpus.txt: no such file or folder"),
    (["--model-size", "huge"], "--model-size 'huge': not a parameter count"),
    (["--task", "synthetic", "--model-size", "-5"], "--model-size '-5': not a parameter count"),
    (["--task", "synthetic", "--data", "notes.txt"], "synthetic: --data notes.txt: this task makes its own data"),
])
def test_a_bad_data_or_model_size_is_said_before_the_task_loads_naming_the_flag(capsys, no_task, args, said):
    code, _, err = run_cli(capsys, "join", "--no-discovery", "--port", "0", "--max-rounds", "1", *args)
    assert code == 2 and len(err) == 1, err
    assert said in err[0], err


@pytest.mark.parametrize("typed, meant", [("--min-peer", "--min-peers"), ("--max-round", "--max-rounds"),
                                          ("--checkpoint", "--checkpoint-dir")])
def test_an_abbreviated_flag_is_refused_naming_the_one_meant(capsys, no_task, typed, meant):
    code, _, err = run_cli(capsys, "join", "--no-discovery", "--port", "0", typed, "2")
    assert code == 2 and len(err) == 1, err
    assert f"unrecognized arguments: {typed} (did you mean {meant}?)" in err[0], err


def test_every_parser_refuses_abbreviations():
    parser = cli.build_parser()
    assert parser.allow_abbrev is False
    assert all(p.allow_abbrev is False for p in parser.commands.values())


def test_join_help_is_one_line_per_option(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")  # (a terminal's default width)
    code, out, _ = run_cli(capsys, "join", "--help")
    assert code == 0
    lines = out.splitlines()
    options = [line for line in lines if line.startswith("  -")]
    # (an option's help on a line of its own, or wrapped onto the next, is a line indented further)
    follow_ons = [line for line in lines if line.startswith("   ")]
    assert len(options) >= 40 and follow_ons == [], follow_ons
    assert len(lines) < len(options) + 20, len(lines)  # (the usage, the group titles, the epilog)


@pytest.mark.timeout(240)
def test_a_checkpoint_of_another_model_size_names_both_sizes(tmp_path):
    ckpt, port = tmp_path / "ckpt", str(ports(1)[0])
    args = [sys.executable, "-m", "p2ptrain", "join", "--task", "synthetic", "--port", port, "--no-discovery",
            "--eval-every", "0", "--checkpoint-dir", str(ckpt), "--max-rounds", "2", "--no-save"]
    first = subprocess.run([*args, "--model-size", "100k"], capture_output=True, text=True, timeout=110)
    assert first.returncode == 0, first.stderr[-1500:]
    second = subprocess.run([*args, "--model-size", "200k"], capture_output=True, text=True, timeout=110)
    assert second.returncode == 2, second.stderr[-1500:]
    last = second.stderr.strip().splitlines()[-1]
    assert "holds another model (written with --model-size 100k, this run's is 200k)" in last, last


def test_the_task_options_are_checked_without_importing_torch():
    """(torch's import alone took 8-17 s on a loaded machine: the mistake is said in the first second)"""
    code = ("import sys\nfrom p2ptrain.commands import cli\n"
            "codes = [cli.main(['join', '--no-discovery', '--port', '0', *a]) for a in (['--data', '/nonexistent'],"
            " ['--model-size', 'huge'], ['--task', '/nonexistent/task.py'])]\nprint(codes, 'torch' in sys.modules)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.stdout.split() == ["[2,", "2,", "2]", "False"], (p.stdout, p.stderr[-800:])


def test_the_early_checks_know_the_built_in_tasks_as_they_are():
    from p2ptrain.tasks import BUILTINS, _options, charlm, synthetic

    assert set(_options.BUILTIN_NAMES) == set(BUILTINS)
    assert set(_options.CHARLM_PRESETS) == set(charlm.PRESETS)
    assert _options.SYNTHETIC_DEFAULT_SIZE == synthetic.DEFAULT_SIZE
