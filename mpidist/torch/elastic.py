"""Horovod's elastic API (horovod.torch.elastic) on md.elastic (parallel/elastic_training.py): the
decorator run, TorchState and ElasticSampler.

    @hvd.elastic.run
    def train(state): ...
    state = hvd.elastic.TorchState(model, optimizer, train_sampler=sampler, epoch=0, batch=0)
    train(state)

As in Horovod, state.commit() remembers the state, a rank death sends every survivor back to
its last commit, and the reset callbacks run before training resumes. Differences: ranks only
leave (an MPI job cannot grow), and process sets other than the global one are dropped at a
death (their ranks changed): register them again in a reset callback.
"""
from __future__ import annotations

import functools

from ..parallel import elastic_training as _elastic
from ..parallel.elastic_training import ElasticSampler
from .process_sets import drop_process_sets

__all__ = ["run", "State", "TorchState", "ElasticSampler"]


def run(func):
    """Decorate train(state, *args, **kwargs) so that it goes on after a rank dies (Horovod's
    hvd.elastic.run): the state is synchronized from rank 0 first and after each recovery."""
    @functools.wraps(func)
    def wrapper(state, *args, **kwargs):
        return _elastic.run_elastic(func, state, args, kwargs, on_shrink=drop_process_sets)

    return wrapper


State = _elastic.State


class TorchState(_elastic.State):
    """Horovod's TorchState(model, optimizer, **kwargs): the model's and optimizer's state, the
    ElasticSamplers among the keyword arguments (by their state_dict), and the other keyword
    arguments as values (epoch=0, batch=0), each an attribute of the state."""

    def __init__(self, model=None, optimizer=None, **kwargs):
        super().__init__(model=model, optimizer=optimizer, **kwargs)
