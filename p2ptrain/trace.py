"""``--trace FILE``: a Chrome-trace timeline of what one peer did, for chrome://tracing or Perfetto.

Spans are "complete" events (``ph: "X"``) in the JSON Array format, one track (``tid``) per
activity, so that overlap is visible: the training loop's compute and waits, each round's
ring, and inside it the encode, send, receive-wait and reduce (decode + add) of every chunk,
then the apply, and the round messages sent and received (``messages``: a mark each, named
"> ready" or "< start", with the round and the peer). Recording costs two clock reads and a tuple per span; nothing is recorded
when no tracer is given (``NO_TRACE``).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from contextlib import contextmanager

TRACKS = {"compute": 1, "round": 2, "encode": 3, "send": 4, "receive": 5, "reduce": 6, "apply": 7, "messages": 8}
MAX_SPANS = 2_000_000  # about 200 MB of JSON: a long run keeps its first spans, then counts the rest


class Tracer:
    """Collects spans in memory; ``write()`` saves them (atomically) at the end of the run."""

    def __init__(self, path: str, process: str = "p2ptrain"):
        self.path, self.process = path, process
        self.spans: list[tuple] = []
        self.dropped = 0
        self.enabled = True

    @staticmethod
    def now() -> float:
        return time.perf_counter()

    def span(self, name: str, track: str, start: float, end: float, **args) -> None:
        if len(self.spans) >= MAX_SPANS:
            self.dropped += 1
            return
        self.spans.append((name, track, start, end, args))

    @contextmanager
    def __call__(self, name: str, track: str, **args):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.span(name, track, start, time.perf_counter(), **args)

    def events(self) -> list[dict]:
        pid = os.getpid()
        out = [{"name": "process_name", "ph": "M", "pid": pid, "args": {"name": self.process}}]
        out += [{"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": track}}
                for track, tid in TRACKS.items()]
        for name, track, start, end, args in self.spans:
            event = {"name": name, "ph": "X", "pid": pid, "tid": TRACKS.get(track, 0),
                     "ts": round(start * 1e6, 1), "dur": round(max(0.0, end - start) * 1e6, 1)}
            if args:
                event["args"] = args
            out.append(event)
        return out

    def write(self) -> None:
        """Write the file whole or not at all (an ``OSError`` leaves no partial file behind)."""
        tmp = f"{self.path}.tmp-{os.getpid()}"
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump({"traceEvents": self.events(), "displayTimeUnit": "ms",
                           "otherData": {"spans_not_recorded": self.dropped}}, f)
            os.replace(tmp, self.path)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise


class _NoTrace:
    """The tracer when none is asked for: every call does nothing."""

    enabled = False

    @staticmethod
    def now() -> float:
        return 0.0

    def span(self, *args, **kwargs) -> None:
        pass

    @contextmanager
    def __call__(self, *args, **kwargs):
        yield


NO_TRACE = _NoTrace()
