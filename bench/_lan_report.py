"""bench/lan.py's report, made on rank 0: figures from every peer's results, tables, JSON, plots.

``Report`` takes each phase's gathered results (one dict per peer, rank order) as they
come and, in ``finish()``, prints the Markdown tables, writes ``--json`` and, when
matplotlib imports, two PNGs beside it (``<stem>-bandwidth.png``, ``<stem>-loss.png``).
The meaning of every column is in bench/README.md ("bench/lan.py").
"""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import socket
import subprocess
import time
from pathlib import Path

import _common
import _lan_train

BENCH = Path(__file__).resolve().parent
QUEUED_NOTE = 0.1  # a note when rank 0's training process waited for a CPU more than this share of its time
FLOOR_SPREAD_S = 0.05  # a note when a floor's lone peers took their first batches further apart than this
ERR_ELEMS = 1 << 20  # the codec error is simulated on at most this many values per peer


class Report:
    def __init__(self, a, world: int, notes: list[str]):
        self.a, self.world, self.notes = a, world, notes
        self.allreduce: list[dict] = []
        self.train_rows: list[dict] = []
        self.failed: list[str] = []
        self.load_start = _loadavg()

    # -- phases

    def allreduce_p2p(self, everyone: list[dict]) -> None:
        import allreduce

        if not all(x["ok"] for x in everyone):
            self._fail("allreduce p2ptrain", everyone)
            return
        rows = allreduce._collect([x["output"] for x in everyone], self.world, self.a.link_bps)
        errors = {c: self._codec_error(c) for c in self.a.codecs}
        for r in rows:
            r["err_sim"] = errors[r["codec"]]
            self._bound(r, wire_ratio=r["ratio"] or 1.0)
            if not r["identical"]:
                self.failed.append(f"allreduce {r['codec']} {_common.fmt_size(r['size_bytes'])}: "
                                   "peers ended with different results")
        self.allreduce += rows

    def allreduce_gloo(self, everyone: list[dict]) -> None:
        if not all(x["ok"] for x in everyone) or not everyone[0]["output"]:
            self._fail("allreduce gloo", everyone)
            return
        import gloo_allreduce

        for g in json.loads(everyone[0]["output"][len(gloo_allreduce.RESULT_MARK):]):
            t = _common.median(g["times_s"])
            algbw = g["size_bytes"] / t
            row = {"impl": "gloo", "codec": "fp32", "n": self.world, "size_bytes": g["size_bytes"],
                   "median_s": t, "algbw_Bps": algbw, "busbw_Bps": _common.busbw(algbw, self.world),
                   "ratio": 1.0, "err_sim": None, "identical": None, "link_bps": self.a.link_bps,
                   "rep_times_s": g["times_s"]}
            self._bound(row, wire_ratio=1.0)
            self.allreduce.append(row)

    def train(self, run, everyone: list[dict]) -> None:
        taking = everyone[:run.n]
        first = taking[0].get("summary") or {}
        sums = [x.get("summary", {}).get("param_checksum") for x in taking]
        row = {"impl": run.impl, "codec": run.codec, "staleness": run.staleness, "predict": run.predict,
               "overlap": run.overlap, "n": run.n,
               "sync_every": run.sync_every,
               "ok": all(x["ok"] for x in taking),
               "error": next((f"peer {r}: {x['error']}" for r, x in enumerate(taking) if not x["ok"]), None),
               "identical": (len(set(sums)) == 1) if all(sums) else None,
               "own_samples_by_peer": [x.get("summary", {}).get("own_samples") for x in taking], **first}
        row["floor"] = run.floor
        if run.floor:  # (all n at once: the floor at a sample count is when their sum reached it)
            row["progress_by_peer"] = [x.get("summary", {}).get("progress") or [] for x in taking]
            for key in ("samples", "samples_per_s"):  # (a lone peer's records count its own samples only)
                row[key] = sum(x.get("summary", {}).get(key) or 0 for x in taking)
            began = [x.get("summary", {}).get("started") for x in taking]
            if None not in began and max(began) - min(began) > FLOOR_SPREAD_S:
                self.notes.append(f"{run.label}: the lone peers' first batches were {max(began) - min(began):.2f} s "
                                  "apart (one started late): the floor is low by up to that")
        row.pop("progress", None)
        if row.get("samples_per_s"):
            row["per_peer_samples_per_s"] = row["samples_per_s"] / run.n
        row["queued_by_peer"] = [_queued(x.get("summary", {})) for x in taking]
        if (row["queued_by_peer"][0] or 0) > QUEUED_NOTE:
            self.notes.append(f"{run.label}: rank 0 waited for a CPU {row['queued_by_peer'][0]:.0%} of the time it "
                              "could run (other processes had its cores): its own/s is low by up to that share")
        if not row["ok"]:
            self.failed.append(f"{run.label}: {row['error'].splitlines()[0][:300]}")
        elif row.get("identical") is False and not run.floor and (run.staleness in (None, 0) or run.sync_every):
            self.failed.append(f"{run.label}: replicas ended with different parameters")
        self.train_rows.append(row)

    # -- the end

    def finish(self) -> int:
        self._scaling()
        self._floors()
        start, end = self.load_start, _loadavg()
        if start and end and max(start[0], end[0]) > (os.cpu_count() or 1):
            self.notes.append(f"load average {start[0]:.1f} at the start, {end[0]:.1f} at the end, on rank 0's "
                              f"{os.cpu_count()} CPUs (this benchmark's processes included): above the peers "
                              "running there, something else shared the CPUs and CPU-bound figures are disturbed")
        print(self.allreduce_table() if self.allreduce else "(no allreduce measured)")
        print()
        print(self.train_table() if self.train_rows else "(no training measured)")
        for line in self.notes + [f"FAILED: {f}" for f in self.failed]:
            print(f"\n- {line}", end="")
        print(flush=True)
        plots = self._plots()
        if self.a.json:
            doc = {"config": self._config(), "allreduce": self.allreduce, "train": self.train_rows,
                   "notes": self.notes, "failed": self.failed, "plots": plots}
            Path(self.a.json).parent.mkdir(parents=True, exist_ok=True)
            Path(self.a.json).write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
        return 1 if self.failed else 0

    def allreduce_table(self) -> str:
        gloo = {r["size_bytes"]: r for r in self.allreduce if r["impl"] == "gloo"}
        head = ["N", "size", "impl", "codec", "median", "algbw", "busbw", "of link", "of bound",
                "wire ratio", "err", "identical", "busbw / gloo"]
        rows = []
        for r in sorted(self.allreduce, key=lambda r: (r["size_bytes"], r["impl"] != "gloo")):
            g = gloo.get(r["size_bytes"])
            rows.append([r["n"], _common.fmt_size(r["size_bytes"]), r["impl"], r["codec"],
                         f"{r['median_s'] * 1e3:.1f} ms", _common.fmt_rate(r["algbw_Bps"]),
                         _common.fmt_rate(r["busbw_Bps"]), _f(r.get("of_link"), ".3f"),
                         _f(r.get("of_bound"), ".3f"), _f(r["ratio"], ".1f", "x"), _f(r["err_sim"], ".1e"),
                         "-" if r["identical"] is None else r["identical"],
                         _f(r["busbw_Bps"] / g["busbw_Bps"], ".2f") if g and r["impl"] != "gloo" else "-"])
        return _common.table(rows, head)

    def train_table(self) -> str:
        gloo = {r["n"]: r for r in self.train_rows if r["impl"] == "gloo" and r["ok"]}
        target = self.a.target_loss
        head = ["impl", "codec", "staleness", "N", "rounds", "samples", "samples/s", "per peer", "rank 0 own/s",
                "scaling eff", "vs gloo", f"to loss {target:g}", "vs gloo", "B/sample", "MB to loss", "final loss", "identical"]
        floors = any(r.get("floor") for r in self.train_rows)
        head += ["no comm", "vs no comm"] if floors else []
        rows = []
        for r in self.train_rows:
            g = gloo.get(r["n"])
            vs = (r["samples_per_s"] / g["samples_per_s"]
                  if r["impl"] != "gloo" and g and r.get("samples_per_s") and g.get("samples_per_s") else None)
            alone = r["n"] == 1 and r["impl"] == "p2ptrain"  # codec and staleness do not matter alone
            tau = "-" if alone or r["impl"] == "gloo" else (r["staleness"] or 0)
            tau = f"{tau} +wp" if r.get("predict") else tau  # weight prediction
            tau = f"{tau} +ov" if r.get("overlap") else tau  # overlap
            tau = f"{tau} H={r['sync_every']}" if r.get("sync_every") else tau  # local steps
            tau = f"no comm{' H=' + str(r['sync_every']) if r.get('sync_every') else ''}" if r.get("floor") else tau
            own = (r["own_samples_by_peer"][0] / r["seconds"]
                   if r.get("seconds") and r.get("own_samples_by_peer") and r["own_samples_by_peer"][0] else None)
            ttl = (r["time_to_target_s"] / g["time_to_target_s"] if r["impl"] != "gloo" and g
                   and r.get("time_to_target_s") and g.get("time_to_target_s") else None)
            rows.append([r["impl"], "-" if alone or r.get("floor") else r["codec"], tau,
                         r["n"], r.get("rounds", 0) if r["ok"] else "FAILED", r.get("samples", "-"),
                         _f(r.get("samples_per_s"), ".0f"), _f(r.get("per_peer_samples_per_s"), ".0f"),
                         _f(own, ".0f"), _f(r.get("efficiency"), ".2f"), _f(vs, ".2f"),
                         _f(r.get("time_to_target_s"), ".3g", " s") if r.get("rounds") else "-", _f(ttl, ".2f"),
                         _f(r.get("bytes_per_sample") or None, ".0f"),
                         _f(r["bytes_to_target"] / 1e6 if r.get("bytes_to_target") else None, ".2f"),
                         _f(r.get("final_loss"), ".3f"), "-" if r.get("identical") is None else r["identical"]])
            if floors:
                no_comm = r.get("no_comm_s")
                rows[-1] += [_f(no_comm, ".3g", " s"),
                             _f(r["time_to_target_s"] / no_comm if no_comm else None, ".2f")]
            if r.get("floor"):  # (lone peers: their loss and checksums are not a cluster's)
                for col in (head.index(f"to loss {target:g}"), head.index("final loss")):
                    rows[-1][col:col + 2] = ["-", "-"]  # (and the column beside: its vs gloo, identical)
        return _common.table(rows, head)

    # -- pieces

    def _fail(self, what: str, everyone: list[dict]) -> None:
        for r, x in enumerate(everyone):
            if not x["ok"]:
                self.failed.append(f"{what}: peer {r}: {(x['error'] or 'no result').splitlines()[0][:300]}")
                return
        self.failed.append(f"{what}: no result")

    def _bound(self, row: dict, wire_ratio: float) -> None:
        """of link = busbw / B; of bound = (2(N-1)/N * S_wire / B) / time, S_wire the bytes a codec sends."""
        link = self.a.link_bps
        row["of_link"] = row["busbw_Bps"] * 8 / link if link else None
        n = row["n"]
        bound = 2 * (n - 1) / n * row["size_bytes"] / wire_ratio / (link / 8) if link else None
        row["bound_s"] = bound
        row["of_bound"] = bound / row["median_s"] if bound else None

    def _codec_error(self, spec: str) -> float | None:
        """Relative L2 error of an N-peer ring sum through ``spec`` on the workers' own data
        (peer r adds numpy default_rng(r).standard_normal), simulated: bench/codecs.py's through_ring."""
        import numpy as np

        from p2ptrain.codecs import parse_codec

        loader = importlib.util.spec_from_file_location("_bench_codecs", BENCH / "codecs.py")
        bench_codecs = importlib.util.module_from_spec(loader)
        loader.loader.exec_module(bench_codecs)
        m = min(ERR_ELEMS, int(max(self.a.sizes) * _common.MiB) // 4)
        xs = [np.random.default_rng(r).standard_normal(m, dtype=np.float32) for r in range(self.world)]
        return bench_codecs.through_ring(parse_codec(spec), xs, bench_codecs.exact_sum(xs),
                                         self.a.chunk_kib * 256)

    def _scaling(self) -> None:
        alone = {r["impl"]: r for r in self.train_rows if r["n"] == 1 and r["ok"] and r.get("samples_per_s")}
        for r in self.train_rows:
            base = alone.get(r["impl"])
            if base and r.get("samples_per_s"):
                r["efficiency"] = r["samples_per_s"] / (r["n"] * base["samples_per_s"])

    def _floors(self) -> None:
        """Each run's ``no_comm_s``: the time its N peers, alone and all at once (the floor run of
        the same N and mode), took to compute, together, the samples it needed to its target."""
        floors = {(r["n"], r.get("sync_every")): r for r in self.train_rows if r.get("floor") and r["ok"]}
        for r in self.train_rows:
            floor = floors.get((r["n"], r.get("sync_every")))
            if r["impl"] != "p2ptrain" or r.get("floor") or not floor or not r.get("samples_to_target"):
                continue
            r["no_comm_s"] = _lan_train.floor_at(floor["progress_by_peer"], r["samples_to_target"])

    def _config(self) -> dict:
        a = self.a
        import torch

        return {"peers": a.peer_list, "n": self.world, "link_bps": a.link_bps, "links": a.link,
                "sizes_mib": a.sizes, "reps": a.reps, "codecs": a.codecs, "chunk_kib": a.chunk_kib,
                "train_codecs": a.train_codecs, "staleness": a.staleness, "model_size": a.model_size,
                "batch_size": a.batch_size, "rounds": a.rounds, "target_loss": a.target_loss,
                "step_delay_s": a.step_delay, "slow_busy": a.slow_busy, "slow_ranks": a.slow_ranks, "threads": a.threads,
                "pin_cores": a.pin_cores, "device": a.device,
                "quick": a.quick, "host": socket.gethostname(), "python": platform.python_version(),
                "torch": torch.__version__, "p2ptrain_git": _git_describe(), "unix_time": time.time(),
                "cpus": os.cpu_count(), "loadavg_start": self.load_start, "loadavg_end": _loadavg()}

    def _plots(self) -> list[str]:
        if not (self.a.json or self.a.plots):
            return []
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            return []  # optional: the JSON has every number the plots would show
        stem = (Path(self.a.plots) / "lan" if self.a.plots else Path(self.a.json).with_suffix(""))
        stem.parent.mkdir(parents=True, exist_ok=True)
        made = []
        if self.allreduce:
            fig, ax = plt.subplots(figsize=(7, 4.5))
            for key in sorted({(r["impl"], r["codec"]) for r in self.allreduce}):
                pts = sorted((r["size_bytes"] / _common.MiB, r["busbw_Bps"] / 1e6)
                             for r in self.allreduce if (r["impl"], r["codec"]) == key)
                ax.plot(*zip(*pts), marker="o", label=" ".join(key))
            if self.a.link_bps:
                ax.axhline(self.a.link_bps / 8e6, color="gray", ls="--", label="link rate")
            sizes = sorted({r["size_bytes"] for r in self.allreduce})
            ax.set(xscale="log", xlabel="buffer (fp32)", ylabel="busbw (MB/s of fp32 bytes)",
                   title=f"allreduce, N={self.world}")
            ax.set_xticks([s / _common.MiB for s in sizes], [_common.fmt_size(s) for s in sizes])
            ax.minorticks_off()
            ax.legend()
            made.append(_save(fig, stem.parent / f"{stem.name}-bandwidth.png"))
        big = max((r["n"] for r in self.train_rows if r.get("curve")), default=0)
        if big:
            fig, ax = plt.subplots(figsize=(7, 4.5))
            for r in self.train_rows:
                if r["n"] == big and r.get("curve") and not r.get("floor"):
                    tau = "" if r["staleness"] is None else f" staleness {r['staleness']}"
                    tau += f" H={r['sync_every']}" if r.get("sync_every") else ""
                    ax.plot(*zip(*r["curve"]), label=f"{r['impl']} {r['codec']}{tau}")
            if self.a.target_loss is not None:
                ax.axhline(self.a.target_loss, color="gray", ls="--", label="target")
            ax.set(xlabel="wall time (s)", ylabel="training loss (smoothed)", title=f"training, N={big}")
            ax.legend()
            made.append(_save(fig, stem.parent / f"{stem.name}-loss.png"))
        plt.close("all")
        return made


def _queued(summary: dict) -> float | None:
    """The share of the time a peer's training process could run that it waited for a CPU."""
    run, queued = summary.get("cpu_s"), summary.get("queued_s")
    return queued / (run + queued) if run is not None and queued is not None and run + queued > 0 else None


def _loadavg() -> list[float] | None:
    """1, 5 and 15 minute load averages: whether something else shared the CPUs (shared CI machines do)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def _git_describe() -> str | None:
    """The checkout's commit (and -dirty), or None outside a git checkout."""
    try:
        p = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=BENCH, capture_output=True,
                           text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return p.stdout.strip() or None


def _save(fig, path: Path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return str(path)


def _f(x, spec: str, unit: str = "") -> str:
    return "-" if x is None else f"{x:{spec}}{unit}"
