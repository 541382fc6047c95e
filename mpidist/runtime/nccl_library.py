"""NCCL's library: which libnccl mpidist loads, whether it will do, and the few C functions its
NCCL paths call (algorithm="nccl", collectives/nccl.py; the NCCL lane between nodes,
collectives/gpu_lane.py).

Which library: MPIDIST_NCCL_LIBRARY's file where it is set (a build of `make nccl`, a cluster's
own), else the one of the nvidia-nccl wheel beside torch and CuPy, else whatever `libnccl.so.2`
the dynamic loader finds. It must be NCCL (it exports ncclGetVersion) of at least 2.30: two
ranks on one GPU, as `make gpu-check` runs them, need NCCL_MULTI_RANK_GPU_ENABLE=1, which older
NCCL refuses. problem() says why a library will not do; the NCCL paths refuse with that reason,
on every rank.

How: a ctypes binding of the seven functions used, loaded from the path chosen. CuPy's binding
(cupy.cuda.nccl) links `libnccl.so.2` when it is imported, wherever the loader finds it, so a path
of one's own is honoured only if it was loaded first under that name; NVIDIA's nccl4py finds the
library through cuda-pathfinder's own search and brings cuda-core and cuda-bindings with it, three
more packages to carry to a GPU machine for the same seven calls. The binding keeps CuPy's names
(get_unique_id, NcclCommunicator, allReduce, the NCCL_* constants) so the callers read as before.
This module loads no CUDA and never starts MPI; the caller makes the GPU current.
"""
from __future__ import annotations

import ctypes
import functools
import glob
import os
import sys

from ..errors import InvalidArgumentError
from . import config

MINIMUM_VERSION = 23000  # NCCL 2.30.0 (NCCL_VERSION_CODE: major * 10000 + minor * 100 + patch)
SONAME = "libnccl.so.2"
UNIQUE_ID_BYTES = 128  # NCCL_UNIQUE_ID_BYTES

# nccl.h's ncclDataType_t and ncclRedOp_t, under CuPy's names.
NCCL_INT8, NCCL_UINT8, NCCL_INT32, NCCL_INT64 = 0, 1, 2, 4
NCCL_FLOAT16, NCCL_FLOAT32, NCCL_FLOAT64, NCCL_BFLOAT16 = 6, 7, 8, 9
NCCL_SUM, NCCL_PROD, NCCL_MAX, NCCL_MIN = 0, 1, 2, 3


class UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * UNIQUE_ID_BYTES)]


def version_text(code: int) -> str:
    """23007 -> '2.30.7'."""
    return f"{code // 10000}.{code // 100 % 100}.{code % 100}"


def wheel_library() -> str | None:
    """The libnccl of the nvidia-nccl wheel (torch's CUDA wheels depend on it), if installed."""
    for folder in sys.path:
        found = sorted(glob.glob(os.path.join(folder, "nvidia", "nccl", "lib", SONAME)))
        if found:
            return found[0]
    return None


def wanted_path() -> tuple:
    """(what to load, where that choice came from)."""
    given = config.value("MPIDIST_NCCL_LIBRARY")
    if given:
        return given, "MPIDIST_NCCL_LIBRARY"
    wheel = wheel_library()
    if wheel:
        return wheel, "the nvidia-nccl wheel"
    return SONAME, "the dynamic loader's search"


def loaded_path(handle: ctypes.CDLL, name: str) -> str:
    """Where the loader found `name` (a soname is resolved through /proc/self/maps)."""
    if os.sep in name:
        return os.path.realpath(name)
    base = os.path.basename(name).split(".so")[0] + ".so"
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1]
                if os.path.basename(path).startswith(base):
                    return path
    except OSError:  # no /proc: the name is all there is to report
        pass
    return name


class NcclLibrary:
    """One loaded libnccl: its path, its version and the functions the NCCL paths call."""

    def __init__(self, handle: ctypes.CDLL, path: str, version: int):
        self.handle, self.path, self.version = handle, path, version
        for name, argtypes in (("ncclGetUniqueId", [ctypes.POINTER(UniqueId)]),
                               ("ncclCommInitRank", [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, UniqueId,
                                                     ctypes.c_int]),
                               ("ncclAllReduce", [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                                  ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]),
                               ("ncclCommDestroy", [ctypes.c_void_p])):
            function = getattr(handle, name)
            function.argtypes, function.restype = argtypes, ctypes.c_int
        handle.ncclGetErrorString.argtypes, handle.ncclGetErrorString.restype = [ctypes.c_int], ctypes.c_char_p

    def check(self, result: int, what: str) -> None:
        if result != 0:
            reason = self.handle.ncclGetErrorString(result).decode(errors="replace")
            raise RuntimeError(f"{what} failed: NCCL error {result} ({reason})")

    def get_unique_id(self) -> bytes:
        unique_id = UniqueId()
        self.check(self.handle.ncclGetUniqueId(ctypes.byref(unique_id)), "ncclGetUniqueId")
        return ctypes.string_at(ctypes.addressof(unique_id), UNIQUE_ID_BYTES)

    def NcclCommunicator(self, size: int, unique_id: bytes, rank: int) -> NcclCommunicator:  # noqa: N802 (CuPy's name)
        return NcclCommunicator(self, size, unique_id, rank)


class NcclCommunicator:
    """An NCCL communicator of `size` ranks (ncclCommInitRank on the current GPU), CuPy's face."""

    def __init__(self, library: NcclLibrary, size: int, unique_id: bytes, rank: int):
        self.library, self.comm = library, ctypes.c_void_p()
        id_struct = UniqueId.from_buffer_copy(bytes(unique_id).ljust(UNIQUE_ID_BYTES, b"\0"))
        library.check(library.handle.ncclCommInitRank(ctypes.byref(self.comm), size, id_struct, rank),
                      "ncclCommInitRank")

    def allReduce(self, send: int, recv: int, count: int, dtype: int, op: int, stream: int) -> None:  # noqa: N802
        self.library.check(self.library.handle.ncclAllReduce(send, recv, count, dtype, op, self.comm, stream or None),
                           "ncclAllReduce")

    def destroy(self) -> None:
        if self.comm:
            self.library.handle.ncclCommDestroy(self.comm)
            self.comm = ctypes.c_void_p()


def open_library(name: str) -> NcclLibrary:
    """Load `name` and check it is NCCL of at least MINIMUM_VERSION; InvalidArgumentError says why not."""
    if os.sep in name and not os.path.isfile(name):
        raise InvalidArgumentError(f"the NCCL library {name} does not exist")
    try:
        handle = ctypes.CDLL(name)
    except OSError as error:
        raise InvalidArgumentError(f"the NCCL library {name} cannot be loaded ({error})") from None
    path = loaded_path(handle, name)
    get_version = getattr(handle, "ncclGetVersion", None)
    if get_version is None:
        raise InvalidArgumentError(f"{path} is not NCCL: it has no ncclGetVersion")
    code = ctypes.c_int(0)
    get_version.argtypes, get_version.restype = [ctypes.POINTER(ctypes.c_int)], ctypes.c_int
    if get_version(ctypes.byref(code)) != 0 or code.value < MINIMUM_VERSION:
        raise InvalidArgumentError(f"{path} is NCCL {version_text(code.value)}; mpidist needs NCCL "
                                   f"{version_text(MINIMUM_VERSION)} or newer")
    missing = [name for name in ("ncclGetUniqueId", "ncclCommInitRank", "ncclAllReduce", "ncclCommDestroy",
                                 "ncclGetErrorString") if not hasattr(handle, name)]
    if missing:
        raise InvalidArgumentError(f"{path} (NCCL {version_text(code.value)}) lacks {', '.join(missing)}")
    return NcclLibrary(handle, path, code.value)


@functools.lru_cache(maxsize=None)
def _load(name: str):
    """The NcclLibrary of `name`, or the InvalidArgumentError saying why not (kept, not raised,
    so a refusal is as cheap as a success the second time)."""
    try:
        return open_library(name)
    except InvalidArgumentError as error:
        return error


def load() -> NcclLibrary:
    """The NCCL library this process uses (wanted_path()); InvalidArgumentError says why there is none."""
    name, origin = wanted_path()
    found = _load(name)
    if isinstance(found, InvalidArgumentError):
        raise InvalidArgumentError(f"{found} (chosen by {origin})")
    return found


def problem() -> str | None:
    """Why this process has no usable NCCL, or None."""
    try:
        load()
    except InvalidArgumentError as error:
        return str(error)
    return None


def describe() -> str:
    """For `mpidist info`: the NCCL found (its path and version), or why none."""
    try:
        library = load()
    except InvalidArgumentError as error:
        return f"none: {error}"
    return f"{version_text(library.version)} ({library.path})"
