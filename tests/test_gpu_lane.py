"""collectives/gpu_lane.py on the CPU: the choice of the lane between nodes for CUDA buffers in
every combination of the ranks' facts, its agreement on every rank (emulated nodes:
MPIDIST_RANKS_PER_NODE), the refusals of a forced lane, and the lane route's steps run on host
memory standing in for the device window's (the GPU runs them in `make gpu-check`), against the
float64 NumPy reference; then the public all-reduce on CUDA buffers across nodes, with CuPy and
mpidist's CUDA kernels stood in for (test_device_window_standin.py): `auto` takes the lane where
the ranks agreed on one, and the staged route with its table's choice where not, and a buffer on
another GPU than the lane's window is refused on every rank."""
import itertools
import json

import numpy as np
import pytest
from conftest import run_python
from mpi4py import MPI
from test_device_window_standin import (
    host_gpu,  # noqa: F401  (the fixture "gpu")
    on_gpu,
    record_routes,
)
from test_nccl_library import fake_nccl

import mpidist as md
from mpidist import buffers
from mpidist.buffers import BufferInfo
from mpidist.collectives import device_window, gpu_lane, nccl
from mpidist.collectives.node_window import HostMemory
from mpidist.collectives.select import table_choice

pytestmark = pytest.mark.mpi_shared_launch

FACTS = list(itertools.product([None, "nccl", "cuda-aware", "staged"], [True, False], [True, False], [True, False]))


@pytest.mark.parametrize("forced,has_nccl,aware,window_ok", FACTS)
def test_choose_lane(forced, has_nccl, aware, window_ok):
    usable = {"nccl": has_nccl and window_ok, "cuda-aware": aware and window_ok, "staged": True}
    facts = ({} if has_nccl else {1: "no libnccl"}, [] if aware else [0, 1], None if window_ok else "no CuPy")
    if forced is not None and not usable[forced]:
        with pytest.raises(md.InvalidArgumentError, match=f"MPIDIST_GPU_LANE={forced} cannot be taken: "):
            gpu_lane.choose_lane(forced, *facts)
        return
    lane, why = gpu_lane.choose_lane(forced, *facts)
    expected = forced or ("nccl" if usable["nccl"] else "cuda-aware" if usable["cuda-aware"] else "staged")
    assert lane == expected
    assert why == "forced by MPIDIST_GPU_LANE" if forced else why.startswith("auto")


def test_auto_says_why_it_passed_a_lane():
    lane, why = gpu_lane.choose_lane(None, {0: "no libnccl", 2: "no libnccl", 1: "too old"}, [], None)
    assert lane == "cuda-aware"
    assert why == "auto; not nccl: no NCCL on ranks 0, 2: no libnccl; rank 1: too old"
    lane, why = gpu_lane.choose_lane(None, {}, [3], "no CuPy")
    assert lane == "staged" and why == (
        "auto; not nccl: the device window inside the nodes cannot be used (no CuPy); not cuda-aware: the MPI "
        "library does not read GPU memory on rank(s) [3]")


def test_an_unknown_lane_is_refused():
    with pytest.raises(md.InvalidArgumentError, match="MPIDIST_GPU_LANE='gloo' is none of auto, nccl, cuda-aware, "
                                                      "staged"):
        gpu_lane.choose_lane("gloo", {}, [], None)


@pytest.fixture
def nodes_of_one(monkeypatch):
    """A Communicator whose every rank is a node of its own."""
    monkeypatch.setenv("MPIDIST_RANKS_PER_NODE", "1")
    comm = md.Communicator(MPI.COMM_WORLD)
    yield comm
    comm.free()


@pytest.mark.mpi(ranks=[2, 3])
def test_every_rank_agrees_on_staged_here(mpi_ranks, nodes_of_one, monkeypatch):
    """Here no rank has NCCL (the last one has an old one) nor a CUDA-aware MPI: `auto` takes the
    staged lane on every rank, and says why; the route leaves the buffer to the staged way."""
    monkeypatch.setenv("MPIDIST_NCCL_LIBRARY", "/nonexistent/libnccl.so.2")
    lane, why = gpu_lane.agreed_lane(nodes_of_one, 0)
    assert lane == "staged" and "not nccl: no NCCL on ranks" in why and "not cuda-aware" in why
    assert MPI.COMM_WORLD.allgather(why) == [why] * mpi_ranks
    assert not gpu_lane.allreduce(nodes_of_one, None, BufferInfo(0, 8, "float32", "cuda:0", "torch"), "sum")


@pytest.mark.mpi(ranks=[2, 3])
def test_a_forced_lane_refused_on_every_rank(mpi_ranks, nodes_of_one, monkeypatch, tmp_path):
    """MPIDIST_GPU_LANE=nccl where only the last rank lacks a usable NCCL: every rank raises,
    naming that rank; the communicator works on."""
    last = mpi_ranks - 1
    monkeypatch.setenv("MPIDIST_GPU_LANE", "nccl")
    monkeypatch.setenv("MPIDIST_NCCL_LIBRARY", fake_nccl(tmp_path, 22905 if nodes_of_one.rank == last else 23007))
    monkeypatch.setattr(device_window, "can_open", lambda node, device: None)
    with pytest.raises(md.InvalidArgumentError, match=rf"MPIDIST_GPU_LANE=nccl cannot be taken: no NCCL on rank {last}: "
                                                      r".* is NCCL 2\.29\.5"):
        gpu_lane.agreed_lane(nodes_of_one, 0)
    assert (nodes_of_one.allreduce(np.ones(4)) == mpi_ranks).all()


@pytest.mark.mpi(ranks=[2])
def test_ranks_that_differ_on_the_lane_are_refused(mpi_ranks, nodes_of_one, monkeypatch):
    monkeypatch.setenv("MPIDIST_GPU_LANE", "staged" if nodes_of_one.rank == 0 else "auto")
    with pytest.raises(md.InvalidArgumentError, match="MPIDIST_GPU_LANE differs between ranks: rank 0: staged; "
                                                      "rank 1: auto"):
        gpu_lane.agreed_lane(nodes_of_one, 0)


class HostStandIn(HostMemory):
    """Host memory in the device window's place: DeviceMemory's signature, the CPU's device."""

    device = "cpu"

    def __init__(self, node_comm, device_index):
        super().__init__(node_comm)


def nccl_stand_in(monkeypatch, lanes_run, gpu=None):
    """The NCCL lane's calls answered by MPI's all-reduce over the lane (what NCCL would compute);
    with `gpu` (a HostGpu), after the kernels queued before it, as NCCL runs on their stream."""
    class Communicator:
        def __init__(self, mpi, device, what):
            self.mpi, self.destroyed = mpi, False

        def destroy(self):
            self.destroyed = True
            lanes_run.append("destroyed")

    monkeypatch.setattr(nccl, "communicator_over", Communicator)
    def reduce_with(comm, info, op):
        lanes_run.append(info.count)
        if gpu is not None:
            gpu.cuda_synchronize(None, None)
        view = np.ctypeslib.as_array((np.ctypeslib.ctypes.c_double * info.count).from_address(info.ptr))
        comm.mpi.Allreduce(MPI.IN_PLACE, view, op=MPI.SUM)
    monkeypatch.setattr(nccl, "reduce_with", reduce_with)


@pytest.mark.mpi(ranks=[2, 3, 4])
@pytest.mark.parametrize("lane", ["cuda-aware", "nccl"])
@pytest.mark.parametrize("op", ["sum", "avg"])
def test_the_lane_route_reduces(mpi_ranks, lane, op, monkeypatch):
    """The route's steps (node window with a result region, lane slices between nodes, copy out)
    on emulated nodes (of one rank each with 2 ranks, else of two), host memory standing in for
    GPU memory."""
    monkeypatch.setenv("MPIDIST_RANKS_PER_NODE", "1" if mpi_ranks == 2 else "2")
    monkeypatch.setattr(device_window, "DeviceMemory", HostStandIn)
    lanes_run, synchronized = [], []
    nccl_stand_in(monkeypatch, lanes_run)
    # the caller's stream is waited for before the window reads the buffer (a CPU array has none)
    monkeypatch.setattr(buffers, "synchronize", lambda array, info: synchronized.append(info.count))
    comm = md.Communicator(MPI.COMM_WORLD)
    try:
        comm.gpu_lane = (lane, "test")
        for count in (1, 1000, 3):
            inputs = [np.random.default_rng(k + count).standard_normal(count) for k in range(mpi_ranks)]
            array = inputs[comm.rank].copy()
            assert gpu_lane.allreduce(comm, array, buffers.describe(array), op)
            expected = np.sum(inputs, axis=0) / (mpi_ranks if op == "avg" else 1)
            np.testing.assert_allclose(array, expected, rtol=1e-12, atol=1e-12)
        assert synchronized == [1, 1000, 3]
        has_lane = comm.node_communicators().lane is not None
        assert bool(lanes_run) == (lane == "nccl" and has_lane)
    finally:
        comm.free()
    assert lanes_run[-1:] == (["destroyed"] if lane == "nccl" and has_lane else [])


def test_info_names_the_nccl_and_the_lane(tmp_path):
    """`mpidist info` on 2 emulated nodes of one rank: the NCCL found (the fake's version and path)
    and the lane it would take: NCCL, every rank having it (one rank a node needs no device window)."""
    path = fake_nccl(tmp_path, 23007)
    result = run_python("from mpidist.cli import main; raise SystemExit(main(['info', '--json']))", ranks=2,
                        env={"MPIDIST_RANKS_PER_NODE": "1", "MPIDIST_NCCL_LIBRARY": path})
    assert result.returncode == 0, result.stderr
    facts = json.loads(result.stdout)
    assert facts["nccl"] == f"2.30.7 ({path})"
    assert facts["gpu_lane_between_nodes"] == "nccl (auto)"


# ---- the public all-reduce of CUDA buffers across nodes: the device route --------------------------

@pytest.fixture
def gpu_nodes(mpi_ranks, gpu, monkeypatch):
    """A Communicator over emulated nodes, of one rank each with 2 ranks, else of two (3 ranks: a
    node of two and a node of one), on ranks with the stand-in GPU."""
    monkeypatch.setenv("MPIDIST_RANKS_PER_NODE", "1" if mpi_ranks == 2 else "2")
    comm = md.Communicator(MPI.COMM_WORLD)
    yield comm
    comm.free()


def check_sums(comm, op="sum", algorithm="auto", counts=(1, 1000, 40001), device=0) -> None:
    for seed, count in enumerate(counts):
        inputs = [np.random.default_rng([seed, k]).standard_normal(count) for k in range(comm.size)]
        array = on_gpu(inputs[comm.rank], "float64", device)
        assert comm.allreduce(array, op=op, algorithm=algorithm) is array
        expected = np.sum(inputs, axis=0) / (comm.size if op == "avg" else 1)
        np.testing.assert_allclose(array.host, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.mpi(ranks=[2, 3, 4])
@pytest.mark.parametrize("op", ["sum", "avg"])
def test_auto_takes_the_lane_route(mpi_ranks, gpu, gpu_nodes, monkeypatch, tmp_path, op):
    """algorithm="auto" on CUDA buffers across nodes takes the lane every rank agreed on (here
    NCCL, which every rank has), with the device window inside the nodes of two, as "hierarchical"
    does: nothing is staged and no algorithm of the staged route runs."""
    monkeypatch.setenv("MPIDIST_NCCL_LIBRARY", fake_nccl(tmp_path, 23007))
    lanes_run = []
    nccl_stand_in(monkeypatch, lanes_run, gpu)
    staged, ran = record_routes(gpu_nodes, monkeypatch)
    check_sums(gpu_nodes, op)
    assert gpu_nodes.gpu_lane[0] == "nccl" and staged == [] and ran == []
    assert bool(lanes_run) == (gpu_nodes.node_communicators().lane is not None)
    assert (gpu_nodes.lane_window.memory.own is not None) == (gpu_nodes.node_comm.Get_size() > 1)


@pytest.mark.mpi(ranks=[2, 3])
def test_auto_stages_with_its_table_where_no_lane_can_be_taken(mpi_ranks, gpu, gpu_nodes, monkeypatch):
    """No rank has NCCL nor a CUDA-aware MPI: the ranks agree on the staged lane, and `auto` runs
    its table's choice on a host copy (where "hierarchical" would run itself there)."""
    monkeypatch.setenv("MPIDIST_NCCL_LIBRARY", "/nonexistent/libnccl.so.2")
    staged, ran = record_routes(gpu_nodes, monkeypatch)
    counts = (1, 1000, 40001)
    check_sums(gpu_nodes, counts=counts)
    assert gpu_nodes.gpu_lane[0] == "staged" and gpu_nodes.lane_window is None
    assert staged == list(counts)
    assert ran == [table_choice(gpu_nodes, BufferInfo(0, count, "float64", "cuda:0", "cupy")) for count in counts]


@pytest.mark.mpi(ranks=[2, 3])
@pytest.mark.parametrize("algorithm", ["auto", "hierarchical"])
def test_a_buffer_on_another_gpu_than_the_lane_window_is_an_error_on_every_rank(mpi_ranks, gpu, gpu_nodes,
                                                                                monkeypatch, tmp_path, algorithm):
    """The lane's window is on cuda:0 on every rank; then the last rank passes a buffer on cuda:1.
    It refuses it before the call check, which shares the refusal, so every rank raises at once
    (the others had gone on into the window or the lane and waited for it there). Nobody entered
    them: the communicator works on."""
    last = mpi_ranks - 1
    monkeypatch.setenv("MPIDIST_NCCL_LIBRARY", fake_nccl(tmp_path, 23007))
    nccl_stand_in(monkeypatch, [], gpu)
    check_sums(gpu_nodes, algorithm=algorithm, counts=(1000,))
    monkeypatch.setenv("MPIDIST_TIMEOUT", "5")  # so that a regression ends as a DeadlineError
    array = on_gpu(np.ones(1000), "float64", device=1 if gpu_nodes.rank == last else 0)
    if gpu_nodes.rank == last:
        expected = md.InvalidArgumentError, rf"rank {last}'s buffer is on cuda:1, this communicator's GPU lane " \
                                             r"window on that rank on cuda:0: a rank's GPU buffers must all be on one GPU"
    else:
        expected = md.MismatchError, rf"ranks \[{last}\] refused their arguments to this collective"
    with pytest.raises(expected[0], match=expected[1]):
        gpu_nodes.allreduce(array, algorithm=algorithm)
    monkeypatch.delenv("MPIDIST_TIMEOUT")
    check_sums(gpu_nodes, algorithm=algorithm, counts=(3000,))
