"""A timeline of collective operations in Chrome's trace event format (open it in
chrome://tracing or https://ui.perfetto.dev), as Horovod's HOROVOD_TIMELINE writes one.

Each operation name (a tensor's `name=`, or a gradient bucket) gets a row of its own, as in
Horovod's timeline, and each operation a span on it: its activity (ALLREDUCE, BROADCAST, ...)
from the call to its completion as this rank saw them. Events are written as they happen, so a
run that dies keeps what it had recorded; close() ends the JSON array.
"""
from __future__ import annotations

import json
import threading
import time


class Timeline:
    def __init__(self, path: str):
        self._file = open(path, "w")
        self._file.write("[\n")
        self._origin = time.perf_counter()
        self._rows = {}  # operation name -> its row (a trace "process" id)
        self._lock = threading.Lock()
        self._first = True

    def span(self, name: str, activity: str, start: float, finish: float) -> None:
        """Record `activity` of operation `name` from perf_counter time `start` to `finish`."""
        self._write({"name": activity, "ph": "X", "pid": self._row(name), "tid": 0,
                     "ts": self._microseconds(start), "dur": round(max(0.0, finish - start) * 1e6, 3)})

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.write("\n]\n")
                self._file.close()
                self._file = None

    def _microseconds(self, when: float) -> float:
        return round((when - self._origin) * 1e6, 3)

    def _row(self, name: str) -> int:
        row = self._rows.get(name)
        if row is None:
            row = self._rows[name] = len(self._rows) + 1
            self._write({"name": "process_name", "ph": "M", "pid": row, "args": {"name": name}})
            self._write({"name": "process_sort_index", "ph": "M", "pid": row, "args": {"sort_index": row}})
        return row

    def _write(self, event: dict) -> None:
        with self._lock:
            if self._file is None:
                return
            self._file.write(("" if self._first else ",\n") + json.dumps(event))
            self._first = False
            self._file.flush()
