"""Training on uneven inputs (PyTorch's torch.distributed.algorithms.Join): Join runs its
Joinables' protocol, in which a rank that ran out of data shadows the others' steps until every
rank has; last_joiner finds the rank that trained longest.
"""
from __future__ import annotations

import numpy as np

from ..errors import InvalidArgumentError, MpidistError


class Joinable:
    """What Join asks of each model it runs (PyTorch's Joinable; DataParallel is one). The methods
    are collective: every rank calls them in the same order."""

    comm = None  # the Communicator the model's steps run on

    def _start_join(self, divide_by_initial_world_size: bool, throw_on_early_termination: bool) -> None:
        """Entering the Join block (raise to refuse it)."""
        raise NotImplementedError

    def _shadow_step(self) -> int:
        """Take part in the other ranks' next step as a rank without data; returns how many ranks
        brought data to it (0 once every rank has joined)."""
        raise NotImplementedError

    def _finish_join(self) -> None:
        """Once every rank has joined: agree on the model state to keep."""
        raise NotImplementedError

    def _end_join(self) -> None:
        """Leaving the Join block, normally or by an exception."""
        raise NotImplementedError


class Join:
    """PyTorch's `torch.distributed.algorithms.Join` for DataParallel models: `with
    md.Join([model_a, model_b]):` trains several models on uneven inputs, as each model's own
    join() does for one. A rank that leaves the block early shadows the others' steps of every
    model, in the order given (the order the training loop runs them), until every rank has left
    it. Keyword arguments (divide_by_initial_world_size) go to each model."""

    def __init__(self, joinables, enable: bool = True, throw_on_early_termination: bool = False, **kwargs):
        joinables = list(joinables)
        if not joinables or not all(isinstance(j, Joinable) for j in joinables):
            raise InvalidArgumentError(f"Join takes a non-empty list of mpidist.DataParallel models, got "
                                       f"{[type(j).__name__ for j in joinables]}")
        unknown = set(kwargs) - {"divide_by_initial_world_size"}
        if unknown:
            raise InvalidArgumentError(f"Join got unknown keyword arguments {sorted(unknown)}")
        self.joinables = joinables
        self.enable = bool(enable)
        self.throw = bool(throw_on_early_termination)
        self.divide_by_initial_world_size = bool(kwargs.get("divide_by_initial_world_size", True))

    def __enter__(self):
        if self.enable:
            started = []
            try:
                for joinable in self.joinables:
                    joinable._start_join(self.divide_by_initial_world_size, self.throw)
                    started.append(joinable)
            except BaseException:
                for joinable in started:
                    joinable._end_join()
                raise
        return self

    def __exit__(self, exc_type, exc, traceback):
        if not self.enable:
            return False
        try:
            if exc_type is None:
                self._join_the_others()
        finally:
            for joinable in self.joinables:
                joinable._end_join()
        return False

    def _join_the_others(self) -> None:
        while True:
            active = [joinable._shadow_step() for joinable in self.joinables]
            if not any(active):
                break
            if self.throw:
                raise MpidistError(f"rank {self.joinables[0].comm.rank} ran out of inputs before the others "
                                   "(throw_on_early_termination=True)")
        for joinable in self.joinables:
            joinable._finish_join()


def last_joiner(comm, exchanges_with_gradients: int) -> int:
    """The rank that brought gradients to the most exchanges (the highest of several): the one
    that ran out of data last. Collective."""
    key = np.array([exchanges_with_gradients * comm.size + comm.rank], dtype=np.int64)
    comm.allreduce(key, op="max")
    return int(key[0] % comm.size)
