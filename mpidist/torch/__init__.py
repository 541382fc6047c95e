"""Horovod-compatible namespace: change `import horovod.torch as hvd` to
`import mpidist.torch as hvd` and a Horovod PyTorch script runs on mpidist's collectives.

Laid out as Horovod's horovod/torch: basics (init, ranks, reduction ops), process_sets, mpi_ops
(the collective operations, handles, synchronize; its all-reduces in reductions), compression,
functions (broadcast of parameters, optimizer state and objects), optimizer
(DistributedOptimizer), join (hvd.join) and timeline. This module only re-exports their public names.

Differences from Horovod are listed in README.md ("Horovod compatibility"); features that are
not offered raise NotOfferedError instead of misbehaving. elastic is Horovod's elastic API on
md.elastic (parallel/elastic_training.py). Horovod's exception
names map onto mpidist's errors (basics.py; docs/horovod.md).
"""
from ..errors import InvalidArgumentError, MismatchError, MpidistError, NotOfferedError
from ..parallel.sync_batchnorm import SyncBatchNorm
from . import elastic
from .basics import (
                     Adasum,
                     Average,
                     HorovodInternalError,
                     HorovodVersionMismatchError,
                     HostsUpdatedInterrupt,
                     Max,
                     Min,
                     Product,
                     Sum,
                     ccl_built,
                     cross_rank,
                     cross_size,
                     cuda_built,
                     ddl_built,
                     gloo_built,
                     gloo_enabled,
                     init,
                     is_homogeneous,
                     is_initialized,
                     local_rank,
                     local_size,
                     mpi_built,
                     mpi_enabled,
                     mpi_threads_supported,
                     nccl_built,
                     rank,
                     rocm_built,
                     shutdown,
                     size,
)
from .compression import Compression
from .functions import allgather_object, broadcast_object, broadcast_optimizer_state, broadcast_parameters
from .join import join
from .mpi_ops import (
                     allgather,
                     allgather_async,
                     alltoall,
                     alltoall_async,
                     barrier,
                     broadcast,
                     broadcast_,
                     broadcast_async,
                     broadcast_async_,
                     grouped_allgather,
                     grouped_allgather_async,
                     grouped_reducescatter,
                     grouped_reducescatter_async,
                     poll,
                     reducescatter,
                     reducescatter_async,
                     sparse_allreduce_async,
                     synchronize,
)
from .optimizer import DistributedOptimizer
from .process_sets import ProcessSet, add_process_set, global_process_set, remove_process_set
from .reductions import (
                     allreduce,
                     allreduce_,
                     allreduce_async,
                     allreduce_async_,
                     grouped_allreduce,
                     grouped_allreduce_,
                     grouped_allreduce_async,
                     grouped_allreduce_async_,
)
from .timeline import start_timeline, stop_timeline

__all__ = [
    # basics
    "init", "shutdown", "is_initialized", "size", "rank", "local_size", "local_rank", "cross_size", "cross_rank",
    "is_homogeneous", "mpi_enabled", "mpi_built", "mpi_threads_supported", "gloo_enabled", "gloo_built",
    "nccl_built", "ddl_built", "ccl_built", "rocm_built", "cuda_built", "elastic",
    "Average", "Sum", "Min", "Max", "Product", "Adasum",
    # process sets
    "ProcessSet", "global_process_set", "add_process_set", "remove_process_set",
    # operations
    "allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "sparse_allreduce_async",
    "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_",
    "allgather", "allgather_async", "grouped_allgather", "grouped_allgather_async",
    "broadcast", "broadcast_", "broadcast_async", "broadcast_async_",
    "alltoall", "alltoall_async",
    "reducescatter", "reducescatter_async", "grouped_reducescatter", "grouped_reducescatter_async",
    "barrier", "poll", "synchronize", "join",
    # functions, compression, optimizer, layers
    "broadcast_parameters", "broadcast_optimizer_state", "broadcast_object", "allgather_object",
    "Compression", "DistributedOptimizer", "SyncBatchNorm",
    # timeline
    "start_timeline", "stop_timeline",
    # errors
    "MpidistError", "InvalidArgumentError", "MismatchError", "NotOfferedError",
    "HorovodInternalError", "HostsUpdatedInterrupt", "HorovodVersionMismatchError",
]
