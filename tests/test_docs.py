"""The README and the tracked text files say what holds now.

- Every ``python -m p2ptrain ...`` command in the README's shell blocks is accepted by the real
  argument parser, and a ``join`` command also by the checks ``join`` makes before it starts
  anything (so a reader who copies it gets a run, not exit 2).
- The README's options table and ``join``'s parser list the same options, so the two cannot
  drift (option names only: the help text is free to change).
- No tracked text file cites a numbered stage of the work (history lives in ``git log``).
"""

from __future__ import annotations

import argparse
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from p2ptrain.commands import join as join_command
from p2ptrain.commands.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"

SHELL_BLOCK = re.compile(r"^\s*```(?:bash|sh|shell|console)\n(.*?)^\s*```", re.M | re.S)
CONTROL = {"&&", "||", "&", ";", "|"}
PREFIXES = {"sudo", "caffeinate", "-i", "exec", "time"}


def readme() -> str:
    return README.read_text(encoding="utf-8")


def shell_commands(text: str) -> list[list[str]]:
    """Every simple command of the text's shell blocks, as argv lists (continuation lines joined,
    comments dropped, split at ``&&``, ``&``, ``;`` and pipes)."""
    commands = []
    for block in SHELL_BLOCK.findall(text):
        for line in block.replace("\\\n", " ").splitlines():
            lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
            lexer.whitespace_split = True
            lexer.commenters = "#"
            current: list[str] = []
            for token in list(lexer) + [";"]:
                if token in CONTROL or set(token) <= set(";&|"):
                    if current:
                        commands.append(current)
                    current = []
                else:
                    current.append(token)
    return commands


def p2ptrain_argvs(text: str) -> list[list[str]]:
    """The arguments after ``python -m p2ptrain`` of every such command (environment
    assignments, ``sudo`` and ``caffeinate -i`` before it skipped)."""
    found = []
    for argv in shell_commands(text):
        while argv and (argv[0] in PREFIXES or re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", argv[0])):
            argv = argv[1:]
        if len(argv) >= 3 and re.fullmatch(r"python3?", argv[0]) and argv[1:3] == ["-m", "p2ptrain"]:
            found.append(argv[3:])
    return found


def section(text: str, heading: str) -> str:
    """The text under ``## heading`` up to the next ``## `` heading."""
    match = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert match, f"README has no '## {heading}' section"
    return match.group(1)


def options_table_names(text: str) -> list[str]:
    """The option names in the first column of the README's options table (the table under
    ``## Options`` whose header starts ``| option |``)."""
    lines = section(text, "Options").splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| option |"))
    names = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        first_cell = line.split("|")[1]
        row = re.findall(r"`(--[a-z0-9][a-z0-9-]*)`", first_cell)
        assert row, f"a row of the options table names no option: {line!r}"
        names.extend(row)
    return names


def join_parser_options() -> set[str]:
    """Every long option ``join --help`` shows (hidden ones and ``--help`` left out)."""
    join = build_parser().commands["join"]
    return {name for action in join._actions if action.help != argparse.SUPPRESS
            for name in action.option_strings if name.startswith("--") and name != "--help"}


def test_the_readme_shows_the_commands_a_newcomer_runs():
    argvs = p2ptrain_argvs(readme())
    commands = [argv[0] for argv in argvs if argv]
    assert commands.count("join") >= 8 and "doctor" in commands and "peers" in commands, commands


def test_every_p2ptrain_command_in_the_readme_parses():
    parser = build_parser()
    for argv in p2ptrain_argvs(readme()):
        try:
            args = parser.parse_args(argv)
        except SystemExit as exc:
            pytest.fail(f"the parser refuses a README command (exit {exc.code}): python -m p2ptrain {shlex.join(argv)}")
        assert args.command in {"join", "doctor", "peers", "tls-init"}, argv


class _WouldStart(Exception):
    """Raised where ``join`` has checked its options and would start listening."""


def test_every_join_command_in_the_readme_passes_the_checks_join_makes_before_it_starts(monkeypatch, tmp_path):
    checks = join_command.check
    (tmp_path / "examples").symlink_to(ROOT / "examples")  # (the README's paths, from a checkout's root)
    monkeypatch.chdir(tmp_path)  # (the checks make --checkpoint-dir's folder: not in the checkout)

    def stop(args):
        checks(args)  # every check join makes before the task loads, then stop short of starting
        raise _WouldStart

    monkeypatch.setattr(join_command, "check", stop)
    parser = build_parser()
    for argv in p2ptrain_argvs(readme()):  # (the certificates a join names: made as a reader makes them)
        if argv[:1] == ["tls-init"]:
            args = parser.parse_args(argv)
            assert args._run(args) == 0, argv
    joins = [argv for argv in p2ptrain_argvs(readme()) if argv[:1] == ["join"]]
    for argv in joins:
        args = parser.parse_args(argv)
        with pytest.raises(_WouldStart):
            args._run(args)  # a ConfigError here is the exit 2 a reader would get


def test_the_readme_options_table_and_joins_parser_name_the_same_options():
    table = options_table_names(readme())
    parser_options = join_parser_options()
    assert len(table) == len(set(table)), f"options listed twice: {sorted({n for n in table if table.count(n) > 1})}"
    missing = sorted(parser_options - set(table))
    unknown = sorted(set(table) - parser_options)
    assert not missing, f"join --help has options the README's table lacks: {missing}"
    assert not unknown, f"the README's table lists options join does not take: {unknown}"


def test_the_doc_checks_see_a_missing_row_an_unknown_row_and_a_bad_command():
    """The checks above can fail: a table without a row, with a made-up row, and a command with
    a flag that does not exist are each caught."""
    text = readme()
    without_lr = "\n".join(line for line in text.splitlines() if not line.startswith("| `--lr` |"))
    assert "--lr" in join_parser_options() - set(options_table_names(without_lr))
    row = "| `--eval-every` |"
    with_made_up = text.replace(row, "| `--no-such-flag` | x | y |\n" + row, 1)
    assert "--no-such-flag" in set(options_table_names(with_made_up)) - join_parser_options()
    bad = "```bash\npython -m p2ptrain join --no-such-flag 3 &\n```\n"
    (argv,) = p2ptrain_argvs(bad)
    with pytest.raises(SystemExit):
        build_parser().parse_args(argv)


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_link_within_the_readme_leads_to_a_heading():
    text = readme()
    anchors = {github_anchor(h) for h in re.findall(r"^#{1,6} (.+)$", text, re.M)}
    links = re.findall(r"\]\(#([^)]+)\)", text)
    assert links, "the README links none of its sections"
    assert not sorted(set(links) - anchors), f"links to no heading: {sorted(set(links) - anchors)}"


# A numbered stage of the work (the word session, stage or wave before a number), or the phrase
# that dates a change against the code before it.
HISTORY = re.compile(r"\b(?:session|stage|wave)s?\s+#?[0-9]|\bbefore this change\b", re.I)


def tracked_text_files() -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True,
                             timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        pytest.skip("not a git checkout (git ls-files failed)")
    return [ROOT / name for name in out.decode().split("\0") if name]


def test_no_tracked_text_file_cites_a_numbered_stage_of_the_work():
    found = []
    for path in tracked_text_files():
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, FileNotFoundError, IsADirectoryError):
            continue  # binary, or deleted in the working tree
        if path == Path(__file__):
            continue  # this file names the pattern it looks for
        for match in HISTORY.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            found.append(f"{path.relative_to(ROOT)}:{line}: {match.group()!r}")
    assert not found, ("say what holds now and why (the figure with its command); the story is in git log:\n"
                       + "\n".join(found))
