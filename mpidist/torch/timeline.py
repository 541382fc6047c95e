"""The timeline (Horovod's HOROVOD_TIMELINE, start_timeline and stop_timeline): hvd's
collective operations written in Chrome's trace event format (open it in chrome://tracing or
https://ui.perfetto.dev), and `traced`, the decorator that records each operation.

Each operation name (a tensor's `name=`, or a gradient bucket) gets a row of its own, as in
Horovod's timeline, and each operation a span on it: its activity (ALLREDUCE, BROADCAST, ...)
from the call to its completion as this rank saw them. Events are written as they happen, so a
run that dies keeps what it had recorded; close() ends the JSON array. As in Horovod, rank 0
writes the timeline. Every operation carries `traced`, so it also has each call's arguments
checked first (arguments.py).
"""
from __future__ import annotations

import atexit
import collections
import functools
import inspect
import json
import threading
import time

from .. import comm as _comm
from ..runtime import config
from . import arguments
from .handles import DoneHandle, Handle


class Timeline:
    """One trace file, each event written as it happens."""

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


_timeline = None  # the Timeline this process writes, if any
_tracing = threading.local()  # .inside: a traced operation is running (its inner ones are not recorded)
_unnamed = collections.Counter()  # activity -> operations recorded without a name
_variable_read = False  # HOROVOD_TIMELINE is read by the first hvd.init()


def current() -> Timeline | None:
    """The timeline being written, if any."""
    return _timeline


def start_timeline(file_path, mark_cycles=False):
    """Record the collective operations in `file_path` (Chrome's trace format), replacing any
    timeline being written. As in Horovod, rank 0 writes it (every rank may call this). mpidist
    has no negotiation cycles, so mark_cycles adds nothing."""
    stop_timeline()
    if _comm.world().rank == 0:
        global _timeline
        _timeline = Timeline(str(file_path))


def stop_timeline():
    """Finish the timeline file (also done at exit)."""
    global _timeline
    if _timeline is not None:
        _timeline.close()
        _timeline = None


atexit.register(stop_timeline)


def start_from_environment() -> None:
    """Start the timeline HOROVOD_TIMELINE names, at the first hvd.init() only: a later init()
    must not restart a stopped timeline."""
    global _variable_read
    if not _variable_read:
        _variable_read = True
        path = config.value("HOROVOD_TIMELINE")
        if path and path != "DYNAMIC":  # DYNAMIC: started later by start_timeline()
            start_timeline(path)


def traced(activity):
    """Record each call as a span of `activity` on the row of its `name=` (or a new
    "<activity>.noname.<n>" row); an asynchronous call's span ends when synchronize() sees it done
    (end_traced). Before the call, its arguments are checked (arguments.check_call); after it,
    an asynchronous operation's name is held until synchronize()."""
    def decorate(function):
        signature = inspect.signature(function)

        @functools.wraps(function)
        def traced_call(*args, **kwargs):
            bound = signature.bind(*args, **kwargs).arguments
            arguments.check_call(function.__name__, bound)
            name = bound.get("name")
            if _timeline is None or getattr(_tracing, "inside", False):
                result = function(*args, **kwargs)
                arguments.hold_name(name, result)
                return result
            if name is None:
                _unnamed[activity] += 1
                name = f"{activity.lower()}.noname.{_unnamed[activity]}"
            _tracing.inside = True
            start = time.perf_counter()
            try:
                result = function(*args, **kwargs)
            finally:
                _tracing.inside = False
            if isinstance(result, Handle) and not isinstance(result.handle, DoneHandle):
                result.trace = (str(name), activity, start)
            elif _timeline is not None:
                _timeline.span(str(name), activity, start, time.perf_counter())
            arguments.hold_name(bound.get("name"), result)
            return result
        return traced_call
    return decorate


def end_traced(handle: Handle) -> None:
    """End the span of the asynchronous operation `handle`, which synchronize() has seen complete."""
    if handle.trace is not None and _timeline is not None:
        name, activity, start = handle.trace
        finished = getattr(handle.handle, "finished", None)  # when the engine completed it
        _timeline.span(name, activity, start, finished or time.perf_counter())
    handle.trace = None
