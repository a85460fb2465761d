"""Where a round's time goes, from the Chrome traces of ``train.py --trace`` or ``join --trace``.

Prints, per span name (encode, send, receive, reduce, decode, step, batch, optimizer, apply),
how many there were and their mean and total wall time: enough to see, on a machine that is
lent for minutes, whether the ring waits on its sends, on the pool or on the wire.

    python bench/trace_spans.py DIR/n2-p2ptrain-int8/rank0.json [more.json ...]

``--steps`` reads the traces of one ring's ranks together (``bench/allreduce.py --trace DIR``):
for each call, when each rank's receive link brought the last chunk of each step, in ms from
the call's first span on any rank. A link at the wire's pace brings a step every
(bytes a step) / (rate); a step that took longer is where the call lost time (a peer that
started late, a stall on that link).

    python bench/trace_spans.py --steps DIR/n4-rank*.json
"""

from __future__ import annotations

import argparse
import collections
import json


def _complete_events(path: str) -> list[dict]:
    """The file's complete ("X") events, from the JSON Array or the JSON Object format."""
    with open(path) as f:
        events = json.load(f)
    if isinstance(events, dict):
        events = events.get("traceEvents", [])
    return [e for e in events if e.get("ph") == "X"]


def spans(path: str) -> dict[str, tuple[int, float]]:
    """Span name -> (count, total microseconds); the per-round 'round N' spans as 'round'."""
    totals: dict[str, list] = collections.defaultdict(lambda: [0, 0.0])
    for e in _complete_events(path):
        name = "round" if e["name"].startswith("round ") else e["name"]
        totals[name][0] += 1
        totals[name][1] += e.get("dur", 0.0)
    return {k: (n, t) for k, (n, t) in totals.items()}


def _chunk_spans(path: str) -> list[dict]:
    return [e for e in _complete_events(path) if "step" in e.get("args", {})]


def steps(paths: list[str]) -> None:
    """The ``--steps`` table (the module docstring); the ranks in the order given."""
    ranks = [_chunk_spans(p) for p in paths]
    calls = sorted({e["args"]["round"] for spans in ranks for e in spans})
    for op in calls:
        mine = [[e for e in spans if e["args"]["round"] == op] for spans in ranks]
        if not all(mine):  # (a rank that traced none of it)
            continue
        t0 = min(e["ts"] for m in mine for e in m)
        end = max(e["ts"] + e["dur"] for m in mine for e in m)
        print(f"call {op}: {(end - t0) / 1e3:.1f} ms, first span on any rank to last")
        for path, m in zip(paths, mine):
            began = min(e["ts"] for e in m)
            arrived: dict[int, float] = {}
            for e in m:
                if e["name"] == "receive":
                    arrived[e["args"]["step"]] = max(arrived.get(e["args"]["step"], 0.0), e["ts"] + e["dur"])
            ends = " ".join(f"{(arrived[g] - t0) / 1e3:6.1f}" for g in sorted(arrived))
            print(f"  {path.rsplit('/', 1)[-1]}: began {(began - t0) / 1e3:5.1f}, steps arrived by {ends}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("traces", nargs="+", help="Chrome trace files (JSON)")
    p.add_argument("--steps", action="store_true", help="the traces are one ring's ranks: when each step "
                   "arrived on each, per call (the module docstring)")
    a = p.parse_args(argv)
    if a.steps:
        steps(a.traces)
        return 0
    for path in a.traces:
        where = "/".join(path.replace("\\", "/").split("/")[-2:])  # (the run's folder and rank)
        print(f"| span ({where}) | count | mean ms | total ms |\n| ---- | ----- | ------- | -------- |")
        for name, (n, t) in sorted(spans(path).items(), key=lambda kv: -kv[1][1]):
            print(f"| {name} | {n} | {t / n / 1e3:.3f} | {t / 1e3:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
