"""Every flag and ``P2PTRAIN_*`` variable is checked before anything starts: a bad one is one
line naming it and what is allowed, exit 2 (``p2ptrain.commands.options``). In-process: the
parser never gets as far as importing torch."""

import pytest
from helpers import run_cli

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize("args, names, allowed", [
    (["--lr", "-1"], "--lr", "a number above 0"),
    (["--lr", "nan"], "--lr", "a number above 0"),
    (["--lr", "inf"], "--lr", "a number above 0"),
    (["--duration", "-1"], "--duration", "a number above 0"),
    (["--duration", "0"], "--duration", "a number above 0"),
    (["--connect-timeout", "-2"], "--connect-timeout", "a number above 0"),
    (["--seed", "-3"], "--seed", "an integer, at least 0"),
    (["--port", "abc"], "--port", "an integer 0..65535"),
    (["--min-peers", "0"], "--min-peers", "an integer, at least 1"),
    (["--eval-every", "1.5"], "--eval-every", "an integer, at least 0"),
])
def test_a_bad_join_flag_is_one_line_naming_it_exit_2(capsys, args, names, allowed):
    code, _, err = run_cli(capsys, "join", *args)
    assert code == 2
    assert len(err) == 1 and names in err[0] and allowed in err[0], err


@pytest.mark.parametrize("name, value, allowed", [
    ("P2PTRAIN_PORT", "abc", "an integer 0..65535"),
    ("P2PTRAIN_LR", "-1", "a number above 0"),
    ("P2PTRAIN_MAX_ROUNDS", "0", "an integer, at least 1"),
    ("P2PTRAIN_NO_DISCOVERY", "maybe", "expected 1 or 0"),
    ("P2PTRAIN_DATA_THREADS", "many", "expected a number of threads"),
    ("P2PTRAIN_IO_THREADS", "yes", "expected 0 or 1"),
    ("P2PTRAIN_RAW_CHUNKS", "on", "expected 0 or 1"),
])
def test_a_bad_variable_is_one_line_naming_the_variable_exit_2(capsys, monkeypatch, name, value, allowed):
    monkeypatch.setenv(name, value)
    code, _, err = run_cli(capsys, "join")
    assert code == 2
    assert len(err) == 1 and f"{name}='{value}'" in err[0] and allowed in err[0], err


def test_a_bad_variable_does_not_break_version_help_or_another_command(capsys, monkeypatch):
    monkeypatch.setenv("P2PTRAIN_PORT", "abc")
    code, out, _ = run_cli(capsys, "--version")
    assert code == 0 and "p2ptrain" in out
    code, out, _ = run_cli(capsys, "--help")
    assert code == 0 and "join" in out
    code, out, _ = run_cli(capsys, "join", "--help")
    assert code == 0 and "--lr" in out
    code, _, err = run_cli(capsys, "doctor")  # doctor's --port reads it too: named there
    assert code == 2 and len(err) == 1 and "P2PTRAIN_PORT='abc'" in err[0], err


def test_an_unknown_flag_to_join_is_reported_by_join(capsys):
    code, _, err = run_cli(capsys, "join", "--bogus", "1")
    assert code == 2 and len(err) == 1, err
    assert "p2ptrain join" in err[0] and "--bogus" in err[0] and "join --help" in err[0], err


def test_a_flag_given_wins_over_a_bad_variable(capsys, monkeypatch):
    from p2ptrain.commands.cli import build_parser

    monkeypatch.setenv("P2PTRAIN_LR", "oops")
    args = build_parser().parse_args(["join", "--lr", "0.5"])
    assert args.lr == 0.5


@pytest.mark.parametrize("args, says", [
    (["--host", "nonsense.invalid"], "--host 'nonsense.invalid': not an address"),
    (["--interface", "nosuchif"], "--interface 'nosuchif'"),
    (["--metrics", "/nonexistent/dir/m.jsonl"], "--metrics /nonexistent/dir/m.jsonl: cannot write there"),
    (["--trace", "/nonexistent/t.json"], "--trace /nonexistent/t.json: cannot write there"),  # (it failed at the end)
    (["--checkpoint-dir", "/proc/nope"], "--checkpoint-dir /proc/nope: cannot create it"),
    (["--cluster", ""], "--cluster: '': expected a name of 1..64 printable characters"),
])
def test_addresses_and_files_are_checked_before_anything_starts(capsys, args, says):
    code, _, err = run_cli(capsys, "join", "--no-discovery", *args)
    assert code == 2 and len(err) == 1 and says in err[0], err


async def test_a_port_taken_is_one_line_naming_the_options():
    import socket

    from p2ptrain.errors import ConfigError
    from p2ptrain.net.mesh import Mesh

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        mesh = Mesh(cluster="lab", peer_id="a", secret=None, host="127.0.0.1", port=taken.getsockname()[1])
        with pytest.raises(ConfigError, match=r"cannot listen on 127.0.0.1:\d+: .*--port"):
            await mesh.start()
    finally:
        taken.close()


def test_the_library_refuses_a_cluster_name_it_could_not_announce():
    import torch

    from p2ptrain import AsyncPeer, ConfigError

    model = torch.nn.Linear(2, 2)
    with pytest.raises(ConfigError, match="cluster must be a name of 1..64 printable characters"):
        AsyncPeer(model, torch.optim.SGD(model.parameters(), lr=0.1), cluster="")
