"""bench/lan.py's training part: which runs to make, the commands that make them, what they measured.

A *run* is one training job on the first ``n`` peers: p2ptrain (the real ``python -m
p2ptrain join`` command, one codec and staleness) or gloo (DDP, bench/_lan_ddp.py). Both
write one JSON object per round (time, round, samples, loss, round_seconds, ...), read
here by ``summarize``:

- throughput: samples per second after a warm-up (the first tenth of the rounds, at least
  one: process start, connection and first-step allocation are not training speed);
  ``samples`` in a record is the cluster's total for that round;
- the smoothed loss: an exponential moving average (beta 0.9, bias-corrected) of each
  round's training loss, that of rank 0's own batch;
- time to target: wall seconds from the first batch (join's ``training`` event; DDP's first
  step) until the smoothed loss first drops below the target (None: not reached). Not from
  the first round's ring: in local-steps mode H inner steps come before it;
- bytes to target: what this peer sent in the rounds up to that one (the bytes at equal loss);
- the no-communication floor (``--floor``): the time the same peers, each alone and all at
  once on the same cores, took to compute together the samples a run needed to its target
  (``floor_at``).

Flags that ``join`` gained recently (``--staleness``, ``--step-delay``, ``--min-peers``,
``--no-discovery``) are passed only when its parser has them. A join with
``--no-discovery`` takes the *other* peers in ``--peers`` and its listen address in
``--host``; one without it (the first, static-group join) takes the whole group and
this peer's entry.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from dataclasses import dataclass
from pathlib import Path

EMA_BETA = 0.9
CURVE_POINTS = 200


@dataclass(frozen=True)
class Run:
    """One training job: ``impl`` p2ptrain or gloo, on peers 0..n-1."""

    index: int
    impl: str
    n: int
    codec: str = "none"
    staleness: int | None = None   # None: not passed (join's own default)
    predict: bool = False   # join --weight-prediction
    overlap: bool = False   # join --overlap (staleness 0, gradient mode)
    sync_every: int | None = None   # join --sync-every H: local-steps mode (DiLoCo)
    floor: bool = False   # each of the n peers alone (a cluster of one), all at once: no communication

    @property
    def label(self) -> str:
        if self.impl == "gloo":
            return f"gloo DDP fp32, N={self.n}"
        if self.floor:
            mode = f"local steps H={self.sync_every}" if self.sync_every else "gradient mode"
            return f"no communication: {self.n} lone peers at once, {mode}"
        tau = "" if self.staleness is None else f", staleness {self.staleness}"
        tau += ", weight prediction" if self.predict else ""
        tau += ", overlap" if self.overlap else ""
        tau += f", local steps H={self.sync_every}" if self.sync_every else ""
        return f"p2ptrain {self.codec}{tau}, N={self.n}"


def join_flags() -> set[str]:
    """Every option ``python -m p2ptrain join`` takes today, hidden ones included (``--step-delay``)."""
    from p2ptrain.commands.cli import build_parser

    parser = build_parser()
    sub = next(x for x in parser._actions if isinstance(x, argparse._SubParsersAction))
    return set(sub.choices["join"]._option_string_actions)


def plan(n_peers: int, scaling: list[int], codecs: list[str], staleness: list[int],
         flags: set[str], gloo: bool, predict: bool = False,
         sync_every: list[int] = (), local_staleness: list[int] = (1,),
         overlap: bool = False, floor: bool = False) -> tuple[list[Run], list[str]]:
    """The runs, in order, and a line per thing that cannot be run with this join.
    ``predict``: each p2ptrain run at staleness >= 1 is made twice, the second with
    ``--weight-prediction``; ``overlap``: each at staleness 0 twice, the second with
    ``--overlap`` (the ring on the gradients backward made first). ``sync_every``: a
    local-steps run per H, codec and staleness of ``local_staleness``. ``floor``: at each N >= 2,
    after gradient mode's runs and after each H's, the same steps with no communication (the n
    peers each a cluster of one, on the same cores at once): the floor a run's time to its
    samples is read against (codec and staleness change nothing there).

    N=1 is run once per implementation (and once per H in local-steps mode): alone, a peer
    sends nothing, so its codec and staleness change nothing; it is the base of every scaling
    efficiency, and of the fast peer's samples/s beside a slow one (``--step-delay``).
    """
    skipped = []
    taus: list[int | None] = []
    for tau in staleness:
        if "--staleness" in flags:
            taus.append(tau)
        elif tau == 0:
            taus.append(None)  # join without --staleness is synchronous: staleness 0
        else:
            skipped.append(f"p2ptrain staleness {tau}: this join has no --staleness")
    runs: list[Run] = []
    for n in scaling:
        if not 1 <= n <= n_peers:
            continue
        variants = [(c, t) for c in codecs for t in taus] if n > 1 else [(codecs[0], taus[0] if taus else None)]
        floor_too = floor and n > 1 and "--min-peers" in flags
        for codec, tau in variants if taus else []:
            runs.append(Run(len(runs), "p2ptrain", n, codec, tau))
            if predict and n > 1 and tau and "--weight-prediction" in flags:
                runs.append(Run(len(runs), "p2ptrain", n, codec, tau, predict=True))
            if overlap and n > 1 and not tau and "--overlap" in flags:
                runs.append(Run(len(runs), "p2ptrain", n, codec, tau, overlap=True))
        if floor_too and taus:
            runs.append(Run(len(runs), "p2ptrain", n, codecs[0], floor=True))
        # (local steps alone too: the base of the slow-peer figure, the fast peer's own samples/s)
        for codec in (codecs if n > 1 else codecs[:1]) if "--sync-every" in flags else []:
            runs += [Run(len(runs) + i, "p2ptrain", n, codec, tau, sync_every=h)
                     for i, (h, tau) in enumerate(itertools.product(sync_every, local_staleness))]
        for h in sync_every if floor_too and "--sync-every" in flags else []:
            runs.append(Run(len(runs), "p2ptrain", n, codecs[0], sync_every=h, floor=True))
        if gloo:
            runs.append(Run(len(runs), "gloo", n, "fp32"))
    if overlap and "--overlap" not in flags:
        skipped.append("overlap: this join has no --overlap")
    if sync_every and "--sync-every" not in flags:
        skipped.append("local steps: this join has no --sync-every")
    if floor and "--min-peers" not in flags:
        skipped.append("no-communication floor: this join has no --min-peers")
    return runs, skipped


def local_rounds(run: Run, rounds: int) -> int:
    """Rounds of a run: ``rounds`` steps, or in local-steps mode as many rounds as make that
    many inner steps on a peer of average speed (the same samples as DDP's ``rounds`` steps)."""
    return max(2, -(-rounds // run.sync_every)) if run.sync_every else rounds


def join_command(run: Run, *, peers: list[str], own: str, metrics: Path, model_size: str,
                 batch_size: int, rounds: int, secret: str, cluster: str, flags: set[str],
                 step_delay: float = 0.0, step_busy: bool = False, log_level: str = "warning",
                 outer_lr: float | None = None, outer_momentum: float | None = None,
                 device: str = "cpu", start_at: float | None = None, trace: Path | None = None,
                 python: str = sys.executable) -> list[str]:
    """The ``python -m p2ptrain join`` command line of peer ``own`` (one of ``peers``) in ``run``;
    ``start_at``: its first batch at that Unix time (a floor's lone peers, which wait for no one)."""
    host, port = own.rsplit(":", 1)
    data_rank = peers.index(own)
    peers = [own] if run.floor else peers  # (a cluster of one: it sends nothing)
    cmd = [python, "-m", "p2ptrain", "join", "--log-level", log_level, "--task", "synthetic",
           "--model-size", model_size, "--batch-size", str(batch_size), "--seed", "0",
           "--host", host, "--port", port, "--cluster", cluster, "--secret", secret,
           "--metrics", str(metrics), "--max-rounds", str(local_rounds(run, rounds)), "--compression", run.codec,
           "--eval-every", "0", "--connect-timeout", "60", "--device", device]
    if "--no-save" in flags:  # (the trained model is not the benchmark's: no file left in the current folder)
        cmd += ["--no-save"]
    if "--no-discovery" in flags:  # the cluster join: the others, found without beacons
        others = [p for p in peers if p != own]
        cmd += ["--no-discovery"] + (["--peers", ",".join(others)] if others else [])
    else:  # the static-group join: the whole group
        cmd += ["--peers", ",".join(peers)]
    if run.staleness is not None:
        cmd += ["--staleness", str(run.staleness)]
    if run.predict:
        cmd += ["--weight-prediction"]
    if run.overlap:
        cmd += ["--overlap"]
    if run.sync_every:
        cmd += ["--sync-every", str(run.sync_every)]
        cmd += ["--outer-lr", str(outer_lr)] if outer_lr is not None else []
        cmd += ["--outer-momentum", str(outer_momentum)] if outer_momentum is not None else []
    if "--min-peers" in flags:
        cmd += ["--min-peers", str(1 if run.floor else run.n)]
    if "--data-rank" in flags:  # (DDP's rank i reads stream i: the same batches on both sides)
        cmd += ["--data-rank", str(data_rank)]
    if trace is not None:
        cmd += ["--trace", str(trace)]
    if start_at and "--start-at" in flags:
        cmd += ["--start-at", f"{start_at:.3f}"]
    if step_delay and "--step-delay" in flags:
        cmd += ["--step-delay", str(step_delay)] + (["--step-busy"] if step_busy and "--step-busy" in flags else [])
    return cmd


def ddp_command(run: Run, *, rank: int, master: str, port: int, metrics: Path, model_size: str,
                batch_size: int, rounds: int, step_delay: float, threads: int,
                timeout: float, step_busy: bool = False, device: str = "cpu",
                python: str = sys.executable) -> list[str]:
    """The bench/_lan_ddp.py command line of rank ``rank`` in ``run``."""
    script = Path(__file__).resolve().parent / "_lan_ddp.py"
    return [python, str(script), "--rank", str(rank), "--world", str(run.n), "--master", master,
            "--port", str(port), "--model-size", model_size, "--batch-size", str(batch_size),
            "--rounds", str(rounds), "--metrics", str(metrics), "--step-delay", str(step_delay),
            "--threads", str(threads), "--timeout", str(timeout), "--device", device] + \
        (["--step-busy"] if step_busy else [])


# ------------------------------------------------------------------ reading a metrics file

def read_metrics(path: Path) -> tuple[list[dict], dict]:
    """The round records of a metrics file, in order, and its final ``{"event": "summary"}``
    ({} if none), with ``started``: the time of its ``{"event": "training"}`` (join's first
    batch) where it has one; a torn last line (a process killed while writing) ends the reading."""
    records, summary, started = [], {}, None
    if not path.exists():
        return records, summary
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            break
        if record.get("event") == "summary":
            summary = record
        elif record.get("event") == "training" and started is None:
            started = record["time"]
        elif "event" not in record:
            records.append(record)
    return records, summary if started is None else {**summary, "started": started}


def smoothed(losses: list[float], beta: float = EMA_BETA, weights: list[float] | None = None) -> list[float]:
    """Bias-corrected exponential moving average (the first value is the first loss). With
    ``weights``, record i counts as that many steps (``beta ** w``): a local-steps round stands
    for H steps, so the curves of runs with few and many samples per record stay comparable."""
    out, ema, kept = [], 0.0, 1.0
    for i, x in enumerate(losses):
        b = beta ** (weights[i] if weights else 1.0)
        ema = b * ema + (1 - b) * x
        kept *= b
        out.append(ema / (1 - kept))
    return out


def summarize(records: list[dict], final: dict, target_loss: float | None, step_samples: int | None = None) -> dict:
    """Throughput, smoothed loss curve and time to target of one peer's metrics (module docstring);
    ``final`` is the file's summary event, whose byte counts and checksum win when present.
    ``step_samples`` (DDP's global batch): the loss is smoothed per that many samples."""
    if not records:
        return {"rounds": 0}
    # From the first batch: join's training event, else (DDP's records time whole steps) the first
    # record's start. A join round's round_seconds is its ring only, so its batches came before.
    start = final.get("started") or records[0]["time"] - records[0].get("round_seconds", 0.0)
    # (a lone peer told to begin later, --start-at, commits empty rounds while it waits)
    records = [r for r in records if r["time"] > start or r["samples"]] or records
    times = [r["time"] - start for r in records]
    if len(records) >= 2:
        warm = min(len(records) - 2, max(0, len(records) // 10 - 1))
        samples = sum(r["samples"] for r in records[warm + 1:])
        seconds = times[-1] - times[warm]
    else:
        samples, seconds = records[0]["samples"], max(times[0], 1e-9)
    ema = smoothed([r["loss"] for r in records],
                   weights=[max(r["samples"], 1) / step_samples for r in records] if step_samples else None)
    at = next((i for i, v in enumerate(ema) if target_loss is not None and v < target_loss), None)
    reached = None if at is None else times[at]
    step = max(1, len(records) // CURVE_POINTS)
    last = records[-1]
    return {
        "rounds": len(records), "seconds": times[-1], "samples": sum(r["samples"] for r in records), "started": start,
        "samples_per_s": samples / seconds if seconds > 0 else None,
        "time_to_target_s": reached, "final_loss": ema[-1],
        "wire_bytes": final.get("wire_bytes", last.get("wire_bytes")),
        "raw_bytes": final.get("raw_bytes", last.get("raw_bytes")),
        "own_samples": final.get("own_samples"), "dropped": last.get("dropped"),
        "bytes_per_sample": (final.get("wire_bytes", last.get("wire_bytes")) or 0) / max(1, sum(r["samples"] for r in records)),
        # (what crossed the wire to reach the target: the comparison at equal loss, where a mode
        # that needs more samples to a loss pays for them; a record's wire_bytes are its round's)
        "bytes_to_target": None if at is None else sum(r.get("wire_bytes") or 0 for r in records[:at + 1]),
        "samples_to_target": None if at is None else sum(r["samples"] for r in records[:at + 1]),
        # (time and samples so far at each record: where a no-communication floor is read)
        "progress": [[round(t, 4), n] for t, n in zip(times, itertools.accumulate(r["samples"] for r in records))],
        "staleness_max": max((r.get("staleness_max") or 0) for r in records),
        "param_checksum": final.get("param_checksum", last.get("param_checksum")),
        "curve": [[round(times[i], 4), round(ema[i], 5)] for i in range(0, len(records), step)],
    }


def floor_at(progress_by_peer: list[list[list[float]]], samples: float) -> float | None:
    """When a floor run's peers, together, had computed ``samples``: the first time the sum of
    their ``progress`` ([time, samples so far] per record, each from its own first batch; they
    began together) reached it, each peer's count interpolated within its records. The sum, not
    the slowest peer: lone peers that wait for no one share the cores unevenly (one finished in
    half another's time in a 4-peer run on 2 cores), where a cluster's rounds keep them level.
    None: they never did."""
    import numpy as np

    times = np.array(sorted({t for progress in progress_by_peer for t, _ in progress}))
    # (each peer's samples so far at those times: linear within a record, its last count after)
    totals = sum(np.interp(times, [0.0] + [t for t, _ in p], [0] + [n for _, n in p]) for p in progress_by_peer)
    reached = np.flatnonzero(totals >= samples)
    if not reached.size:
        return None
    i = reached[0]
    before_t, before_n = (times[i - 1], totals[i - 1]) if i else (0.0, 0.0)
    return float(before_t + (times[i] - before_t) * (samples - before_n) / max(totals[i] - before_n, 1e-12))
