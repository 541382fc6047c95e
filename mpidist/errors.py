"""The errors mpidist raises. Every one is a subclass of MpidistError."""


class MpidistError(RuntimeError):
    """Base class of every error raised by mpidist."""


class NotInitializedError(MpidistError):
    """An mpidist function that needs MPI was called before ``mpidist.init()``."""


class MPIUnavailableError(MpidistError):
    """mpi4py or the MPI library behind it cannot be loaded."""


class UnsupportedBufferError(MpidistError):
    """The object is not an array kind mpidist can communicate (NumPy, torch, CuPy)."""


class UnsupportedDtypeError(MpidistError):
    """The array's element type is not supported by the requested operation."""


class NonContiguousError(MpidistError):
    """The array is not contiguous in memory; collectives work on contiguous buffers."""


class InvalidArgumentError(MpidistError, ValueError):
    """An argument is wrong on this rank (unknown op or algorithm, bad root, size mismatch)."""


class MismatchError(MpidistError):
    """Ranks called the same collective with different counts, dtypes, ops or roots."""


class DeadlineError(MpidistError):
    """Another rank did not answer within MPIDIST_TIMEOUT seconds (it stopped, or is stuck)."""


class NotOfferedError(MpidistError):
    """A feature of a peer (Horovod, PyTorch) that mpidist does not offer."""
