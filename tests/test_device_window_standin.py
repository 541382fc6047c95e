"""The device window's own code (mpidist/collectives/device_window.py) on CPU, at 2 to 5 ranks of
one node: the collectives' entry points reached through the public calls, the decision the
local ranks take together once per channel, growth and free, and the refusals that send a
buffer the staged way, against float64 NumPy references.

Only what needs a GPU is stood in for, in host memory (HostGpu below):
- CuPy, as far as mpidist uses it: its arrays (a NumPy array that says which GPU it is on), its
  device contexts and current stream, and the CUDA runtime's cudaMalloc, cudaFree, cudaMemcpy
  (of the staged route), IPC handles and peer access. A "GPU allocation" is a file in /dev/shm mapped into the process; its IPC
  handle is the file's name, which a peer maps as cudaIpcOpenMemHandle maps another process's
  memory, so the slots are shared between the ranks as on a GPU.
- mpidist._C's CUDA kernels (pack, reduce_many_to, scale, synchronize): the CPU's, each held back until
  the stream is synchronized, as kernels wait in a stream, so that a round that read a peer's
  slot before the peer settled its writes would give wrong results here.
Everything else runs as on a GPU machine: missing() and can_open's exchange, DeviceWindows,
window_for, DeviceMemory and node_window.py's rounds. The GPU itself runs them in
`make gpu-check` (tests/gpu/).

The multi-rank tests of one world size run in one launch (mpi_shared_launch.py)."""
import contextlib
import ctypes
import itertools
import mmap
import os
import sys
import types

import numpy as np
import pytest
from mpi4py import MPI
from test_collectives import rank_values
from tolerances import reduction_bound, reduction_reference

import mpidist as md
from mpidist import _C, buffers
from mpidist.collectives import device_window, staging
from mpidist.collectives.common import split_counts
from mpidist.collectives.select import table_choice

pytestmark = pytest.mark.mpi_shared_launch

DTYPES = ["float32", "float16", "float64"]  # CuPy's float types (NumPy has no bfloat16)
OPS = ["sum", "avg", "min", "max", "prod"]
IPC_FLAG = 1  # cudaIpcMemLazyEnablePeerAccess


class HostArray:
    """A cupy.ndarray stand-in: `host`'s memory, said to be on GPU `device`."""

    def __init__(self, host: np.ndarray, device: int):
        self.host = np.ascontiguousarray(host)
        self.device = types.SimpleNamespace(id=device)
        self.dtype, self.size, self.shape, self.flags = self.host.dtype, self.host.size, self.host.shape, self.host.flags
        self.data = types.SimpleNamespace(ptr=self.host.ctypes.data)


class HostGpu:
    """CuPy (cupy, cupy.cuda, cupy.cuda.runtime) and mpidist._C's CUDA kernels, in host memory."""

    cudaIpcMemLazyEnablePeerAccess = IPC_FLAG

    def __init__(self, peer_access=True):
        self.peer_access = peer_access
        self.mapped = {}  # address -> (mmap, the ctypes view that gives the address, owned file or None)
        self.names = (f"/dev/shm/mpidist-standin-{os.getpid()}-{n}" for n in itertools.count())
        self.current = 0  # the device of the innermost Device context
        self.queued = []  # the stream's kernels, not yet run
        self.kernels = 0
        self.kernel_devices = set()
        self.ndarray = HostArray
        self.cuda = self.runtime = self

    def install(self, monkeypatch) -> None:
        for name in ("cupy", "cupy.cuda", "cupy.cuda.runtime"):
            monkeypatch.setitem(sys.modules, name, self)
        monkeypatch.setattr(_C, "built_with_cuda", True, raising=False)
        for name in ("cuda_pack", "cuda_reduce_many_to", "cuda_scale", "cuda_synchronize"):
            monkeypatch.setattr(_C, name, getattr(self, name), raising=False)

    # ---- CuPy's arrays, devices and streams
    def empty(self, shape, dtype):
        return HostArray(np.empty(shape, dtype=dtype), self.current)

    @contextlib.contextmanager
    def Device(self, index):  # noqa: N802 (CuPy's name)
        outer, self.current = self.current, int(index)
        try:
            yield
        finally:
            self.current = outer

    def get_current_stream(self):
        return types.SimpleNamespace(synchronize=lambda: None)  # the caller's stream has no work here

    # ---- the CUDA runtime
    def _map(self, path: str, create: int = 0) -> int:
        fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
        try:
            if create:
                os.ftruncate(fd, create)
            memory = mmap.mmap(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)
        view = ctypes.c_char.from_buffer(memory)
        address = ctypes.addressof(view)
        self.mapped[address] = (memory, view, path if create else None)
        return address

    def _unmap(self, address: int) -> None:
        memory, view, owned = self.mapped.pop(address)
        del view  # the mapping closes only once no view of it is left
        memory.close()
        if owned:
            os.unlink(owned)

    def malloc(self, nbytes):
        return self._map(next(self.names), create=nbytes)

    def free(self, address):
        assert self.mapped[address][2], "cudaFree of memory this process did not allocate"
        self._unmap(address)

    def ipcGetMemHandle(self, address):  # noqa: N802
        return self.mapped[address][2].encode().ljust(device_window.IPC_HANDLE_BYTES, b"\0")

    def ipcOpenMemHandle(self, handle, flags):  # noqa: N802
        assert flags == IPC_FLAG and len(handle) == device_window.IPC_HANDLE_BYTES
        return self._map(handle.rstrip(b"\0").decode())

    def ipcCloseMemHandle(self, address):  # noqa: N802
        assert not self.mapped[address][2], "cudaIpcCloseMemHandle of this process's own memory"
        self._unmap(address)

    def deviceCanAccessPeer(self, device, peer):  # noqa: N802
        return int(self.peer_access)

    memcpyHostToDevice, memcpyDeviceToHost = 1, 2  # noqa: N815 (CuPy's names)

    def memcpy(self, dst, src, nbytes, kind):
        self.cuda_synchronize(None, None)  # cudaMemcpy waits for the legacy default stream
        ctypes.memmove(dst, src, nbytes)

    # ---- mpidist._C's CUDA kernels: queued on the stream until it is synchronized
    def _queue(self, device, work) -> None:
        self.kernels += 1
        self.kernel_devices.add(device)
        self.queued.append(work)

    def cuda_pack(self, dst, srcs, nbytes, stream, device):
        self._queue(device, lambda: _C.pack(dst, srcs, nbytes))

    def cuda_reduce_many_to(self, dsts, srcs, count, dtype, op, scale, stream, device):
        self._queue(device, lambda: _C.reduce_many_to(dsts, srcs, count, dtype, op, scale))

    def cuda_scale(self, ptr, count, dtype, factor, stream, device):
        self._queue(device, lambda: _C.scale(ptr, count, dtype, factor))

    def cuda_synchronize(self, stream, device):
        queued, self.queued = self.queued, []
        for work in queued:
            work()


@pytest.fixture(name="gpu")
def host_gpu(monkeypatch):
    """The stand-in, installed, on a rank that could use the device window (and the GPU lane: the
    variables that force a route are cleared); every stand-in allocation given back by the end."""
    standin = HostGpu()
    standin.install(monkeypatch)
    for name in ("MPIDIST_DEVICE_WINDOW", "MPIDIST_RANKS_PER_NODE", "MPIDIST_ALLREDUCE_ALGORITHM", "MPIDIST_GPU_LANE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(_C, "cuda_max_sources", 8, raising=False)
    yield standin
    assert not standin.mapped, "memory still mapped after the communicator was freed"


@pytest.fixture
def comm(gpu):
    """A communicator of the test's own over the world (one node): freeing it frees its device
    window, so the stand-in can tell that every mapping was given back."""
    comm = md.Communicator(MPI.COMM_WORLD)
    yield comm
    comm.free()


def on_gpu(values, dtype, device=0):
    return HostArray(np.asarray(values).astype(dtype), device)


def assert_reduced(result, inputs, op, dtype, where, same_on_every_rank=True):
    error = np.abs(result.host.astype(np.float64) - reduction_reference(inputs, op))
    assert (error <= reduction_bound(inputs, op, dtype)).all(), f"{where}: error {error.max()}"
    if not same_on_every_rank:
        return
    everyone = MPI.COMM_WORLD.allgather(result.host.tobytes())
    assert all(b == everyone[0] for b in everyone), f"{where}: ranks differ"


def check_allreduce(comm, dtype, op, count, seed, device=0, algorithm="auto"):
    inputs = [rank_values(seed, k, count, dtype, op) for k in range(comm.size)]
    array = on_gpu(inputs[comm.rank], dtype, device)
    assert comm.allreduce(array, op=op, algorithm=algorithm) is array
    assert_reduced(array, inputs, op, dtype, f"allreduce {dtype} {op} n={count} p={comm.size}")


def check_reduce_scatter(comm, dtype, op, rows, seed):
    p, r = comm.size, comm.rank
    inputs = [rank_values(seed, k, rows * 3, dtype, op) for k in range(p)]
    array = on_gpu(inputs[r].reshape(rows, 3), dtype)
    before = array.host.tobytes()
    out = comm.reduce_scatter(array, op=op)
    assert array.host.tobytes() == before, "reduce_scatter changed its input"
    offset, mine = [(3 * o, 3 * c) for o, c in split_counts(rows, p)][r]
    assert out.shape == (mine // 3, 3) and out.device.id == 0
    out.host = out.host.reshape(-1)
    assert_reduced(out, [x[offset:offset + mine] for x in inputs], op, dtype,
                   f"reduce_scatter {dtype} {op} rows={rows} p={p}", same_on_every_rank=False)


def check_broadcast(comm, dtype, count, root, seed):
    inputs = [rank_values(seed, k, count, dtype, "sum") for k in range(comm.size)]
    array = on_gpu(inputs[comm.rank], dtype)
    comm.broadcast(array, root=root)
    assert array.host.tobytes() == inputs[root].astype(dtype).tobytes(), f"broadcast {dtype} n={count} from {root}"


def check_allgather(comm, dtype, rows, seed):
    inputs = [rank_values(seed, k, rows[k] * 2, dtype, "sum").reshape(rows[k], 2) for k in range(comm.size)]
    out = comm.allgather(on_gpu(inputs[comm.rank], dtype))
    assert out.device.id == 0
    assert out.host.tobytes() == np.concatenate(inputs).astype(dtype).tobytes(), f"allgather {dtype} rows {rows}"


def record_routes(comm, monkeypatch) -> tuple:
    """([count of each buffer staged to host memory], [each algorithm the staged route ran])."""
    staged, ran = [], []
    stage_in = comm.staging.stage_in

    def recorded_stage_in(array, info, slot=0):
        staged.append(info.count)
        return stage_in(array, info, slot)

    def recorded(name, algorithm):
        def run(ctx):
            ran.append(name)
            algorithm(ctx)
        return run
    monkeypatch.setattr(comm.staging, "stage_in", recorded_stage_in)
    monkeypatch.setattr(staging, "ALLREDUCE", {name: recorded(name, a) for name, a in staging.ALLREDUCE.items()})
    return staged, ran


def assert_in_the_window(comm, gpu, device=0):
    """The calls ran in the device window, on the rank's GPU: not the staged way."""
    windows = comm.device_window
    assert windows.refusal is None and windows.window.memory.device_index == device
    assert gpu.kernels and gpu.kernel_devices == {device} and not gpu.queued


@pytest.mark.mpi(ranks=[2, 3, 4, 5])
@pytest.mark.parametrize("dtype", DTYPES)
def test_allreduce(mpi_ranks, comm, gpu, dtype):
    """Every op; a small call then larger ones grow the window (its memory made and exported
    anew), smaller ones reuse it; with more than two ranks consecutive calls alternate halves."""
    capacities = []
    for seed, count in enumerate([5, 40001, 1, mpi_ranks - 1, 3000, 100003]):
        for op in OPS:
            check_allreduce(comm, dtype, op, count, seed)
        capacities.append(comm.device_window.window.capacity)
    assert capacities[0] < capacities[1] == capacities[4] < capacities[5]
    assert_in_the_window(comm, gpu)


@pytest.mark.mpi(ranks=[2, 3, 4, 5])
def test_every_collective_on_one_window(mpi_ranks, comm, gpu):
    """All four collectives back to back, with sizes that change and grow the window: none
    overwrites what another rank has still to read."""
    p = mpi_ranks
    for call, count in enumerate([7, 40001, 2, 9000, 3, 70001]):
        dtype = DTYPES[call % len(DTYPES)]
        op = OPS[call % len(OPS)]
        check_allreduce(comm, dtype, op, count, call)
        check_reduce_scatter(comm, dtype, op, count, call)
        check_broadcast(comm, dtype, count, call % p, call)
        check_allgather(comm, dtype, [(count + 11 * k) % 50000 for k in range(p)], call)
    assert_in_the_window(comm, gpu)


@pytest.mark.mpi(ranks=[2, 3, 5])
def test_each_rank_on_a_gpu_of_its_own(mpi_ranks, comm, gpu):
    """Local rank k's buffers on cuda:k: can_open asks for peer access between them, and each
    rank's window and kernels are on its own GPU."""
    for seed, count in enumerate([100, 30001]):
        check_allreduce(comm, "float32", "sum", count, seed, device=comm.rank)
    assert_in_the_window(comm, gpu, device=comm.rank)


def entry_points_refuse(channel, array) -> None:
    """Each entry point returns False, having done nothing: the caller takes the staged route."""
    info = buffers.describe(array)
    chunks = split_counts(info.count, channel.size)
    assert not device_window.allreduce(channel, array, info, "sum")
    assert not device_window.broadcast(channel, array, info, 0)
    assert not device_window.allgather(channel, array, info, array, chunks)
    assert not device_window.reduce_scatter(channel, array, info, array, chunks, "sum")


REFUSALS = {
    "no_peer_access": lambda rank, last: "has no peer access to cuda:",
    "too_many_ranks": lambda rank, last: "ranks on the node, more than the k-way kernel's",
    "one_rank_lacks_cupy": lambda rank, last: "cannot be imported" if rank == last else f"local ranks [{last}] cannot",
    "one_rank_switched_off": lambda rank, last: "MPIDIST_DEVICE_WINDOW=0" if rank == last else f"local ranks [{last}]",
    "kept_off": lambda rank, last: "a route of the test's",
}


@pytest.mark.mpi(ranks=[2, 3])
@pytest.mark.parametrize("refusal", REFUSALS)
def test_a_refusal_sends_every_rank_the_staged_way(mpi_ranks, comm, gpu, monkeypatch, refusal):
    """Where one local rank cannot use the window, or none can, no rank opens it (decided
    together, once per channel), each saying why, and no kernel runs."""
    last = mpi_ranks - 1
    if refusal == "no_peer_access":
        gpu.peer_access = False
    elif refusal == "too_many_ranks":
        monkeypatch.setattr(_C, "cuda_max_sources", mpi_ranks - 1)
    elif refusal == "one_rank_lacks_cupy" and comm.rank == last:
        monkeypatch.setitem(sys.modules, "cupy.cuda.runtime", None)  # the import fails there
    elif refusal == "one_rank_switched_off" and comm.rank == last:
        monkeypatch.setenv("MPIDIST_DEVICE_WINDOW", "0")
    elif refusal == "kept_off":
        device_window.keep_off(comm, "a route of the test's")
    for _ in range(2):  # the refusal is kept: the second call does not ask again
        entry_points_refuse(comm, on_gpu(np.ones(12), "float32", device=comm.rank))
    assert comm.device_window.window is None and REFUSALS[refusal](comm.rank, last) in comm.device_window.refusal
    assert gpu.kernels == 0 and not gpu.mapped


@pytest.mark.mpi(ranks=[2, 3])
@pytest.mark.parametrize("algorithm", ["auto", "hierarchical"])
def test_where_the_node_cannot_open_the_window_the_algorithm_runs_staged(mpi_ranks, comm, gpu, monkeypatch,
                                                                        algorithm):
    """Each rank on a GPU of its own, without peer access between them: the node refuses the
    window together, and the buffers go to a host copy, where "hierarchical" runs itself and
    `auto` its table's choice for the message."""
    gpu.peer_access = False
    staged, ran = record_routes(comm, monkeypatch)
    counts = (5, 100003)
    for seed, count in enumerate(counts):
        check_allreduce(comm, "float32", "sum", count, seed, device=comm.rank, algorithm=algorithm)
    assert "has no peer access" in comm.device_window.refusal and gpu.kernels == 0
    assert staged == list(counts)
    assert ran == [algorithm if algorithm != "auto" else
                   table_choice(comm, buffers.BufferInfo(0, count, "float32", f"cuda:{comm.rank}", "cupy"))
                   for count in counts]


@pytest.mark.mpi(ranks=[2])
def test_no_window_across_nodes_for_one_rank_or_for_a_cpu_buffer(mpi_ranks, gpu, monkeypatch):
    monkeypatch.setenv("MPIDIST_RANKS_PER_NODE", "1")  # every rank a node of its own
    with md.Communicator(MPI.COMM_WORLD) as spanning:
        entry_points_refuse(spanning, on_gpu(np.ones(4), "float32"))
        assert spanning.device_window.refusal == "the communicator spans nodes"
    monkeypatch.delenv("MPIDIST_RANKS_PER_NODE")
    with md.Communicator(MPI.COMM_SELF) as alone:
        entry_points_refuse(alone, on_gpu(np.ones(4), "float32"))
        assert alone.device_window.refusal == "one rank"
    with md.Communicator(MPI.COMM_WORLD) as node:
        entry_points_refuse(node, np.ones(4, dtype=np.float32))
        assert node.device_window is None  # a CPU buffer asks nothing of the window
    assert gpu.kernels == 0


COLLECTIVES = {
    "allreduce": lambda comm, array: comm.allreduce(array),
    "broadcast": lambda comm, array: comm.broadcast(array, root=0),
    "allgather": lambda comm, array: comm.allgather(array),
    "reduce_scatter": lambda comm, array: comm.reduce_scatter(array),
}


@pytest.mark.mpi(ranks=[2, 3])
@pytest.mark.parametrize("collective", COLLECTIVES)
def test_a_buffer_on_another_gpu_is_an_error_on_every_rank(mpi_ranks, comm, gpu, monkeypatch, collective):
    """The window is on cuda:0 on every rank; then the last rank passes a buffer on cuda:1. It
    refuses it before the call check, which shares the refusal, so every rank raises at once,
    naming it (the others had gone on into the window and waited for it there until
    MPIDIST_TIMEOUT). Nobody entered the window: the communicator works on."""
    last = mpi_ranks - 1
    check_allreduce(comm, "float32", "sum", 1000, seed=1)
    monkeypatch.setenv("MPIDIST_TIMEOUT", "5")  # so that a regression ends as a DeadlineError
    array = on_gpu(np.ones(1000), "float32", device=1 if comm.rank == last else 0)
    if comm.rank == last:
        expected = md.InvalidArgumentError, rf"rank {last}'s buffer is on cuda:1, this communicator's device " \
                                             r"window on that rank on cuda:0: a rank's GPU buffers must all be on one GPU"
    else:
        expected = md.MismatchError, rf"ranks \[{last}\] refused their arguments to this collective"
    with pytest.raises(expected[0], match=expected[1]):
        COLLECTIVES[collective](comm, array)
    monkeypatch.delenv("MPIDIST_TIMEOUT")
    check_allreduce(comm, "float32", "sum", 3000, seed=2)
    assert_in_the_window(comm, gpu)
