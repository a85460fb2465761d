"""Where ``join``'s records go: ``--metrics`` (JSON lines, or CSV for a ``.csv`` path) and
``--tensorboard DIR`` (event files, as ``Trainer`` and Lightning users read them).

Every record is a dict; the round records, the ``validation`` records (at ``--eval-every``) and
the ``summary`` carry ``version``, the cluster's update count, the same number on every peer and
the one the status line shows. A sink the disk refuses (full) is said once, and the run goes on
without it: the records are a report, not the work.
"""

from __future__ import annotations

import csv
import json
import logging
import os

log = logging.getLogger("p2ptrain.join")  # (join's lines, under join's name)

# A CSV file's columns, in this order; a record's other keys are JSON's only.
CSV_COLUMNS = ("event", "time", "version", "round", "members", "samples", "own_samples", "loss", "validation_loss",
               "wire_bytes", "raw_bytes", "round_seconds", "staleness_max", "dropped", "param_checksum")
# TensorBoard's scalars: tag -> the record's key (at the record's version: the x axis every peer shares).
TB_SCALARS = {"train/loss": "loss", "validation/loss": "validation_loss", "round/samples": "samples",
              "round/members": "members", "round/seconds": "round_seconds", "round/wire_bytes": "wire_bytes"}


class MetricsFile:
    """``--metrics``: one record a line, appended and flushed: JSON, or CSV rows under a header
    (written when the file is new or empty) for a path that ends in ``.csv``."""

    def __init__(self, path: str):
        self.path = path
        self._file = open(path, "a", encoding="utf-8", newline="")
        self._csv = None
        if path.lower().endswith(".csv"):
            self._csv = csv.DictWriter(self._file, CSV_COLUMNS, extrasaction="ignore")
            if self._file.tell() == 0:
                self._csv.writeheader()

    def write(self, record: dict) -> None:
        if self._file is None:
            return
        try:
            if self._csv is not None:
                self._csv.writerow({k: "" if v is None else v for k, v in record.items()})
            else:
                self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        except OSError as exc:
            log.warning("cannot write --metrics %s (%s): no more records go there; training goes on", self.path,
                        exc.strerror or exc)
            self.close()

    def close(self) -> None:
        if self._file is not None:
            try:
                self._file.close()
            except OSError:  # (what was left to flush: said at its write)
                pass
            self._file = None


class TensorBoardFile:
    """``--tensorboard DIR``: the records' numbers as scalars at their ``version``
    (``torch.utils.tensorboard``, which needs the tensorboard package: ``join`` checks first)."""

    def __init__(self, folder: str):
        from torch.utils.tensorboard import SummaryWriter

        self.folder = folder
        self._writer = SummaryWriter(log_dir=folder)

    def write(self, record: dict) -> None:
        version = record.get("version")
        if self._writer is None or version is None:
            return
        try:
            for tag, key in TB_SCALARS.items():
                value = record.get(key)
                if isinstance(value, (int, float)) and not isinstance(value, bool) and value == value:
                    self._writer.add_scalar(tag, value, version, walltime=record.get("time"))
            self._writer.flush()
        except OSError as exc:
            log.warning("cannot write --tensorboard %s (%s): no more events go there; training goes on", self.folder,
                        exc.strerror or exc)
            self.close()

    def close(self) -> None:
        if self._writer is not None:
            try:
                self._writer.close()
            except OSError:
                pass
            self._writer = None


class Metrics:
    """Every sink asked for, written alike (``write``), closed together (``close``)."""

    def __init__(self, sinks: list):
        self.sinks = sinks

    def write(self, record: dict) -> None:
        for sink in self.sinks:
            sink.write(record)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


def open_metrics(path: str | None, tensorboard: str | None) -> Metrics | None:
    """The sinks of ``--metrics`` and ``--tensorboard`` (None: neither given)."""
    sinks: list = []
    if path:
        sinks.append(MetricsFile(path))
    if tensorboard:
        os.makedirs(tensorboard, exist_ok=True)
        sinks.append(TensorBoardFile(tensorboard))
    return Metrics(sinks) if sinks else None
