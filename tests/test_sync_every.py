"""What ``sync_every`` may be (``p2ptrain.cluster.sync_every``): a count of inner steps, a window of
time or ``auto``, each parsed from what a user writes, stated alike by every peer, and anything
else refused with one line saying what is allowed: in the library's keyword, ``join --sync-every``
and its variable."""

import pytest

from p2ptrain.cluster.settings import differences, shared
from p2ptrain.cluster.sync_every import SyncEvery, parse_sync_every
from p2ptrain.commands import cli
from p2ptrain.errors import ConfigError
from p2ptrain.trainer.options import check_local_steps

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize("value, steps, seconds, canonical", [
    (16, 16, None, 16),
    ("16", 16, None, 16),
    (" 2s ", None, 2.0, "2s"),
    ("500ms", None, 0.5, "500ms"),
    ("1.5s", None, 1.5, "1.5s"),
    ("1500ms", None, 1.5, "1.5s"),  # (one window, one text: peers that wrote it either way agree)
    (".25s", None, 0.25, "250ms"),
    ("AUTO", None, None, "auto"),
])
def test_a_count_a_window_and_auto_parse_to_one_canonical_form(value, steps, seconds, canonical):
    every = parse_sync_every(value)
    assert (every.steps, every.seconds, every.canonical()) == (steps, seconds, canonical)
    assert every.by_time == (steps is None) and every.auto == (canonical == "auto")
    assert parse_sync_every(every) is every and parse_sync_every(str(every)) == every


@pytest.mark.parametrize("value, says", [
    (0, "sync_every must be an int >= 1"),
    (-3, "sync_every must be an int >= 1"),
    (True, "got True"),
    (2.5, "got 2.5"),
    (None, "got None"),
    ("", "got ''"),
    ("2 s", "a window of time (e.g. 2s, 500ms) or auto; got '2 s'"),
    ("2m", "got '2m'"),
    ("-1s", "got '-1s'"),
    ("5ms", "a window must be 10ms..3600s"),
    ("7200s", "a window must be 10ms..3600s"),
    ("x" * 100, "got '" + "x" * 40 + "...'"),  # (bounded: a pasted file is not echoed back)
])
def test_anything_else_is_one_line_saying_what_is_allowed(value, says):
    with pytest.raises(ConfigError) as raised:
        parse_sync_every(value)
    assert says in str(raised.value) and "\n" not in str(raised.value)


def test_every_peer_states_a_window_as_its_canonical_text_and_a_count_as_before():
    assert shared(compression="none", staleness=1, sync_every=16)["sync_every"] == 16  # (as older peers state it)
    assert shared(compression="none", staleness=1, sync_every="1500ms")["sync_every"] == "1.5s"
    assert shared(compression="none", staleness=1)["sync_every"] == 0
    ours, theirs = (shared(compression="none", staleness=1, sync_every=v) for v in ("2s", 16))
    assert differences(ours, theirs) == ["--sync-every 16 there, '2s' here"]
    assert differences(ours, shared(compression="none", staleness=1, sync_every="2000ms")) == []


def test_the_library_takes_a_count_a_window_and_auto_and_refuses_anything_else_in_one_line():
    for value in (16, "16", "2s", "500ms", "auto", SyncEvery(seconds=2.0)):
        check_local_steps(value, 0.7, 0.9)
    with pytest.raises(ConfigError, match="sync_every must be an int >= 1"):
        check_local_steps(0, 0.7, 0.9)
    with pytest.raises(ConfigError, match="sync_every must be .* a window of time"):
        check_local_steps("soon", 0.7, 0.9)


def run_join(capsys, *argv):
    try:
        code = cli.main(["join", *argv])
    except SystemExit as exc:
        code = exc.code
    return code, capsys.readouterr().err.strip().splitlines()


@pytest.mark.parametrize("value", ["0", "2x", "5ms", "1.5"])
def test_join_refuses_a_bad_value_in_one_line_naming_the_flag_and_what_is_allowed(capsys, value):
    code, err = run_join(capsys, "--sync-every", value)
    assert code == 2 and len(err) == 1, err
    assert f"--sync-every: '{value}': expected a count of inner steps >= 1 (e.g. 16), a window of time " \
           "10ms..3600s (e.g. 2s, 500ms) or auto" in err[0], err


def test_join_names_the_variable_when_the_bad_value_came_from_it(capsys, monkeypatch):
    monkeypatch.setenv("P2PTRAIN_SYNC_EVERY", "soon")
    code, err = run_join(capsys)
    assert code == 2 and len(err) == 1 and "P2PTRAIN_SYNC_EVERY='soon': expected a count of inner steps" in err[0]


@pytest.mark.parametrize("value, parsed", [("16", 16), ("2s", "2s"), ("500ms", "500ms"), ("auto", "auto")])
def test_join_parses_a_count_a_window_and_auto(value, parsed):
    parser = cli.build_parser()
    assert parser.parse_args(["join", "--sync-every", value]).sync_every == parsed


@pytest.mark.parametrize("value", ["2s", "auto"])
def test_join_takes_a_window_past_its_checks(capsys, value):
    """A window passes ``join``'s local-steps check: the first refusal is the next one's (a flag
    of gradient mode beside it), before anything opens."""
    code, err = run_join(capsys, "--sync-every", value, "--staleness", "1", "--target-batch-size", "64")
    assert code == 2 and len(err) == 1, err
    assert "--sync-every does not combine with --target-batch-size" in err[0], err
