"""The CPU side of the device window and of algorithm="nccl" (device_window.py, nccl.py): which
route `auto` and the other algorithms send CUDA buffers on (routes.py), why a rank cannot use the
device window, and NCCL's refusals. The GPU side runs in `make gpu-check` (tests/gpu/)."""
import types

import numpy as np
import pytest

import mpidist as md
from mpidist.buffers import BufferInfo
from mpidist.cli import bench, bench_bound, bench_device, command
from mpidist.collectives import device_window, nccl
from mpidist.collectives.callcheck import resolve_algorithm
from mpidist.collectives.routes import ROUTES, route_for
from mpidist.collectives.select import choose_allreduce

pytestmark = pytest.mark.mpi_shared_launch

CUDA_BUFFER = BufferInfo(0, 1 << 20, "float32", "cuda:0", "torch")
CPU_BUFFER = BufferInfo(0, 1 << 20, "float32", "cpu", "torch")


def channel(num_nodes=1, size=4, forced=None):
    return types.SimpleNamespace(num_nodes=num_nodes, size=size, forced_algorithm=forced, tuning_table=None)


def table_choice(info, comm):
    return choose_allreduce(info.nbytes, comm.size, comm.tuning_table, info.dtype, comm.forced_algorithm,
                            comm.num_nodes)


@pytest.mark.parametrize("nodes", [1, 2, 3])
def test_auto_sends_cuda_buffers_to_the_device_route(nodes):
    """On one node and across nodes alike: the route decides with the other ranks whether the
    buffer stays in GPU memory, so "auto" is what the call check compares."""
    assert resolve_algorithm("auto", CUDA_BUFFER, channel(num_nodes=nodes)) == "auto"
    assert route_for(CUDA_BUFFER, "auto") is ROUTES["device"]


def test_auto_sends_cuda_buffers_to_the_device_route_where_this_rank_lacks_the_window():
    """Here: torch is the CPU build and the extension has no CUDA, so missing() says why. The
    ranks still decide together (device_window.can_open, gpu_lane.agreed_lane), so that one rank
    without it cannot make the ranks' choices differ; the route stages with the table's choice."""
    reason = device_window.missing()
    assert reason and ("without CUDA" in reason or "CuPy" in reason)
    assert resolve_algorithm("auto", CUDA_BUFFER, channel()) == "auto"


@pytest.mark.parametrize("comm,info", [(channel(size=1), CUDA_BUFFER), (channel(), CPU_BUFFER),
                                       (channel(num_nodes=2), CPU_BUFFER), (channel(forced="ring"), CUDA_BUFFER)],
                         ids=["one_rank", "cpu_buffer", "cpu_buffer_two_nodes", "forced_ring"])
def test_auto_keeps_its_table_elsewhere(comm, info):
    assert resolve_algorithm("auto", info, comm) == table_choice(info, comm)


@pytest.mark.parametrize("algorithm,route", [("hierarchical", "device"), ("auto", "device"), (None, "device"),
                                             ("ring", "staged"), ("mpi", "staged"), ("nccl", "staged")])
def test_the_route_of_a_cuda_buffer(algorithm, route):
    """None: broadcast, allgather and reduce-scatter. "nccl" works on GPU memory in place, which
    the staged route does for it."""
    assert route_for(CUDA_BUFFER, algorithm) is ROUTES[route]


@pytest.mark.parametrize("algorithm", [None, "auto", *md.collectives.ALLREDUCE])
def test_a_cpu_buffer_takes_the_staged_route(algorithm):
    assert route_for(CPU_BUFFER, algorithm) is ROUTES["staged"]


def test_device_window_switched_off(monkeypatch):
    monkeypatch.setenv("MPIDIST_DEVICE_WINDOW", "0")
    assert device_window.missing() == "MPIDIST_DEVICE_WINDOW=0"


def test_nccl_refuses_a_cpu_buffer():
    with pytest.raises(md.InvalidArgumentError, match="algorithm='nccl' reduces GPU buffers only; this buffer is on cpu"):
        resolve_algorithm("nccl", CPU_BUFFER, channel())


def test_nccl_refuses_where_there_is_no_nccl(monkeypatch):
    monkeypatch.setenv("MPIDIST_NCCL_LIBRARY", "/nonexistent/libnccl.so.2")
    with pytest.raises(md.InvalidArgumentError, match="algorithm='nccl' needs NCCL: the NCCL library "
                                                      "/nonexistent/libnccl.so.2 does not exist"):
        resolve_algorithm("nccl", CUDA_BUFFER, channel())


def test_nccl_is_an_algorithm_choice():
    assert "nccl" in md.collectives.ALGORITHMS


@pytest.mark.mpi(ranks=[2, 3])
def test_nccl_refusal_reaches_every_rank(mpi_ranks, own_comm):
    """Refused on every rank (the call check shares the refusal), and the communicator works on."""
    with pytest.raises(md.InvalidArgumentError, match="algorithm='nccl'"):
        own_comm.allreduce(np.ones(8), algorithm="nccl")
    assert (own_comm.allreduce(np.ones(8)) == mpi_ranks).all()


@pytest.mark.parametrize("unique_id", [bytes(range(128)), bytes(range(255, 127, -1)),
                                       tuple(range(-64, 64))])
def test_nccl_unique_id_crosses_mpi_as_cupy_gave_it(unique_id):
    """CuPy 14 gives the id as bytes, older CuPy as a tuple of 128 ints: the same comes out."""
    encoded = nccl.encode_unique_id(unique_id)
    assert encoded.dtype == np.int64 and encoded.shape == (1 + nccl.UNIQUE_ID_BYTES,)
    assert nccl.decode_unique_id(encoded.copy()) == unique_id


@pytest.mark.mpi(ranks=[2, 3])
def test_nccl_unique_id_failure_reaches_every_rank(mpi_ranks, own_comm, monkeypatch):
    """Rank 0 cannot make the id: every rank raises, naming rank 0, instead of the others waiting
    for the id's broadcast."""
    class NoNetwork:
        @staticmethod
        def get_unique_id():
            raise RuntimeError("NCCL found no network interface")
    monkeypatch.setattr(nccl, "bindings", lambda: NoNetwork)
    with pytest.raises(RuntimeError, match=r"(?s)rank 0.*NCCL found no network interface"):
        nccl.communicator(own_comm, 0)
    assert (own_comm.allreduce(np.ones(8)) == mpi_ranks).all()


@pytest.mark.mpi(ranks=[2, 3])
def test_one_rank_unable_sends_the_whole_node_the_staged_way(mpi_ranks, own_comm, monkeypatch):
    """can_open decides for the node together: the last local rank lacks CuPy, so no rank opens the
    window, each saying why; where all can and share one GPU, all open it."""
    monkeypatch.setattr(device_window._C, "cuda_max_sources", 8, raising=False)
    node = own_comm.node_comm
    monkeypatch.setattr(device_window, "missing", lambda: None)
    assert device_window.can_open(node, 0) is None
    last = node.Get_size() - 1
    if node.Get_rank() == last:
        monkeypatch.setattr(device_window, "missing", lambda: "no CuPy here")
    reason = device_window.can_open(node, 0)
    assert reason == ("no CuPy here" if node.Get_rank() == last else
                      f"local ranks [{last}] cannot (no peer access, or CuPy or CUDA kernels missing there)")


def test_window_traffic():
    """Two ranks: each moves half the message in and out (n read and written) and reduces its half
    (n read, n/2 written) and publishes it (n/2 written): 4n; four ranks: 4.5n."""
    assert bench_bound.window_traffic(1 << 20, 2) == 4 * (1 << 20)
    assert bench_bound.window_traffic(1 << 20, 4) == 4.5 * (1 << 20)


def test_bench_reads_device_cuda():
    args = command.build_parser().parse_args(["bench", "allreduce", "--device", "cuda", "--algorithms",
                                          "hierarchical,staged:ring,nccl,bound"])
    options = command.bench_options(args, args.collective)
    assert options.device == "cuda" and options.algorithms == ["hierarchical", "staged:ring", "nccl", "bound"]


def test_bench_refuses_cuda_for_other_collectives(mpi_world):
    with pytest.raises(ValueError, match="argument --device: cuda measures allreduce only"):
        bench.run(mpi_world, bench.Options(collective="broadcast", device="cuda"))


def test_bench_refuses_an_unknown_route(mpi_world):
    with pytest.raises(ValueError, match=r"unknown routes \['pinned:ring'\]"):
        bench_device.route_communicators(mpi_world, ["hierarchical", "pinned:ring"])
