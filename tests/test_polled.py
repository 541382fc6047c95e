"""The gradient buckets' shared-slot all-reduce, advanced by polling (collectives/node_buckets.py), on
1 to 5 ranks against the float64 NumPy reference and tolerances of test_collectives, and its
errors.

The multi-rank tests of one world size run in one launch (mpi_shared_launch.py), each on a
communicator of its own (own_comm), its slots freed at its end."""
import os

import numpy as np
import pytest
import torch
from conftest import make_array, raw_bytes, to_float64
from test_collectives import FLOAT_DTYPES, INT_DTYPES, OPS, rank_values
from tolerances import reduction_bound, reduction_reference

import mpidist as md
from mpidist.collectives.node_buckets import NodeSlots
from mpidist.collectives.node_window import OWN_CORE_YIELD_SECONDS, YIELD_SECONDS, yield_seconds
from mpidist.parallel.flat import tensor_at

pytestmark = pytest.mark.mpi_shared_launch

# Bucket 0 is several gradients of odd lengths laid end to end, so the ranks' slices cut across
# them; bucket 1 is one array; bucket 2 spans several of the reduction kernel's 8 KiB blocks per
# slice for every dtype, so the publish over a source crosses block bounds.
BUCKETS = [[1, 7, 130, 3], [1001], [3, 40001]]


@pytest.mark.mpi(ranks=[1, 2, 3, 4, 5])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES + INT_DTYPES)
@pytest.mark.parametrize("results_in_slots", [False, True], ids=["results_in_arrays", "results_in_slots"])
def test_polled_buckets_match_reference(own_comm, results_in_slots, dtype):
    comm = own_comm
    p, r = comm.size, comm.rank
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
            error = np.abs(to_float64(flat) - reduction_reference(inputs[index], op))
            assert (error <= reduction_bound(inputs[index], op, dtype)).all(), f"{where}: error {error.max()}"
            everyone = comm.mpi.allgather(raw_bytes(flat))
            assert all(b == everyone[0] for b in everyone), f"{where}: ranks differ"
    slots.free()


@pytest.mark.mpi(ranks=[2, 3])
def test_progress_does_not_wait_for_other_ranks(own_comm):
    comm = own_comm
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


@pytest.mark.mpi(ranks=[2, 3])
def test_slots_choose_how_long_to_poll_from_the_ranks_cpus(own_comm):
    comm = own_comm
    slots = NodeSlots(comm.node_comm, [64])
    cpus = set().union(*comm.mpi.allgather(os.sched_getaffinity(0)))
    expected = OWN_CORE_YIELD_SECONDS if len(cpus) >= comm.size else YIELD_SECONDS
    assert slots.yield_seconds == expected
    slots.free()


@pytest.mark.mpi(ranks=[2, 3])
@pytest.mark.parametrize("bucket_sizes, message", [
    (lambda rank: [64, 128 if rank == 1 else 256], "bucket sizes differ between ranks"),
    (lambda rank: [64] * (2 if rank == 0 else 1), "different numbers of gradient buckets"),
], ids=["sizes", "numbers"])
def test_different_buckets_are_an_error_on_every_rank(own_comm, bucket_sizes, message):
    with pytest.raises(md.InvalidArgumentError, match=message):
        NodeSlots(own_comm.node_comm, bucket_sizes(own_comm.rank))


@pytest.mark.mpi(ranks=[2])
@pytest.mark.parametrize("tensors, message", [
    (lambda: [torch.zeros(8)], "holds 32 bytes but its shared slot was made for 64"),
    (lambda: [torch.zeros(8), torch.zeros(4, dtype=torch.float64)], "mixes dtypes"),
], ids=["wrong_size", "mixed_dtypes"])
def test_a_bucket_that_does_not_fit_its_slot_is_refused(own_comm, tensors, message):
    slots = NodeSlots(own_comm.node_comm, [16 * 4])
    with pytest.raises(md.InvalidArgumentError, match=message):
        slots.start(0, tensors(), "sum")
    slots.free()


# A launch of its own: it leaves rank 0's all-reduce unfinished in the shared slots, rank 1 never
# having joined it.
@pytest.mark.mpi_own_launch
@pytest.mark.mpi(ranks=[2])
def test_a_missing_rank_is_an_error_not_a_hang(monkeypatch, own_comm):
    comm = own_comm
    slots = NodeSlots(comm.node_comm, [16 * 4])
    if comm.rank == 0:
        # Rank 1 never joins this all-reduce: rank 0 gets an error instead of hanging.
        monkeypatch.setenv("MPIDIST_TIMEOUT", "1")
        handle = slots.start(0, [torch.zeros(16)], "sum")
        with pytest.raises(md.DeadlineError, match="did not complete within 1 s") as raised:
            handle.wait()
        assert "local ranks [1] of this node" in str(raised.value), raised.value
    comm.mpi.Barrier()
    slots.free()


# A launch of its own, as above. The round the others wait for moves on while they wait: the rank
# named is the one behind the round they wait for when the deadline comes.
@pytest.mark.mpi_own_launch
@pytest.mark.mpi(ranks=[3])
def test_a_rank_that_stops_after_its_copy_in_is_the_one_named(monkeypatch, own_comm):
    comm = own_comm
    slots = NodeSlots(comm.node_comm, [16 * 4])
    monkeypatch.setenv("MPIDIST_TIMEOUT", "2")
    handle = slots.start(0, [torch.ones(16)], "sum")  # every rank's copy-in
    if comm.rank != 2:  # rank 2 never reduces its slice: the others pass the first round, not the second
        with pytest.raises(md.DeadlineError, match="did not complete within 2 s") as raised:
            handle.wait()
        assert "local ranks [2] of this node" in str(raised.value), raised.value
    comm.mpi.Barrier()
    slots.free()
