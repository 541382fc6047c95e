"""Soak: many collectives and training steps leave a rank's resident memory, open files,
shared-memory mappings and the MPI library's tables of communicators and windows where they were
after a warm-up (no leak per call, per step, or per Communicator made and freed), and an aborted
job leaves no shared-memory files behind.

About 90 s on two cores, so `make test` leaves this directory out (pyproject.toml's
norecursedirs) and `make test-soak` runs it; CI runs both."""
import os
import re
import textwrap

import numpy as np
import pytest
import torch
from conftest import run_python
from mpi4py import MPI

import mpidist as md

pytestmark = pytest.mark.mpi_shared_launch

GROWTH_LIMIT_BYTES = 20 * 2 ** 20


def free_slots() -> dict:
    """The first free entries of the MPI library's tables of communicators and of windows. Open
    MPI gives a new communicator or window the lowest free entry (its Fortran handle), so a
    communicator or window made and never freed since the last look moves it up."""
    probe = MPI.COMM_SELF.Dup()
    window = MPI.Win.Create(None, comm=MPI.COMM_SELF)
    slots = {"communicator slot": probe.py2f(), "window slot": window.py2f()}
    window.Free()
    probe.Free()
    return slots


def footprint() -> dict:
    """This process's resident bytes, open file descriptors, mappings of shared memory, and the
    first free entries of the MPI library's tables of communicators and windows."""
    with open("/proc/self/statm") as statm:
        resident = int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    with open("/proc/self/maps") as maps:
        shared = sum(1 for line in maps if "/dev/shm/" in line)
    return {"resident": resident, "files": len(os.listdir("/proc/self/fd")), "shared mappings": shared,
            **free_slots()}


def assert_flat(before: dict, after: dict, what: str) -> None:
    grown = after["resident"] - before["resident"]
    assert grown < GROWTH_LIMIT_BYTES, f"{what}: resident memory grew {grown / 2 ** 20:.1f} MB"
    assert after["files"] == before["files"], f"{what}: open files {before['files']} -> {after['files']}"
    for kind in ("shared mappings", "communicator slot", "window slot"):
        assert after[kind] == before[kind], f"{what}: {kind} {before[kind]} -> {after[kind]}"


def mixed_collectives(comm, calls: int, start: int = 0) -> None:
    """`calls` collectives of every kind, checked, on tiny buffers; every 50th call makes and
    frees a Communicator of its own (its duplicates and node communicators)."""
    size = comm.size
    for call in range(start, start + calls):
        kind = call % 10
        values = np.full(8 * size, float(comm.rank + 1), dtype=np.float32)
        if kind < 3:
            algorithm = ("ring", "tree", "auto")[kind]
            comm.allreduce(values, algorithm=algorithm)
            assert values[0] == size * (size + 1) / 2
        elif kind == 3:
            comm.broadcast(values, root=call % size)
            assert values[0] == call % size + 1
        elif kind == 4:
            assert comm.allgather(values[:2]).shape[0] == 2 * size
        elif kind == 5:
            assert comm.reduce_scatter(values, op="max")[0] == size
        elif kind == 6:
            comm.allreduce_async(values, op="min").wait()
            assert values[0] == 1
        elif kind == 7:
            comm.allreduce(torch.ones(3, dtype=torch.bfloat16), op="avg")
        elif kind == 8:
            comm.barrier()
        elif call % 50 == 9:
            with md.Communicator(comm.mpi) as own:
                own.allreduce(values)
        else:
            comm.allreduce(values.astype(np.int64), algorithm="recursive_doubling")


@pytest.mark.mpi(ranks=[2])
def test_ten_thousand_mixed_collectives_leave_memory_flat(mpi_ranks, own_comm):
    mixed_collectives(own_comm, 1000)
    before = footprint()
    mixed_collectives(own_comm, 10_000, start=1000)
    assert_flat(before, footprint(), "10,000 collectives")


def tiny_batches(step: int):
    generator = torch.Generator().manual_seed(step)
    return torch.randn(8, 6, generator=generator), torch.randint(0, 3, (8,), generator=generator)


def tiny_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))


@pytest.mark.mpi(ranks=[2])
def test_two_hundred_data_parallel_steps_leave_memory_flat(mpi_ranks, mpi_world):
    model = md.DataParallel(tiny_model(), comm=mpi_world)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def steps(first, count):
        for step in range(first, first + count):
            x, y = tiny_batches(step * mpi_world.size + mpi_world.rank)
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()

    steps(0, 20)
    before = footprint()
    steps(20, 200)
    assert_flat(before, footprint(), "200 data-parallel steps")


@pytest.mark.mpi(ranks=[2])
def test_two_hundred_pipeline_steps_leave_memory_flat(mpi_ranks, mpi_world):
    pipe = md.Pipeline(tiny_model(), torch.nn.functional.cross_entropy, chunks=2)
    optimizer = torch.optim.SGD(list(pipe.parameters()), lr=0.1)

    def steps(first, count):
        for step in range(first, first + count):
            x, y = tiny_batches(step)
            pipe.zero_grad()
            pipe.train_step(x if mpi_world.rank == 0 else None, y if mpi_world.rank == mpi_world.size - 1 else None)
            optimizer.step()

    steps(0, 20)
    before = footprint()
    steps(20, 200)
    after = footprint()
    pipe.free()
    assert_flat(before, after, "200 pipeline steps")


@pytest.mark.mpi(ranks=[2])
def test_two_hundred_parameter_server_steps_leave_memory_flat(mpi_ranks, mpi_world):
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1) if mpi_world.rank == 0 else None
    ps = md.ParameterServer(model, optimizer, comm=mpi_world, mode="async")
    if ps.is_server:
        ps.serve()
        return  # the server's footprint is its history of updates: it grows by design
    for step in range(220):
        if step == 20:
            before = footprint()
        x, y = tiny_batches(step)
        model.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        ps.step()
    after = footprint()
    ps.close()
    assert_flat(before, after, "200 parameter-server steps")


def test_an_aborted_job_leaves_no_shared_memory_files(tmp_path):
    # Open MPI's shared-memory transports put their files in these directories; pointed at a
    # directory of the test's own, what the aborted job leaves there is its own, whatever other
    # jobs on the machine do in /dev/shm meanwhile.
    code = textwrap.dedent("""
        import os
        import numpy as np
        import mpidist as md
        md.init()
        values = np.ones(1 << 16, dtype=np.float32)
        md.allreduce(values, algorithm="hierarchical")
        md.barrier()
        if md.rank() == 0:  # the files are where the test looks for them
            print("shared-memory files:", len(os.listdir(os.environ["OMPI_MCA_btl_sm_backing_directory"])), flush=True)
        md.barrier()
        if md.rank() == 1:
            raise ValueError("aborting with shared windows open")
        md.barrier()
    """)
    directory = tmp_path / "shm"
    directory.mkdir()
    env = {name: str(directory) for name in ("OMPI_MCA_btl_sm_backing_directory", "OMPI_MCA_osc_sm_backing_directory",
                                              "OMPI_MCA_shmem_mmap_backing_file_base_dir")}
    result = run_python(code, ranks=3, env=env, timeout=60)
    assert result.returncode != 0 and "ValueError: aborting with shared windows open" in result.stderr
    assert int(re.search(r"shared-memory files: (\d+)", result.stdout).group(1)) > 0, result.stdout
    assert os.listdir(directory) == []
