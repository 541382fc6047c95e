"""Communication events for the tools that trace a run: each collective, and each gradient
bucket's all-reduce, is a span in torch.profiler's trace (torch.profiler.record_function) while
a profiler records, and a span on the timeline (Timeline: Chrome's trace event format, Horovod's
timeline) while one is written, started by MPIDIST_TIMELINE or HOROVOD_TIMELINE at md.init(), or
by hvd.start_timeline.

Outside both a call costs one check (recording): record_function opens an event even when no
profiler records, which costs microseconds, more than a small all-reduce, so it is opened only
while one does. A span inside another (an hvd operation, then the collective it runs) is one
event on the timeline, the outer one's, and one of each in the profiler's trace.
"""
from __future__ import annotations

import atexit
import contextlib
import functools
import json
import sys
import threading
import time


class Timeline:
    """One trace file, each event written as it happens: a run that dies keeps what it had
    recorded; close() ends the JSON array. Each row (a trace "process") is one operation name."""

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
_spans = threading.local()  # .inside: a span is open on this thread (inner ones stay off the timeline)


def current() -> Timeline | None:
    """The timeline being written, if any."""
    return _timeline


def start_timeline(path) -> None:
    """Write the timeline to `path` from now on, replacing any timeline being written."""
    global _timeline
    stop_timeline()
    _timeline = Timeline(str(path))


def stop_timeline() -> None:
    """Finish the timeline file (also done at exit)."""
    global _timeline
    if _timeline is not None:
        _timeline.close()
        _timeline = None


atexit.register(stop_timeline)


_profiler_enabled = None  # torch's own check, once torch is imported (never imported here)


def profiling() -> bool:
    """Whether a torch profiler records."""
    global _profiler_enabled
    if _profiler_enabled is None:
        autograd = getattr(sys.modules.get("torch"), "autograd", None)
        if autograd is None:
            return False
        _profiler_enabled = autograd._profiler_enabled
    return _profiler_enabled()


def recording() -> bool:
    """Whether spans go anywhere: a timeline is written or a torch profiler records."""
    return _timeline is not None or profiling()


def inside_span() -> bool:
    """Whether a span is open on this thread."""
    return getattr(_spans, "inside", False)


@contextlib.contextmanager
def continuing(inside: bool):
    """Run the body as inside a span when `inside`: work another thread runs for an operation
    that was inside one (an hvd operation's collective, run on the asynchronous engine)."""
    outer = inside_span()
    _spans.inside = inside or outer
    try:
        yield
    finally:
        _spans.inside = outer


@contextlib.contextmanager
def span(row: str, activity: str, on_timeline: bool = True):
    """An event named `row` in the torch profiler's trace, and (with `on_timeline`, unless inside
    another span) a span of `activity` on the timeline's row `row`, around the body of the with
    statement."""
    outer = inside_span()
    _spans.inside = True
    start = time.perf_counter()
    try:
        if profiling():
            with sys.modules["torch"].profiler.record_function(row):
                yield
        else:
            yield
    finally:
        _spans.inside = outer
        timeline = _timeline
        if timeline is not None and on_timeline and not outer:
            timeline.span(row, activity, start, time.perf_counter())


def traced(row: str, activity: str):
    """Decorate a function so each call is a span (see span) while recording(); otherwise the
    call costs one check."""
    def decorate(function):
        @functools.wraps(function)
        def traced_call(*args, **kwargs):
            if not recording():
                return function(*args, **kwargs)
            with span(row, activity):
                return function(*args, **kwargs)
        return traced_call
    return decorate
