"""The errors mpidist raises. Every one is a subclass of MpidistError.

The lowest floor of the package: it imports nothing, so every other module may raise these.
"""

__all__ = ["MpidistError", "NotInitializedError", "MPIUnavailableError", "LaunchMismatchError",
           "UnsupportedBufferError", "UnsupportedDtypeError", "NonContiguousError", "InvalidArgumentError",
           "MismatchError", "DeadlineError", "PeerExitedError", "CheckpointError", "RankDiedError", "NotOfferedError"]


class MpidistError(RuntimeError):
    """Base class of every error raised by mpidist."""


class NotInitializedError(MpidistError):
    """An mpidist function that needs MPI was called before ``mpidist.init()``."""


class MPIUnavailableError(MpidistError):
    """mpi4py or the MPI library behind it cannot be loaded."""


class LaunchMismatchError(MpidistError):
    """The launcher started another number of processes than MPI's world holds: each runs as a job
    of its own (srun without the MPI library's process-management interface, or the mpirun of
    another MPI library than mpi4py's)."""


class UnsupportedBufferError(MpidistError, TypeError):
    """The object is not an array kind mpidist can communicate (NumPy, torch, CuPy). Also a
    TypeError, the error Python gives an argument of the wrong type."""


class UnsupportedDtypeError(MpidistError):
    """The array's element type is not supported by the requested operation."""


class NonContiguousError(MpidistError):
    """The array is not contiguous in memory; collectives work on contiguous buffers."""


class InvalidArgumentError(MpidistError, ValueError):
    """An argument is wrong on this rank (unknown op or algorithm, bad root, size mismatch)."""


class MismatchError(MpidistError):
    """Ranks called the same collective with different counts, dtypes, ops or roots."""


class DeadlineError(MismatchError):
    """Another rank did not answer within MPIDIST_TIMEOUT seconds (it stopped, is stuck, or called
    something else: the ranks no longer run the same steps, hence a MismatchError). `peers`: the
    ranks waited for, on the communicator of the wait."""

    def __init__(self, message: str, peers=()):
        super().__init__(message)
        self.peers = tuple(peers)


class PeerExitedError(DeadlineError):
    """A rank's program ended (it returned, called sys.exit or raised an uncaught exception) while
    this rank waits for it in a collective it never entered: the wait can never complete, so it
    ends at once instead of at MPIDIST_TIMEOUT. `peers`: the ranks that ended, on the communicator of the wait."""


class CheckpointError(MpidistError):
    """A checkpoint cannot be written or read: an unsupported value, a file that is damaged, not
    a checkpoint or the state of another model or optimizer, or rank 0 failed to write it."""


class RankDiedError(MpidistError):
    """A rank died (the MPI library's fault tolerance, ULFM, reported it) and the work cannot go
    on without it. `ranks`: the dead ranks, on the communicator of the work."""

    def __init__(self, message: str, ranks=()):
        super().__init__(message)
        self.ranks = tuple(ranks)


class NotOfferedError(MpidistError):
    """A feature of a peer (Horovod, PyTorch) that mpidist does not offer."""
