"""The handles of hvd's asynchronous operations (what X_async returns and synchronize() waits
for): Handle wraps the collective's own handle with the result and its finishing step; DoneHandle
stands for an operation that completed in the call; GroupHandle for several waited together.
"""
from __future__ import annotations


class Handle:
    """An asynchronous operation in flight. `result` is the tensor (or list) it writes where the
    call knows it, else None: the operation makes it (allgather's rows come from every rank) and
    synchronize() takes what the collective's handle gives. Its finishing step (postscale_factor,
    the dtype back from the one the collective moved) takes that result and returns the final
    one; it runs once, however often synchronize() is called on it."""

    def __init__(self, handle, result=None, finish=None):
        self.handle, self.result, self.finish = handle, result, finish
        self.finished = False
        self.trace = None  # (name, activity, start) while the timeline waits for its end


class DoneHandle:
    """An operation that completed in the call (Adasum, alltoall); the handle only carries the result."""

    def __init__(self, result):
        self.result = result

    def done(self):
        return True

    def wait(self):
        return self.result


class GroupHandle:
    """Several asynchronous operations waited for together."""

    def __init__(self, handles):
        self.handles = handles

    def done(self):
        return all(handle.done() for handle in self.handles)

    def wait(self):
        """Every member's result; or, once every member has ended, the first member's error: no
        member is left in flight under the group's name when the caller may use it again."""
        results, error = [], None
        for handle in self.handles:
            try:
                results.append(handle.wait())
            except Exception as member_error:  # each member must end before the group raises
                error = error or member_error
        if error is not None:
            raise error
        return results

    @property
    def finished(self):
        """When the last of them completed (perf_counter), once all have."""
        times = [handle.finished for handle in self.handles]
        return max(times) if times and None not in times else None
