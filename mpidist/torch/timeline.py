"""hvd's face of the timeline (Horovod's HOROVOD_TIMELINE, start_timeline and stop_timeline):
hvd's collective operations written in Chrome's trace event format (open it in chrome://tracing
or https://ui.perfetto.dev) by the timeline of runtime/tracing.py, which also records mpidist's
own collectives and gradient buckets; and `traced`, the decorator that records each operation.

Each operation name (a tensor's `name=`, or a gradient bucket) gets a row of its own, as in
Horovod's timeline, and each operation a span on it: its activity (ALLREDUCE, BROADCAST, ...)
from the call to its completion as this rank saw them; the collectives an operation runs are not
rows of their own. As in Horovod, rank 0 writes the timeline. Every operation carries `traced`,
so it also has each call's arguments checked first (arguments.py).
"""
from __future__ import annotations

import collections
import functools
import inspect
import time

from .. import comm as _comm
from ..runtime import config, tracing
from ..runtime.tracing import current
from . import arguments
from .handles import DoneHandle, Handle

__all__ = ["current", "end_traced", "start_from_environment", "start_timeline", "stop_timeline", "traced"]

_unnamed = collections.Counter()  # activity -> operations recorded without a name
_variable_read = False  # HOROVOD_TIMELINE is read by the first hvd.init()


def start_timeline(file_path, mark_cycles=False):
    """Record the collective operations in `file_path` (Chrome's trace format), replacing any
    timeline being written. As in Horovod, rank 0 writes it (every rank may call this). mpidist
    has no negotiation cycles, so mark_cycles adds nothing."""
    tracing.stop_timeline()
    if _comm.world().rank == 0:
        tracing.start_timeline(file_path)


def stop_timeline():
    """Finish the timeline file (also done at exit)."""
    tracing.stop_timeline()


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
            if current() is None or tracing.inside_span():
                result = function(*args, **kwargs)
                arguments.hold_name(name, result)
                return result
            if name is None:
                _unnamed[activity] += 1
                name = f"{activity.lower()}.noname.{_unnamed[activity]}"
            start = time.perf_counter()
            # The span marks the collectives inside as this operation's (they stay off the
            # timeline); it is written here, or by end_traced once an asynchronous one completes.
            with tracing.span(str(name), activity, on_timeline=False):
                result = function(*args, **kwargs)
            timeline = current()
            if isinstance(result, Handle) and not isinstance(result.handle, DoneHandle):
                result.trace = (str(name), activity, start)
            elif timeline is not None:
                timeline.span(str(name), activity, start, time.perf_counter())
            arguments.hold_name(bound.get("name"), result)
            return result
        return traced_call
    return decorate


def end_traced(handle: Handle) -> None:
    """End the span of the asynchronous operation `handle`, which synchronize() has seen complete."""
    timeline = current()
    if handle.trace is not None and timeline is not None:
        name, activity, start = handle.trace
        finished = getattr(handle.handle, "finished", None)  # when the engine completed it
        timeline.span(name, activity, start, finished or time.perf_counter())
    handle.trace = None
