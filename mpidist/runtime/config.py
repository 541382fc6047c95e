"""Every MPIDIST_* environment variable: its default, its meaning, when it is read, and the one
way to read it (value()).

VARIABLES lists them all, including those read by setup.py (the build) and by the SLURM scripts
(slurm/), which cannot import mpidist: documentation() renders the list as a Markdown table for
the docs. value(name) reads one of the variables the package itself reads; malformed values are
refused with an InvalidArgumentError that names the variable. Values are read when asked for, so
a program may set them between `import mpidist` and the moment they are used (see each one's
"read" column).
"""
from __future__ import annotations

import dataclasses
import os

from ..errors import InvalidArgumentError

# value kinds: "number" (float), "count" (int), "flag" (on/off), "text", "path"
TRUE_WORDS = ("1", "yes", "true", "on")
FALSE_WORDS = ("0", "no", "false", "off")


@dataclasses.dataclass(frozen=True)
class Variable:
    name: str
    kind: str
    default: object  # the value when unset or empty
    minimum: float  # numbers and counts: the least value accepted
    read: str  # when it is read
    meaning: str
    reader: str = "mpidist"  # who reads it: the package ("mpidist"), "setup.py", or a script


def _package(name, kind, default, read, meaning, minimum=0):
    return Variable(name, kind, default, minimum, read, meaning)


def _outside(name, default, reader, meaning):
    return Variable(name, "text", default, 0, "when the script starts", meaning, reader)


VARIABLES = (
    _package("MPIDIST_TIMEOUT", "number", 300.0, "at every wait",
             "Seconds a rank waits for another before raising DeadlineError (a collective's call check, "
             "pipeline and parameter-server messages, gradient buckets, hvd.join announcements)."),
    _package("MPIDIST_CHECK", "flag", True, "when a Communicator is made",
             "0 turns off the cross-rank call check (one small allgather per collective that turns a "
             "mismatched call into an error on every rank); small all-reduces then take the fast path."),
    _package("MPIDIST_ALLREDUCE_ALGORITHM", "text", None, "when a Communicator is made",
             "Forces one all-reduce algorithm for algorithm=\"auto\" (ring, tree, recursive_halving, "
             "recursive_doubling, reduce_bcast, hierarchical, mpi); unset or auto: the tuning table decides."),
    _package("MPIDIST_TUNING_FILE", "path", os.path.join("~", ".cache", "mpidist", "tuning.json"),
             "when a Communicator is made, and by `mpidist tune`",
             "The decision table `mpidist tune` writes and algorithm=\"auto\" reads (rank 0 reads it and "
             "broadcasts it)."),
    _package("MPIDIST_SEGMENT_BYTES", "count", 256 * 1024, "at import of the collectives",
             "Segment size of the pipelined exchange-and-reduce steps: the reduction of one segment "
             "overlaps the arrival of the next.", minimum=1),
    _package("MPIDIST_BCAST_SCATTER_BYTES", "count", 512 * 1024, "at import of the collectives",
             "From this message size broadcast uses scatter + ring allgather instead of a binomial tree."),
    _package("MPIDIST_CUDA_AWARE", "flag", None, "at the first GPU buffer of a Communicator",
             "1: the MPI library reads GPU memory directly; 0: GPU buffers are staged through pinned host "
             "memory; unset: ask the MPI library (Open MPI, MPICH)."),
    _package("MPIDIST_RANKS_PER_NODE", "count", None, "when a Communicator is made",
             "Emulate nodes of this many consecutive ranks on one host (testing the hierarchical and "
             "node-aware paths); unset: the real nodes.", minimum=1),
    _package("MPIDIST_KEEP_FREED_MEMORY", "flag", True, "when DataParallel or hvd's optimizer starts",
             "0 leaves glibc's malloc settings alone (by default freed memory is kept for reuse, "
             "see mpidist/memory.py)."),
    _package("MPIDIST_DATA_DIR", "path", None, "when the digits data set is looked for",
             "Directory of digits.h5 for `mpidist train` and `mpidist prepare-data`; unset: data/ in the "
             "checkout, else in the working directory."),
    _outside("MPIDIST_CUDA", "auto", "setup.py",
             "Build the CUDA kernels: 1 (require nvcc), 0 (CPU only), auto (when nvcc is found)."),
    _outside("MPIDIST_CUDA_ARCHS", "every architecture nvcc supports", "setup.py",
             "GPU architectures to build for, e.g. \"80;90\" (like TORCH_CUDA_ARCH_LIST)."),
    _outside("MPIDIST_ROOT", "$SLURM_SUBMIT_DIR, else $PWD", "slurm/common.sh",
             "The repository root, put first on PYTHONPATH."),
    _outside("MPIDIST_PYTHON", "$MPIDIST_ROOT/.venv/bin/python, else python3", "slurm/common.sh",
             "The Python the ranks run."),
    _outside("MPIDIST_LAUNCHER", "srun", "slurm/common.sh", "srun or mpirun: how ranks are started."),
    _outside("MPIDIST_SRUN_MPI", "pmix", "slurm/common.sh", "srun's --mpi= plugin."),
    _outside("MPIDIST_SRUN_ARGS", "", "slurm/common.sh", "More arguments for srun."),
    _outside("MPIDIST_MPIRUN", "the mpirun beside MPIDIST_PYTHON, else mpirun on PATH", "slurm/common.sh",
             "The mpirun of MPIDIST_LAUNCHER=mpirun."),
    _outside("MPIDIST_MPIRUN_ARGS", "", "slurm/common.sh", "More arguments for mpirun."),
    _outside("MPIDIST_TRAIN_MODE", "data", "slurm/train.sbatch", "data or pipeline."),
    _outside("MPIDIST_TRAIN_EPOCHS", "12 (train.sbatch), 10 (ps.sbatch)", "slurm/train.sbatch, slurm/ps.sbatch",
             "Epochs of `mpidist train`."),
    _outside("MPIDIST_TRAIN_ARGS", "", "slurm/train.sbatch, slurm/ps.sbatch", "More arguments for `mpidist train`."),
    _outside("MPIDIST_PS_MODE", "async", "slurm/ps.sbatch", "The parameter server's update rule: sync, async, softsync."),
    _outside("MPIDIST_BENCH_COLLECTIVES", "allreduce", "slurm/bench.sbatch", "Collectives to sweep, comma-separated."),
    _outside("MPIDIST_BENCH_SIZES", "1K,4K,16K,64K,256K,1M,4M,16M,64M", "slurm/bench.sbatch",
             "Message sizes, passed to --sizes."),
    _outside("MPIDIST_BENCH_ALGORITHMS", "all of them", "slurm/bench.sbatch", "Passed to --algorithms when set."),
    _outside("MPIDIST_BENCH_ARGS", "", "slurm/bench.sbatch", "More arguments for `mpidist bench`."),
    _outside("MPIDIST_SLURM_DIR", "/tmp/mpidist-slurm", "slurm/local-cluster.sh", "State, config and logs of the local cluster."),
    _outside("MPIDIST_SLURM_MIN_CPUS", "4", "slurm/local-cluster.sh", "CPUs the local node advertises, at least."),
    _outside("MPIDIST_SLURM_PORT", "6817", "slurm/local-cluster.sh", "slurmctld's port; slurmd uses the next one."),
    _outside("MPIDIST_SLURM_TIMEOUT", "60", "slurm/local-cluster.sh", "Seconds `up` waits for the node."),
    _outside("MPIDIST_TEST_TIMEOUT", "600", "slurm/test-scripts.sh", "Seconds to wait for all test jobs together."),
    _outside("MPIDIST_TEST_KEEP_CLUSTER", "0", "slurm/test-scripts.sh", "1: leave the local cluster up at exit."),
    _outside("MPIDIST_TESTS_TMP", "made per run", "tests/conftest.py",
             "The test run's temporary directory, handed to the ranks' test sessions."),
    _outside("MPIDIST_TESTS_SHARED_LAUNCH", "unset", "tests/mpi_shared_launch.py",
             "Set in the ranks of a module's shared launch: the tests it runs, one after another."),
)
_READ_BY_PACKAGE = {variable.name: variable for variable in VARIABLES if variable.reader == "mpidist"}


def value(name: str):
    """The value of the MPIDIST_* variable `name`, parsed by its kind; its default when unset or
    empty. A malformed value raises InvalidArgumentError naming the variable."""
    variable = _READ_BY_PACKAGE[name]
    if variable.kind == "number":
        return env_number(name, variable.default, float, variable.minimum)
    if variable.kind == "count":
        return env_number(name, variable.default, int, variable.minimum)
    text = os.environ.get(name, "").strip()
    if not text:
        return os.path.expanduser(variable.default) if variable.kind == "path" and variable.default else variable.default
    if variable.kind == "flag":
        word = text.lower()
        if word not in TRUE_WORDS + FALSE_WORDS:
            raise InvalidArgumentError(f"environment variable {name}={text!r} must be 1 or 0 (also yes/no, true/false, "
                                       f"on/off; unset it for the default, {variable.default})")
        return word in TRUE_WORDS
    if variable.kind == "text" and text == "auto":
        return variable.default
    return text


def env_number(name: str, default, kind=int, minimum=0):
    """The number in environment variable `name` (`default` when unset or empty); anything that
    is not a number of `kind` >= `minimum` is refused with the variable's name, not a bare
    ValueError from deep inside an import. Also for variables of other programs mpidist honours
    (Horovod's HOROVOD_FUSION_THRESHOLD)."""
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        number = kind(text)
    except ValueError:
        number = None
    if number is None or not number >= minimum:  # `not >=` also refuses a float nan
        if kind is int:
            what = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        else:
            what = f"a number >= {minimum}"
        raise InvalidArgumentError(f"environment variable {name}={text!r} must be {what} "
                                   f"(unset it for the default, {default})")
    return number


def documentation() -> str:
    """VARIABLES as a Markdown table (for the docs)."""
    rows = ["| Variable | Default | Read by | When | Meaning |", "|---|---|---|---|---|"]
    for variable in VARIABLES:
        default = "unset" if variable.default is None else variable.default
        if variable.kind == "flag" and isinstance(default, bool):
            default = int(default)
        rows.append(f"| `{variable.name}` | {default} | {variable.reader} | {variable.read} | {variable.meaning} |")
    return "\n".join(rows)
