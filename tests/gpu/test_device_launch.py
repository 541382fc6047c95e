"""The launch itself, before any collective: the ranks it asked for, the MPI library's route for GPU
memory that mpidist finds, and a GPU that torch and mpidist._C both see."""
import pytest
import torch

from mpidist import kernels


@pytest.mark.expectation("expect_ranks")
def test_the_launch_has_the_ranks_it_asked_for(world, settings):
    assert world.size == settings.expect_ranks, (
        f"this rank sees {world.size} ranks, the launch asked for {settings.expect_ranks}: mpirun and mpi4py's "
        "MPI library do not belong together")


@pytest.mark.expectation("expect_cuda_aware")
def test_mpidist_finds_the_mpi_library_cuda_aware_as_expected(comm, settings):
    aware = comm.is_cuda_aware()
    assert aware == (settings.expect_cuda_aware == "yes"), \
        f"mpidist sees cuda_aware={aware}, expected {settings.expect_cuda_aware}"


@pytest.mark.gpu_only
def test_the_gpu_is_visible_to_torch_and_to_the_extension(comm):
    assert torch.cuda.is_available() and kernels.cuda_available(), (
        f"torch.cuda.is_available()={torch.cuda.is_available()}, "
        f"mpidist.kernels.cuda_available()={kernels.cuda_available()}")
