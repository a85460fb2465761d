"""``fuzz.py --coverage``: each parser of ``_fuzz_targets.py`` under atheris, Google's coverage-guided
fuzzer for Python (libFuzzer's engine), in a process of its own.

    pip install atheris                                    # or: pip install -e .[fuzz]
    python bench/fuzz.py --coverage                        # 1,000,000 inputs per parser, at most an hour each
    python bench/fuzz.py --coverage --seconds 180 --targets frame,beacon --findings /tmp/found
    python bench/fuzz.py --replay /tmp/found/frame-crash-<sha1> --targets frame

Why a process per parser: ``atheris.Fuzz()`` never returns; it exits at a finding or at the end.
The child imports the p2ptrain package under ``atheris.instrument_imports`` (each branch of its
code a coverage edge libFuzzer steers towards), builds the one target, writes the target's valid
samples into the corpus folder as seeds, and fuzzes ``target.run`` with ``fuzz.py``'s msgpack
tokens as libFuzzer's dictionary; for a parser of msgpack headers half the mutations are
``fuzz.mutate_structure``'s (the sample decoded, a value changed, encoded again), the rest
libFuzzer's. The checks are the mutation run's: an exception outside ``target.allowed`` (the
parser's documented refusals) or a failed assertion of the target (an allocation past the limit,
a handshake admitted on a forged transcript) is a finding; so is an input that runs past
``fuzz.HANG_SECONDS`` (libFuzzer's ``-timeout``) or a process past ``RSS_LIMIT_MB``
(``-rss_limit_mb``). libFuzzer writes the input to the findings folder (``NAME-crash-<sha1>``,
``-timeout-``, ``-oom-``); the parent prints the command that replays it (``--replay``: the target
once, in this process, without atheris; a parser that keeps state, the round machine, the beacon
filter, the state transfer, may need the inputs before it too, which libFuzzer does not keep).

Printed per parser: inputs run, inputs/s, coverage (libFuzzer's ``cov``: edges of the
instrumented code reached; ``ft``: its finer features, edges with hit counts), the corpus it
grew, the peak RSS, the findings. Exit status 1 on a finding, 2 without atheris.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import math
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

RSS_LIMIT_MB = 2048  # a child past this is a finding (``-oom-``): a parser whose memory grows with its inputs
# compiled by numba, which cannot read instrumented bytecode (the loops run as machine code: no Python edges)
NUMBA_MODULES = ["p2ptrain.codecs._int8_kernels", "p2ptrain.codecs._topk_kernels", "p2ptrain.trainer._local_kernels"]
INSTALL_HINT = "fuzz.py --coverage needs atheris: pip install atheris (or pip install -e .[fuzz])"
STAT = re.compile(r"^stat::(\w+):\s*(\d+)", re.M)
PULSE = re.compile(r"cov: (\d+) ft: (\d+) corp: (\d+)/(\d+)(\w*)")
WRITTEN = re.compile(r"(?:Test unit|finding) written to (\S+)")


def have_atheris() -> bool:
    return importlib.util.find_spec("atheris") is not None


def run_all(names: list[str], inputs: int, seconds: float, findings: str, corpus_root: str | None) -> int:
    """Each parser in turn, one child at a time; prints the table; the exit status (1: a finding)."""
    if not have_atheris():
        print(INSTALL_HINT, file=sys.stderr)
        return 2
    print(f"fuzz --coverage: atheris {importlib.metadata.version('atheris')}, up to {inputs:,} inputs per parser "
          f"(at most {seconds:g} s each), python {sys.version.split()[0]}", flush=True)
    print(f"| {'parser':<18} | {'inputs':>10} | {'inputs/s':>8} | {'cov':>5} | {'ft':>6} | {'corpus':>6} | "
          f"{'peak RSS':>8} | findings")
    print(f"|{'-' * 20}|{'-' * 11}:|{'-' * 9}:|{'-' * 6}:|{'-' * 7}:|{'-' * 7}:|{'-' * 9}:|---------")
    found = 0
    fresh = not os.path.exists(findings)
    try:
        for name in names:
            found += _one_row(name, inputs, seconds, findings, corpus_root)
    finally:
        if fresh and os.path.isdir(findings) and not os.listdir(findings):
            os.rmdir(findings)
    print(f"{found} finding(s)")
    return 1 if found else 0


def _one_row(name: str, inputs: int, seconds: float, findings: str, corpus_root: str | None) -> int:
    """Runs ``name``'s child, prints its row and its findings; how many it found (a child that ended
    without its final stats and without a finding counts as one: its last lines are printed)."""
    r = run_target(name, inputs, seconds, findings, corpus_root)
    what = ", ".join(os.path.basename(p) for p in r["findings"]) or ("0" if r["ended"] else f"none, but {r['why']}")
    print(f"| {name:<18} | {r['inputs']:>10,} | {r['rate']:>8,} | {r['cov']:>5} | {r['ft']:>6} | "
          f"{r['corpus']:>6} | {r['rss_mb']:>6}MB | {what}", flush=True)
    for path in r["findings"]:
        print(f"  {name}: {r['error']}\n  replay: python bench/fuzz.py --replay {path} --targets {name}", flush=True)
    if not r["ended"] and not r["findings"]:
        print(f"  {name}: the child ended without its final stats; its last lines:\n{r['tail']}", flush=True)
        return 1
    return len(r["findings"])


def run_target(name: str, inputs: int, seconds: float, findings: str, corpus_root: str | None) -> dict:
    """One child: libFuzzer on ``name`` for ``inputs`` inputs or ``seconds``; its final stats, parsed.
    The child is killed in ``finally`` (after ``seconds`` and a minute's grace it is stuck)."""
    from fuzz import HANG_SECONDS, TOKENS

    work = tempfile.mkdtemp(prefix=f"fuzzcov-{name}-")
    corpus = os.path.join(corpus_root, name) if corpus_root else os.path.join(work, "corpus")
    os.makedirs(corpus, exist_ok=True)
    os.makedirs(findings, exist_ok=True)
    tokens = os.path.join(work, "tokens.dict")
    with open(tokens, "w") as f:
        f.writelines('"' + "".join(f"\\x{b:02x}" for b in t) + '"\n' for t in TOKENS)
    log = os.path.join(work, "libfuzzer.log")
    began = os.path.join(work, "began")
    cmd = [sys.executable, os.path.abspath(__file__), name, corpus, began, f"-runs={inputs}",
           f"-max_total_time={max(1, int(seconds))}", f"-timeout={math.ceil(HANG_SECONDS)}",
           f"-rss_limit_mb={RSS_LIMIT_MB}", f"-dict={tokens}", "-print_final_stats=1",
           f"-artifact_prefix={os.path.join(findings, name)}-"]
    proc = None
    try:
        with open(log, "wb") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True)
            try:
                proc.wait(timeout=seconds + 60)
            except subprocess.TimeoutExpired:
                pass
        ended = time.monotonic()  # (CLOCK_MONOTONIC: the child's clock too)
        with open(log, errors="replace") as f:
            r = parse(f.read(), proc.returncode)
        if os.path.exists(began):
            with open(began) as f:
                took = ended - float(f.read())
            r["rate"] = round(r["inputs"] / took) if took > 0 else r["rate"]
        return r
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        shutil.rmtree(work, ignore_errors=True)


def parse(text: str, returncode: int | None) -> dict:
    """libFuzzer's output: the last status line's coverage, the final stats, the inputs it wrote."""
    stats = {k: int(v) for k, v in STAT.findall(text)}
    pulses = PULSE.findall(text)
    cov, ft, corpus = (pulses[-1][:3] if pulses else ("?", "?", "?"))
    done = re.findall(r"Done (\d+) (?:runs )?in (\d+) second", text)
    inputs = stats.get("number_of_executed_units", int(done[-1][0]) if done else 0)
    rate = stats.get("average_exec_per_sec", 0)
    written = list(dict.fromkeys(WRITTEN.findall(text)))
    error = next((line.strip() for line in text.splitlines()
                  if "ERROR: libFuzzer" in line or line.startswith(" === Uncaught Python exception")), "")
    if written and "Uncaught Python exception" in error:
        exc = re.search(r"Uncaught Python exception: ===\n(.+)", text)
        error = exc.group(1).strip() if exc else error
    tail = "\n".join("    " + line for line in text.splitlines()[-15:])
    ended = bool(stats) or bool(done) or bool(written)
    why = f"exit status {returncode}" if returncode is not None else "killed after its time"
    return {"inputs": inputs, "rate": rate, "cov": cov, "ft": ft, "corpus": corpus,
            "rss_mb": stats.get("peak_rss_mb", "?"), "findings": written, "error": error, "ended": ended,
            "why": why, "tail": tail}


def replay(name: str, path: str) -> int:
    """``target.run`` once on the input at ``path``, without atheris: 0 ok or refused as documented, 1 a finding."""
    import traceback

    from _fuzz_targets import target as build
    from fuzz import HANG_SECONDS, _hang

    target = build(name)
    with open(path, "rb") as f:
        data = f.read()
    signal.signal(signal.SIGALRM, _hang)
    signal.setitimer(signal.ITIMER_REAL, HANG_SECONDS)
    try:
        target.run(data)
        print(f"{name}: accepted {len(data)} bytes")
    except target.allowed as exc:
        print(f"{name}: refused as documented: {type(exc).__name__}: {exc}")
    except Exception:  # noqa: BLE001 - what the replay is for
        traceback.print_exc()
        return 1
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    return 0


# -- the child -----------------------------------------------------------------------------------
def child(argv: list[str]) -> None:
    """``python _fuzz_coverage.py NAME CORPUS BEGAN -libfuzzer_flags...`` (BEGAN: a file it writes the
    monotonic time of its first input to): never returns (libFuzzer exits)."""
    import atheris

    name, corpus, began = argv[1:4]
    with atheris.instrument_imports(include=["p2ptrain"], exclude=NUMBA_MODULES):
        from _fuzz_targets import target as build  # (p2ptrain is first imported here: its modules instrumented)

        target = build(name)
    from fuzz import mutate_structure

    for sample in target.samples:
        with open(os.path.join(corpus, hashlib.sha1(sample).hexdigest()), "wb") as f:
            f.write(sample)
    started: list[float] = []
    prefix = next(a.split("=", 1)[1] for a in argv if a.startswith("-artifact_prefix="))

    def one_input(data: bytes) -> None:
        if not started:  # (the rate counts from the first input: not the imports, not torch's start)
            started.append(time.monotonic())
            with open(began, "w") as f:
                f.write(repr(started[0]))
        try:
            target.run(data)
        except target.allowed:
            pass
        except BaseException:  # (written here too: libFuzzer's copy was once lost to a SIGALRM at its exit)
            path = f"{prefix}crash-{hashlib.sha1(data).hexdigest()}"
            with open(path, "wb") as f:
                f.write(data)
            print(f"\nfinding written to {path}", file=sys.stderr, flush=True)
            raise

    def structured(data: bytes, max_size: int, seed: int) -> bytes:
        if seed & 1:
            try:
                out = mutate_structure(random.Random(seed), data)
                if len(out) <= max_size:
                    return out
            except Exception:  # noqa: BLE001 - not msgpack (any more): libFuzzer's edits instead
                pass
        return atheris.Mutate(data, max_size)

    extra = {"custom_mutator": structured} if target.structured else {}
    atheris.Setup([argv[0], corpus, *argv[4:]], one_input, **extra)
    atheris.Fuzz()


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    child(sys.argv)
