"""What ``join`` shows: the status line, the metrics file's records, the summary at exit.

``JoinOutput`` is held by ``join._Join`` (``output``): it owns the status line and the losses it
reports (the last batch's, and the batches' since the last record); the counts it reports are the
command's ``counters.RunCounters``, handed in. Apart from ``join`` because it is one job: saying
what the run did, in the words the README documents (the cluster's round and update, this run's
counts, the parameter checksum), not running it.
"""

from __future__ import annotations

import logging
import sys
import time

from p2ptrain.commands.metrics_out import Metrics, MetricsFile  # noqa: F401 (MetricsFile: the old home)

log = logging.getLogger("p2ptrain.join")  # (join's lines, under join's name)


class JoinOutput:
    """The status line, metrics records and summary of one ``join`` run."""

    def __init__(self, status: StatusLine | None = None):
        self.status = status if status is not None else StatusLine()
        self.last_loss = float("nan")
        self._loss_sum, self._loss_count = 0.0, 0  # this peer's batch losses since the last round record

    def batch_loss(self, loss: float) -> None:
        """A batch's loss (what the status line, the records and the summary report)."""
        self.last_loss = loss
        self._loss_sum += loss
        self._loss_count += 1

    def write_metrics(self, out: Metrics | MetricsFile, peer, record, current: bool = True,
                      version: int | None = None) -> None:
        """One round's record in the metrics file (``--metrics``). ``current``: the parameters hold
        this round's update and nothing applied or loaded after it, so their checksum is of the
        state it left; else the record carries none (null: a peer alone commits a moment's rounds
        at once; at staleness >= 1 a round can commit before it is applied here). ``version``:
        the cluster's update count after this round (join counts it: ``_take_records``)."""
        out.write({
            "time": record.time, "version": version, "round": record.round, "members": record.members, "samples": record.samples,
            "own_samples": record.own_samples,
            "loss": self._mean_loss(), "wire_bytes": record.wire_bytes, "raw_bytes": record.raw_bytes,
            "round_seconds": record.seconds, "staleness_max": getattr(peer, "staleness_max", 0),
            "dropped": getattr(peer, "dropped", 0),
            # (the replicas' common parameters: the model holds predicted or local ones between rounds)
            "param_checksum": peer.param_checksum() if current else None})

    def _mean_loss(self) -> float:
        """The mean of this peer's batch losses since the last record (several batches per round
        at staleness >= 1 or with --sync-every), then start over."""
        total, count = self._loss_sum, self._loss_count
        self._loss_sum, self._loss_count = 0.0, 0
        return total / count if count else self.last_loss

    def report(self, peer, count, now: float, last_version: int = 0, elapsed: float | None = None,
               duration: float | None = None) -> None:
        """The status line: the cluster's update (of ``last_version``, the run's last, 0: none
        known) or the time (``elapsed`` of ``duration``), when it will end, and rates over the
        last few seconds (``count``: the run's ``RunCounters``)."""
        c = peer.cluster
        ratio = c.raw_bytes / c.wire_bytes if c.wire_bytes else 1.0
        left = []
        progress = f"update {peer.version}" + (f"/{last_version}" if last_version else "")
        if last_version:
            rate = count.updates.per_second(now)
            left.append((last_version - peer.version) / rate if rate > 0 else None)
        if duration and elapsed is not None:
            progress += f"  time {clock(elapsed)}/{clock(duration)}"
            left.append(max(0.0, duration - elapsed))
        known = [x for x in left if x is not None]
        eta = clock(min(known)) if known else "-"
        text = (f"{progress}  eta {eta}  members {peer.members}  loss {self.last_loss:.3f}  samples/s "
                f"{count.own.per_second(now):.0f} own, {count.cluster.per_second(now):.0f} cluster  wire "
                f"{count.wire.per_second(now) / 1e6:.2f} MB/s  ratio {ratio:.1f}x  staleness "
                f"{getattr(peer, 'staleness_max', 0)}")
        self.status.show(text)

    def summary(self, peer, count, task, model, device, metrics: Metrics | MetricsFile | None,
                saved: str | None = None) -> None:
        """The summary at exit, and its record in the metrics file. ``saved``: the model file's path."""
        from p2ptrain.tasks import param_checksum

        c = peer.cluster
        val = task.evaluate(model, device) if task.evaluate else None
        checksum = param_checksum(model)
        end = c.finished  # (None: this peer left before the cluster's run was over)
        unapplied = getattr(peer, "unapplied", 0)
        lines = [f"updates {count.rounds} in this run (the cluster's update {peer.version})",
                 ("left before the cluster's run was over" if not end else
                  f"the cluster's run ended at update {end.version}" if not end.behind else
                  f"the cluster's run ended without this peer's last rounds: it stopped at update {end.version}"),
                 f"samples {count.samples} (this peer {count.own_samples}"
                 + (f"; {unapplied} of them no round took before it left" if unapplied else "") + ")",
                 f"final train loss {self.last_loss:.4f}",
                 f"validation loss {val:.4f}" if val is not None else "",
                 f"sent {c.wire_bytes / 1e6:.1f} MB (ratio {c.raw_bytes / c.wire_bytes:.1f}x)" if c.wire_bytes
                 else "sent 0 MB", f"parameter checksum {checksum}", _drift_line(c.reconciler),
                 f"model saved to {saved} (model.load_state_dict(torch.load({saved!r}, weights_only=True)))"
                 if saved and not saved.endswith(".safetensors") else
                 f"model saved to {saved} (model.load_state_dict(safetensors.torch.load_file({saved!r})))" if saved
                 else "model not saved (--no-save)"]
        print("\n".join(["", "summary", *[f"  {x}" for x in lines if x]]))
        if metrics:
            metrics.write({"event": "summary", "time": time.time(), "rounds": count.rounds, "version": peer.version,
                           "samples": count.samples, "own_samples": count.own_samples,
                           "dropped": getattr(peer, "dropped", 0), "unapplied": unapplied,
                           "loss": self.last_loss, "validation_loss": val, "wire_bytes": c.wire_bytes,
                           "raw_bytes": c.raw_bytes, "param_checksum": checksum,
                           "end": end and {"round": end.r, "version": end.version, "behind": end.behind},
                           "model": saved})
        if task.sample:
            from p2ptrain.tasks import printable_text

            print("\nsample:\n" + printable_text(str(task.sample(model, device))))  # (a task file's too)


def clock(seconds: float) -> str:
    """``42s``, ``3m05s``, ``1h02m``: a duration as the status line shows it."""
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def _drift_line(r) -> str:
    """What the comparisons with the coordinator's parameters found (``cluster.reconcile``)."""
    from p2ptrain.cluster.drift import TOLERANCE

    if not r.compared:
        return ""
    how = "all bit-identical" if r.identical == r.compared else (
        f"{r.identical} bit-identical, largest drift {r.drift_max:.1e} (tolerance {TOLERANCE:.0e})")
    return f"parameters compared with the coordinator's {r.compared} times: {how}" + (
        f"; its parameters loaded {r.reconciled} times" if r.reconciled else "")


class StatusLine:
    """On a terminal, one line rewritten in place; elsewhere a log line every few seconds."""

    def __init__(self, stream=None):
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self._last = 0.0
        self._width = 0

    def show(self, text: str) -> None:
        if self.tty:
            self.stream.write("\r" + text.ljust(self._width))
            self.stream.flush()
            self._width = len(text)
        elif time.monotonic() - self._last >= 5.0:
            self._last = time.monotonic()
            log.info("%s", text)

    def clear(self) -> None:
        if self.tty and self._width:
            self.stream.write("\n")
            self.stream.flush()
