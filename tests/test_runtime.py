"""The runtime floor (mpidist/runtime/): importing mpidist leaves MPI alone, MPI's start settings
are in place before any import of mpi4py.MPI, the environment variables, the deadline error that
names the silent peer, and typed header+payload messages."""
import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from conftest import REPO, run_python

import mpidist as md
from mpidist.runtime import config, deadlines, wire

pytestmark = pytest.mark.mpi_shared_launch


def test_importing_mpidist_does_not_initialize_mpi():
    code = ("import sys, mpidist, mpidist.runtime.config, mpidist.runtime.deadlines, mpidist.runtime.wire\n"
            "print('mpi4py.MPI' in sys.modules)\n")
    result = run_python(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def test_a_user_value_of_a_start_setting_is_kept():
    result = run_python("import os, mpidist; print(os.environ['OMPI_MCA_osc'])", env={"OMPI_MCA_osc": "sm"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "sm"


def test_mpi4py_imported_between_import_and_init_starts_without_osc_ucx_errors(tmp_path):
    # The script imports mpi4py.MPI (starting MPI) before md.init(); a shared-memory window (the
    # hierarchical all-reduce) then shows whether MPI started with mpidist's settings.
    script = tmp_path / "early_mpi4py.py"
    script.write_text(textwrap.dedent("""
        import mpidist as md
        from mpi4py import MPI
        import numpy as np
        md.init()
        print(md.rank(), md.allreduce(np.ones(3), algorithm="hierarchical").tolist(), flush=True)
    """))
    env = {k: v for k, v in os.environ.items()
           if k not in ("OMPI_MCA_osc", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", "PYTEST_ISOLATE_MPI_IS_FORKED")}
    result = subprocess.run(["mpirun", "--oversubscribe", "--bind-to", "none", "-np", "2", sys.executable, str(script)],
                            capture_output=True, text=True, timeout=120, env=env, cwd=REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    assert sorted(result.stdout.split("\n")[:2]) == ["0 [2.0, 2.0, 2.0]", "1 [2.0, 2.0, 2.0]"], result.stdout
    assert "OSC UCX" not in result.stdout + result.stderr, result.stdout + result.stderr


# ---- config -------------------------------------------------------------------------------

def test_every_mpidist_variable_of_the_repository_is_documented():
    used = set()
    for top in ("mpidist", "benchmarks", "slurm", "setup.py", "tests"):
        path = os.path.join(REPO, top)
        files = [path] if os.path.isfile(path) else [os.path.join(d, f) for d, _, names in os.walk(path) for f in names]
        for name in files:
            if name.endswith((".py", ".sh", ".sbatch")):
                with open(name, errors="replace") as handle:
                    used |= set(re.findall(r"MPIDIST_[A-Z0-9_]*[A-Z0-9]", handle.read()))
    # C preprocessor names of csrc/ and setup.py's -D flags are not environment variables.
    used -= {"MPIDIST_WITH_CUDA", "MPIDIST_LOOPS_AVX512", "MPIDIST_LOOPS_F16C", "MPIDIST_HAVE_X86_LOOPS"}
    documented = {variable.name for variable in config.VARIABLES}
    assert used - documented == set()
    assert {v.section for v in config.VARIABLES} <= set(config.SECTIONS)


def test_the_environment_page_shows_config_s_tables():
    with open(os.path.join(REPO, "docs", "environment.md")) as handle:
        page = handle.read()
    assert all(config.table_marker(section) in page.split("\n") for section in config.SECTIONS)
    assert page == config.with_tables(page), "run: python -m mpidist.runtime.config docs/environment.md"
    assert all(f"| `{v.name}` |" in page for v in config.VARIABLES)


def test_config_reads_each_kind(monkeypatch):
    monkeypatch.setenv("MPIDIST_TIMEOUT", "2.5")
    assert config.value("MPIDIST_TIMEOUT") == 2.5
    monkeypatch.setenv("MPIDIST_CHECK", "off")
    assert config.value("MPIDIST_CHECK") is False
    monkeypatch.setenv("MPIDIST_CHECK", "")
    assert config.value("MPIDIST_CHECK") is True  # empty: the default
    monkeypatch.delenv("MPIDIST_CUDA_AWARE", raising=False)
    assert config.value("MPIDIST_CUDA_AWARE") is None
    monkeypatch.setenv("MPIDIST_ALLREDUCE_ALGORITHM", "auto")
    assert config.value("MPIDIST_ALLREDUCE_ALGORITHM") is None
    monkeypatch.setenv("MPIDIST_ALLREDUCE_ALGORITHM", "ring")
    assert config.value("MPIDIST_ALLREDUCE_ALGORITHM") == "ring"
    monkeypatch.delenv("MPIDIST_TUNING_FILE", raising=False)
    assert config.value("MPIDIST_TUNING_FILE") == os.path.expanduser("~/.cache/mpidist/tuning.json")


@pytest.mark.parametrize("name, value, expected", [
    ("MPIDIST_CHECK", "maybe", "must be 1 or 0"),
    ("MPIDIST_RANKS_PER_NODE", "0", "must be a positive integer"),
    ("MPIDIST_SEGMENT_BYTES", "1.5", "must be a positive integer"),
    ("MPIDIST_TIMEOUT", "-1", "must be a number >= 0"),
])
def test_config_refuses_malformed_values_by_name(monkeypatch, name, value, expected):
    monkeypatch.setenv(name, value)
    with pytest.raises(md.InvalidArgumentError, match=re.escape(f"{name}={value!r} {expected}")):
        config.value(name)


# ---- deadlines ----------------------------------------------------------------------------

def test_a_deadline_names_the_silent_peer(monkeypatch):
    monkeypatch.setenv("MPIDIST_TIMEOUT", "0")
    with pytest.raises(md.DeadlineError) as excinfo:
        deadlines.wait_until(lambda: False, "rank 2", "the weights", "rank 5 (the server)", peers=(5,),
                             advice="Is it still running?")
    assert excinfo.value.peers == (5,)
    assert str(excinfo.value) == ("rank 2: the weights did not complete within 0 s (MPIDIST_TIMEOUT): "
                                  "no answer from rank 5 (the server). Is it still running?")
    assert isinstance(excinfo.value, md.MismatchError)  # as the collectives' deadlines always were


# ---- wire ---------------------------------------------------------------------------------

def test_the_dtype_table_is_the_collectives_one_first():
    from mpidist import buffers
    assert wire.DTYPES[:len(buffers.DTYPES)] == buffers.DTYPES
    assert all(torch.empty(0, dtype=wire.torch_dtype(name)).element_size() == size
               for name, size in wire.ITEMSIZE.items())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int16, torch.bool])
def test_a_header_describes_its_tensor_and_fields(dtype):
    tensor = torch.ones(2, 0, 3, dtype=dtype)
    header = wire.header_of(tensor, fields=(7, -1))
    assert header.dtype == np.int64 and header.size == wire.HEADER_LENGTH
    empty = wire.empty_from(header)
    assert (empty.dtype, tuple(empty.shape)) == (dtype, (2, 0, 3))
    assert wire.fields_of(header) == (7, -1)


def test_a_header_refuses_what_it_cannot_describe():
    with pytest.raises(md.UnsupportedDtypeError, match="complex64"):
        wire.header_of(torch.zeros(2, dtype=torch.complex64))
    with pytest.raises(md.InvalidArgumentError, match="at most 8 dimensions"):
        wire.header_of(torch.zeros([1] * 9))
    with pytest.raises(md.InvalidArgumentError, match="at most 4 numbers"):
        wire.header_of(torch.zeros(1), fields=(1, 2, 3, 4, 5))


@pytest.mark.mpi(ranks=[2])
def test_messages_travel_typed_between_ranks(mpi_ranks, mpi_world):
    mpi = mpi_world.mpi
    tensors = [torch.arange(6, dtype=torch.float64).reshape(2, 3), torch.tensor([1.5, -2.0], dtype=torch.bfloat16),
               torch.tensor([True, False, True]), torch.empty(0, 4, dtype=torch.int16)]
    who = f"rank {mpi_world.rank}"
    if mpi_world.rank == 0:
        sends = [wire.send(mpi, t, dest=1, tag=2 * i, fields=(i, 10 * i)) for i, t in enumerate(tensors)]
        for outgoing in sends:
            outgoing.wait(who, "a test message", "rank 1")
    else:
        for i, expected in enumerate(tensors):
            got, fields = wire.receive(mpi, 0, 2 * i, who, "a test message", "rank 0")
            assert got.dtype == expected.dtype and torch.equal(got, expected)
            assert fields == (i, 10 * i)
    root_tensor = torch.tensor([[3, 4]], dtype=torch.int32) if mpi_world.rank == 1 else None
    got = wire.broadcast(mpi, root_tensor, root=1, who=who, what="a test broadcast", silent="rank 1")
    assert torch.equal(got, torch.tensor([[3, 4]], dtype=torch.int32))


@pytest.mark.mpi(ranks=[2])
def test_a_message_that_never_comes_names_its_sender(mpi_ranks, own_comm, monkeypatch):
    # On a communicator of the test's own: the receive that never completes stays posted on it,
    # where no later test of the launch can send it a message.
    monkeypatch.setenv("MPIDIST_TIMEOUT", "1")
    if own_comm.rank == 1:
        with pytest.raises(md.DeadlineError, match=r"rank 1: a test message did not complete .* no answer from rank 0") \
                as excinfo:
            wire.receive(own_comm.mpi, 0, 99, "rank 1", "a test message", "rank 0")
        assert excinfo.value.peers == (0,)
    monkeypatch.setenv("MPIDIST_TIMEOUT", "120")  # rank 0 waits here while rank 1 waits out the 1 s
    own_comm.barrier()
