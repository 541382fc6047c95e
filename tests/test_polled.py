"""The gradient buckets' shared-slot all-reduce, advanced by polling (collectives/polled.py), on
1 to 5 ranks against the float64 NumPy reference and tolerances of test_collectives, and its
errors."""
import os

import numpy as np
import pytest
import torch
from conftest import make_array, raw_bytes, to_float64
from mpi4py import MPI
from test_collectives import FLOAT_DTYPES, INT_DTYPES, OPS, rank_values, reference, tolerance

import mpidist as md
from mpidist.collectives.polled import OWN_CORE_YIELD_SECONDS, YIELD_SECONDS, NodeSlots, yield_seconds
from mpidist.parallel.flat import tensor_at

# Bucket 0 is several gradients of odd lengths laid end to end, so the ranks' slices cut across
# them; bucket 1 is one array; bucket 2 spans several of the reduction kernel's 8 KiB blocks per
# slice for every dtype, so the publish over a source crosses block bounds.
BUCKETS = [[1, 7, 130, 3], [1001], [3, 40001]]


@pytest.mark.mpi(ranks=[1, 2, 3, 4, 5])
def test_node_slots(mpi_ranks):
    """The checks of one world size in one launch: each launch starts every rank's interpreter
    (torch included), which costs more than the checks themselves."""
    check_polled_buckets_match_reference()
    if mpi_ranks in (2, 3):
        check_progress_does_not_wait_for_other_ranks()
        check_slots_choose_how_long_to_poll_from_the_ranks_cpus()
        check_different_bucket_sizes_are_an_error_on_every_rank()


def check_polled_buckets_match_reference():
    comm = md.Communicator(MPI.COMM_WORLD)
    for results_in_slots in (False, True):
        check_polled_buckets(comm, results_in_slots)


def check_polled_buckets(comm, results_in_slots):
    p, r = comm.size, comm.rank
    for dtype in FLOAT_DTYPES + INT_DTYPES:
        itemsize = torch.empty(0, dtype=getattr(torch, dtype)).element_size()
        slots = NodeSlots(comm.node_comm, [sum(parts) * itemsize for parts in BUCKETS], results_in_slots)
        in_slot = [tensor_at(slots.address(i), sum(parts), getattr(torch, dtype), slots)
                   for i, parts in enumerate(BUCKETS)]
        # Every op in turn: each call reuses the slots of the call before.
        for call, op in enumerate(OPS):
            if dtype in INT_DTYPES and op == "avg":
                continue
            inputs, flats, handles = [], [], []
            for index, parts in enumerate(BUCKETS):
                values = [rank_values(10 * call + index, k, sum(parts), dtype, op) for k in range(p)]
                flat = make_array("torch", values[r], dtype)
                if results_in_slots and call % 2:
                    # The arrays may be views of the slot (the last call's result, overwritten).
                    flat = in_slot[index].copy_(flat)
                inputs.append(values)
                flats.append(flat)
                handles.append(slots.start(index, list(torch.split(flat, parts)), op))
            for handle in handles:
                handle.progress()  # never blocks; may or may not finish
            for handle in reversed(handles):  # any order of waiting completes
                handle.wait()
            if results_in_slots:
                for index, flat in enumerate(flats):
                    if flat.data_ptr() != in_slot[index].data_ptr():  # only read
                        assert torch.equal(flat, make_array("torch", inputs[index][r], dtype))
                flats = in_slot
            for index, flat in enumerate(flats):
                where = f"polled {dtype} {op} bucket {index} p={p} results_in_slots={results_in_slots}"
                error = np.abs(to_float64(flat) - reference(inputs[index], op))
                assert (error <= tolerance(inputs[index], op, dtype)).all(), f"{where}: error {error.max()}"
                everyone = comm.mpi.allgather(raw_bytes(flat))
                assert all(b == everyone[0] for b in everyone), f"{where}: ranks differ"
        slots.free()


def check_progress_does_not_wait_for_other_ranks():
    comm = md.Communicator(MPI.COMM_WORLD)
    slots = NodeSlots(comm.node_comm, [64 * 4])
    data = torch.full((64,), float(comm.rank + 1))
    if comm.rank == 0:
        handle = slots.start(0, [data], "sum")
        # The others start only after the barrier below: nothing can be reduced yet.
        assert not handle.progress() and not handle.done()
        comm.mpi.Barrier()
    else:
        comm.mpi.Barrier()
        handle = slots.start(0, [data], "sum")
    handle.wait()
    assert handle.done()
    assert torch.equal(data, torch.full((64,), float(sum(range(1, comm.size + 1)))))
    # A finished all-reduce leaves the arrays alone, however often the hooks ask.
    data.fill_(-1.0)
    assert handle.progress()
    assert torch.equal(data, torch.full((64,), -1.0))
    comm.mpi.Barrier()
    slots.free()


def test_waiting_polls_longer_only_where_every_rank_can_have_a_core():
    assert yield_seconds([{0}, {1}], 2) == OWN_CORE_YIELD_SECONDS  # bound to a core each
    assert yield_seconds([{0, 1}, {0, 1}], 2) == OWN_CORE_YIELD_SECONDS  # unbound, 2 cores
    assert yield_seconds([{0, 1}] * 3, 3) == YIELD_SECONDS  # 3 ranks on 2 cores
    assert yield_seconds([{0}, {0}], 2) == YIELD_SECONDS  # bound to the same core
    assert OWN_CORE_YIELD_SECONDS > YIELD_SECONDS


def check_slots_choose_how_long_to_poll_from_the_ranks_cpus():
    comm = md.Communicator(MPI.COMM_WORLD)
    slots = NodeSlots(comm.node_comm, [64])
    cpus = set().union(*comm.mpi.allgather(os.sched_getaffinity(0)))
    expected = OWN_CORE_YIELD_SECONDS if len(cpus) >= comm.size else YIELD_SECONDS
    assert slots.yield_seconds == expected
    slots.free()


def check_different_bucket_sizes_are_an_error_on_every_rank():
    comm = md.Communicator(MPI.COMM_WORLD)
    with pytest.raises(md.InvalidArgumentError, match="bucket sizes differ between ranks"):
        NodeSlots(comm.node_comm, [64, 128 if comm.rank == 1 else 256])
    with pytest.raises(md.InvalidArgumentError, match="different numbers of gradient buckets"):
        NodeSlots(comm.node_comm, [64] * (2 if comm.rank == 0 else 1))


# A launch of its own: it waits for MPIDIST_TIMEOUT to expire, and leaves rank 0's all-reduce
# unfinished in the shared slots, rank 1 never having joined it.
@pytest.mark.mpi(ranks=[2])
def test_wrong_size_and_missing_rank_are_errors(mpi_ranks, monkeypatch):
    comm = md.Communicator(MPI.COMM_WORLD)
    slots = NodeSlots(comm.node_comm, [16 * 4])
    with pytest.raises(md.InvalidArgumentError, match="holds 32 bytes but its shared slot was made for 64"):
        slots.start(0, [torch.zeros(8)], "sum")
    with pytest.raises(md.InvalidArgumentError, match="mixes dtypes"):
        slots.start(0, [torch.zeros(8), torch.zeros(4, dtype=torch.float64)], "sum")
    if comm.rank == 0:
        # Rank 1 never joins this all-reduce: rank 0 gets an error instead of hanging.
        monkeypatch.setenv("MPIDIST_TIMEOUT", "1")
        handle = slots.start(0, [torch.zeros(16)], "sum")
        with pytest.raises(md.MpidistError, match="did not complete within 1 s"):
            handle.wait()
    comm.mpi.Barrier()
    slots.free()
