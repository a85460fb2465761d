"""A long fuzz run of every parser that reads the network, by mutation of valid samples.

    python bench/fuzz.py                         # 1,000,000 inputs per parser (15 minutes, one core)
    python bench/fuzz.py --per-parser 100000     # a few minutes
    python bench/fuzz.py --seconds 30 --only frame,handshake-listener
    python bench/fuzz.py --findings /tmp/found   # each finding's input written there, to replay
    python bench/fuzz.py --coverage --seconds 180   # coverage-guided under atheris (_fuzz_coverage.py)

The rule is h11's: a parser succeeds or raises the error it documents for a peer's fault
(``RemoteProtocolError`` and its subtypes; also ``GroupError`` for a chunk of another call's
shape, ``ValueError`` for a parameter sketch, whose caller turns it into the peer's fault), and
nothing else; the frame decoder allocates nothing past its limit; a handshake with the secret
admits on the honest transcript only; no float trap in a codec. Any other outcome is a finding:
it is counted, its first input per exception type is printed (and written with ``--findings``),
and the run exits 1. The parsers are ``_fuzz_targets.py``'s; ``tests/test_fuzz.py`` runs them
briefly beside its hypothesis tests (which are too slow for a million inputs).

Inputs, seeded (``--seed``): one in 16 is random bytes; the rest are a valid sample of the
parser with 1 to 8 edits: a bit flipped, a byte set, a msgpack token inserted (huge lengths,
NaN, nil, empty containers), a run deleted or doubled, a splice of another sample, a cut, an
integer field overwritten with an edge value; for a parser of msgpack headers, half are the
sample decoded with one to three of its values replaced, removed or added, and encoded again.
Each parser runs in a process of its own. Printed per parser: inputs, inputs/s, the outcomes
(exception types caught, counted), the slowest input (one that would block the event loop
shows there; past HANG_SECONDS it is a finding), and the resident memory at the end against the
start (sampled every 4,096 inputs: a parser that keeps state must keep it bounded).
"""

from __future__ import annotations

import argparse
import copy
import multiprocessing
import os
import random
import signal
import sys
import time
import traceback

import msgpack

import _fuzz_coverage
from _fuzz_targets import TARGET_NAMES, Target, targets  # noqa: F401 (the tests' too)
from _fuzz_targets import target as build_target

TOKENS = [b"\x00", b"\xff", b"\x7f", b"\x80", b"\x90", b"\xc0", b"\xc1", b"\xc2", b"\xc3", b"\xa0",
          b"\xcf\xff\xff\xff\xff\xff\xff\xff\xff", b"\xd3\x80\x00\x00\x00\x00\x00\x00\x00",
          b"\xdb\xff\xff\xff\xff", b"\xc6\xff\xff\xff\xff", b"\xdd\xff\xff\xff\xff", b"\xdf\xff\xff\xff\xff",
          b"\xcb\x7f\xf8\x00\x00\x00\x00\x00\x00", b"\xcb\x7f\xf0\x00\x00\x00\x00\x00\x00",
          b"\xc7\x01\x00\x00", b"\x91\x91\x91\x91\x91\x91\x91\x91"]
HANG_SECONDS = 2.0  # an input parsed longer than this is a finding (``Hang``)
EDGES = [0, 1, 0x7F, 0x80, 0xFF, 0xFFFF, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF, 2**63 - 1, 2**63, 2**64 - 1]


def mutate(rng: random.Random, data: bytes, samples: list[bytes]) -> bytes:
    """``data`` with 1 to 8 edits (see the module docstring)."""
    out = bytearray(data)
    for _ in range(1 + int(rng.expovariate(0.7)) % 8):
        op, n = rng.randrange(9), len(out)
        if op == 0 and n:
            out[rng.randrange(n)] ^= 1 << rng.randrange(8)
        elif op == 1 and n:
            out[rng.randrange(n)] = rng.randrange(256)
        elif op == 2:
            i = rng.randrange(n + 1)
            out[i:i] = rng.choice(TOKENS)
        elif op == 3 and n:
            i = rng.randrange(n)
            del out[i:i + rng.choice((1, 2, 4, 8, 32))]
        elif op == 4 and n:
            i = rng.randrange(n)
            out[i:i] = out[i:i + rng.choice((1, 4, 16, 64))]
        elif op == 5:
            other = rng.choice(samples)
            if other:
                a = rng.randrange(len(other))
                i = rng.randrange(n + 1)
                out[i:i + rng.randrange(8)] = other[a:a + rng.randrange(1, 64)]
        elif op == 6 and n:
            del out[rng.randrange(n):]
        elif op == 7 and n >= 8:
            size = rng.choice((1, 2, 4, 8))
            i = rng.randrange(n - size + 1)
            out[i:i + size] = (rng.choice(EDGES) % (1 << 8 * size)).to_bytes(size, rng.choice(("little", "big")))
        elif op == 8 and n:
            i = rng.randrange(n)
            out[i:i + 1] = bytes([out[i]]) * rng.choice((2, 16, 256))
    return bytes(out)


LEAVES = [None, True, False, 0, -1, 1, 2**31, 2**63 - 1, -2**63, 2**64 - 1, 0.5, float("nan"), float("inf"), "",
          "a", "x" * 300, "\u2028\x00", b"", b"\0" * 16, b"\xff" * 4096, [], {}, [[]], {"t": "x"}, ["a", "a"], [1, "a"]]


def mutate_structure(rng: random.Random, data: bytes) -> bytes:
    """A msgpack sample with one to three values replaced, removed or added at random places
    (what a peer that knows the format sends: it parses, then lies)."""
    obj = msgpack.unpackb(data, raw=False, strict_map_key=False)
    for _ in range(rng.randint(1, 3)):
        obj = _edit(rng, obj, top=True)
    return msgpack.packb(obj, use_bin_type=True)


def _edit(rng: random.Random, obj, top: bool = False):
    if isinstance(obj, dict) and obj and (top or rng.random() < 0.7):
        keys = [k for k in obj if not top or k != "t" or rng.random() < 0.05] or list(obj)  # (the type mostly kept)
        key = rng.choice(keys)
        op = rng.randrange(4)
        if op == 0:
            del obj[key]
        elif op == 1:
            obj[rng.choice(["r", "x", key + "_"])] = _leaf(rng)
        else:
            obj[key] = _edit(rng, obj[key])
        return obj
    if isinstance(obj, list) and obj and rng.random() < 0.7:
        i = rng.randrange(len(obj))
        op = rng.randrange(4)
        if op == 0:
            del obj[i]
        elif op == 1:
            obj.insert(i, _leaf(rng))
        else:
            obj[i] = _edit(rng, obj[i])
        return obj
    return _leaf(rng)


def _leaf(rng: random.Random):
    return copy.deepcopy(rng.choice(LEAVES))  # (a fresh one: edits change containers in place)


# -- the run -------------------------------------------------------------------------------------
def fuzz(target: Target, inputs: int, seconds: float, seed: int, findings_dir: str | None = None,
         hang: float | None = HANG_SECONDS) -> dict:
    """Run ``target`` on up to ``inputs`` inputs or for ``seconds``; a report (see ``main``).
    ``hang``: an input parsed longer is a finding (SIGALRM: None where another owns it, pytest-timeout)."""
    if hang is not None:
        signal.signal(signal.SIGALRM, _hang)
    rng = random.Random(f"{seed}:{target.name}")
    rss_start = peak = _rss()
    outcomes: dict[str, int] = {}
    findings: dict[str, str] = {}
    slowest = 0.0
    began = time.perf_counter()
    deadline = began + seconds
    tried = 0
    for sample in target.samples:  # (the valid ones pass, or are refused as documented: a beacon without a tag)
        try:
            target.run(sample)
        except target.allowed:
            pass
    while tried < inputs:
        if tried % 256 == 0:
            if time.perf_counter() > deadline:
                break
            if tried % 4096 == 0:
                peak = max(peak, _rss())
        if rng.randrange(16) == 0:
            data = rng.randbytes(rng.randrange(1, 256))
        elif target.structured and rng.randrange(2):
            data = mutate_structure(rng, rng.choice(target.samples))
        else:
            data = mutate(rng, rng.choice(target.samples), target.samples)
        t0 = time.perf_counter()
        if hang is not None:
            signal.setitimer(signal.ITIMER_REAL, hang)
        try:
            target.run(data)
            kind = "ok"
        except target.allowed as exc:
            kind = type(exc).__name__
        except Exception as exc:  # noqa: BLE001 - anything else is what this run looks for
            kind = f"FINDING {type(exc).__name__}"
            if kind not in findings:
                findings[kind] = f"{exc!r} on input {data!r}\n{traceback.format_exc()}"
                if findings_dir:
                    os.makedirs(findings_dir, exist_ok=True)
                    with open(os.path.join(findings_dir, f"{target.name}-{type(exc).__name__}.bin"), "wb") as f:
                        f.write(data)
        finally:
            if hang is not None:
                signal.setitimer(signal.ITIMER_REAL, 0)
        slowest = max(slowest, time.perf_counter() - t0)
        outcomes[kind] = outcomes.get(kind, 0) + 1
        tried += 1
    took = time.perf_counter() - began
    return {"name": target.name, "tried": tried, "rate": tried / took if took > 0 else 0.0, "outcomes": outcomes,
            "findings": findings, "slowest": slowest,
            "rss_start": rss_start, "max_rss": max(peak, _rss())}


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Hang(Exception):
    """An input that kept its parser busy for HANG_SECONDS: it would block a peer's event loop."""


def _hang(signum, frame):
    raise Hang(f"still parsing after {HANG_SECONDS:g} s")


def _child(name: str, inputs: int, seconds: float, seed: int, findings_dir: str | None, out) -> None:
    target = build_target(name)
    out.send(fuzz(target, inputs, seconds, seed, findings_dir))


def run_isolated(name: str, inputs: int, seconds: float, seed: int, findings_dir: str | None) -> dict:
    """``fuzz`` in a process of its own (forked: its max RSS is its own)."""
    ctx = multiprocessing.get_context("fork")
    here, there = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(name, inputs, seconds, seed, findings_dir, there))
    proc.start()
    try:
        if not here.poll(seconds + 600):
            raise RuntimeError(f"{name}: no report within {seconds + 600:.0f} s")
        return here.recv()
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--per-parser", "--inputs", type=int, default=1_000_000, metavar="N",
                    help="inputs per parser (default 1,000,000)")
    ap.add_argument("--seconds", type=float, default=3600.0, metavar="S",
                    help="at most this long per parser (default 3600)")
    ap.add_argument("--seed", type=int, default=0, help="the mutations' seed (not --coverage's: libFuzzer picks)")
    ap.add_argument("--only", "--targets", default="", metavar="NAMES",
                    help="comma-separated parser names: " + ", ".join(TARGET_NAMES))
    ap.add_argument("--findings", default=None, metavar="DIR", help="a folder to write each finding's input to "
                    "(--coverage: ./fuzz-findings unless given)")
    ap.add_argument("--coverage", action="store_true", help="coverage-guided, each parser under atheris "
                    "(pip install atheris): _fuzz_coverage.py")
    ap.add_argument("--corpus", default=None, metavar="DIR",
                    help="--coverage: keep each parser's corpus in DIR/NAME, to resume")
    ap.add_argument("--replay", default=None, metavar="FILE", help="run one finding's input through the one "
                    "parser --targets names, and exit")
    args = ap.parse_args(argv)
    names = [n for n in args.only.split(",") if n] or TARGET_NAMES
    unknown = sorted(set(names) - set(TARGET_NAMES))
    if unknown:
        ap.error(f"unknown parser {', '.join(unknown)}; choose among {', '.join(TARGET_NAMES)}")
    if args.replay:
        if len(names) != 1:
            ap.error("--replay FILE needs the one parser it came from: --targets NAME")
        if not os.path.isfile(args.replay):
            ap.error(f"--replay {args.replay}: no such file")
        return _fuzz_coverage.replay(names[0], args.replay)
    if args.coverage:
        return _fuzz_coverage.run_all(names, args.per_parser, args.seconds, args.findings or "fuzz-findings",
                                      args.corpus)
    print(f"fuzz: {args.per_parser:,} inputs per parser (at most {args.seconds:g} s each), seed {args.seed}, "
          f"python {sys.version.split()[0]}", flush=True)
    print(f"| {'parser':<18} | {'inputs':>10} | {'inputs/s':>9} | {'slowest':>8} | {'max RSS (grew)':>14} | outcomes")
    print(f"|{'-' * 20}|{'-' * 11}:|{'-' * 10}:|{'-' * 9}:|{'-' * 15}:|---------")
    found = 0
    for name in names:
        r = run_isolated(name, args.per_parser, args.seconds, args.seed, args.findings)
        outcomes = ", ".join(f"{k} {v:,}" for k, v in sorted(r["outcomes"].items(), key=lambda kv: -kv[1]))
        grew = (r["max_rss"] - r["rss_start"]) / 2**20
        print(f"| {r['name']:<18} | {r['tried']:>10,} | {r['rate']:>9,.0f} | {r['slowest'] * 1e3:>6.1f}ms | "
              f"{r['max_rss'] / 2**20:>4.0f}MB {grew:+5.1f} | {outcomes}", flush=True)
        for kind, text in r["findings"].items():
            found += 1
            print(f"  {name}: {kind}: {text}", flush=True)
    print(f"{found} finding(s)")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
