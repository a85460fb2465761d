"""Where a round's time goes, from the Chrome traces of ``train.py --trace`` or ``join --trace``.

Prints, per span name (encode, send, receive, reduce, decode, step, batch, optimizer, apply),
how many there were and their mean and total wall time: enough to see, on a machine that is
lent for minutes, whether the ring waits on its sends, on the pool or on the wire.

    python bench/trace_spans.py DIR/n2-p2ptrain-int8/rank0.json [more.json ...]
"""

from __future__ import annotations

import argparse
import collections
import json


def spans(path: str) -> dict[str, tuple[int, float]]:
    """Span name -> (count, total microseconds); the per-round 'round N' spans as 'round'."""
    with open(path) as f:
        events = json.load(f)
    if isinstance(events, dict):
        events = events.get("traceEvents", [])
    totals: dict[str, list] = collections.defaultdict(lambda: [0, 0.0])
    for e in events:
        if e.get("ph") == "X":
            name = "round" if e["name"].startswith("round ") else e["name"]
            totals[name][0] += 1
            totals[name][1] += e.get("dur", 0.0)
    return {k: (n, t) for k, (n, t) in totals.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("traces", nargs="+", help="Chrome trace files (JSON)")
    a = p.parse_args(argv)
    for path in a.traces:
        where = "/".join(path.replace("\\", "/").split("/")[-2:])  # (the run's folder and rank)
        print(f"| span ({where}) | count | mean ms | total ms |\n| ---- | ----- | ------- | -------- |")
        for name, (n, t) in sorted(spans(path).items(), key=lambda kv: -kv[1][1]):
            print(f"| {name} | {n} | {t / n / 1e3:.3f} | {t / 1e3:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
