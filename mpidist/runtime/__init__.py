"""The runtime floor: what every other part of mpidist stands on, none of which initializes MPI.

- mpi.py: loading mpi4py's MPI module, and the settings that must precede MPI's start.
- config.py: every MPIDIST_* environment variable, read in one place, each with its default and meaning.
- deadlines.py: the one helper every wait for another rank goes through, and its error.
- stall.py: the stall report of a collective wait, from the records every rank publishes.
- abort.py: an uncaught exception on one rank aborts the whole job.
- tracing.py: communication events for torch.profiler and the timeline file.
- wire.py: the dtype table of the whole package, and typed header+payload messages between ranks.
- together.py: raise_together, the one way for ranks to fail together (every rank raises the same error).
- leave.py: MPI_Finalize with a time limit, for a fault-tolerant run in which a rank died.
- losses.py: what a fault-tolerant job lost to a rank's death, summed up at its end.
- cuda_aware.py: whether the MPI library reads GPU memory (its own answer, and a probe).
- nccl_library.py: which NCCL library mpidist loads, whether it will do, and its few C functions.

Importing any of these leaves MPI alone (mpi4py.MPI is not imported), so `import mpidist` can
happen before the program, or its launcher, has settled how MPI should start.
"""
