"""Every environment variable mpidist, its build, its scripts and its tests read: its default, its
meaning, when it is read, and the one way to read it (value()).

VARIABLES lists them all, including those read by setup.py (the build) and by the SLURM scripts
(slurm/), which cannot import mpidist. The tables of docs/environment.md are made from it
(documentation(), `python -m mpidist.runtime.config docs/environment.md`), and a test keeps them
equal. value(name) reads one of the variables the package itself reads; malformed values are
refused with an InvalidArgumentError that names the variable. Values are read when asked for, so
a program may set them between `import mpidist` and the moment they are used (see each one's
"read" column).
"""
from __future__ import annotations

import dataclasses
import os
import sys

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
    read: str  # when it is read, or by which script
    meaning: str  # Markdown, relative to docs/
    section: str  # the docs' table it is listed in (SECTIONS)
    shown_default: str  # the default as the docs show it
    reader: str = "mpidist"  # who reads it: the package ("mpidist"), setup.py, a script or the tests


# The tables of docs/environment.md, in page order: section -> heading.
SECTIONS = {
    "library": "The library",
    "horovod": "Horovod variables (`mpidist.torch`)",
    "build": "Building (`setup.py`)",
    "slurm": "SLURM scripts (`slurm/`)",
    "local-cluster": "The local test cluster (`slurm/local-cluster.sh`, `slurm/test-scripts.sh`)",
    "multinode": "The emulated nodes (`tests/multinode/cluster.sh`, docs/multinode.md)",
    "tests": "The tests",
}


def _package(name, kind, default, shown_default, read, meaning, minimum=0, section="library", reader="mpidist"):
    return Variable(name, kind, default, minimum, read, meaning, section, shown_default, reader)


def _outside(name, shown_default, reader, meaning, section):
    return Variable(name, "text", None, 0, f"by `{reader}`", meaning, section, shown_default, reader)


VARIABLES = (
    _package("MPIDIST_ALLREDUCE_ALGORITHM", "text", None, "unset (`auto` chooses)", "when a Communicator is made",
             "force the algorithm `algorithm=\"auto\"` runs (`ring`, `tree`, `recursive_halving`, "
             "`recursive_doubling`, `reduce_bcast`, `hierarchical`, `mpi`); an explicit `algorithm=` in a call "
             "still wins"),
    _package("MPIDIST_TUNING_FILE", "path", os.path.join("~", ".cache", "mpidist", "tuning.json"),
             "`~/.cache/mpidist/tuning.json`", "when a Communicator is made, and by `mpidist tune`",
             "the decision tables and the fitted [cost model](cost-model.md) `mpidist tune` writes and `auto` "
             "reads (rank 0 reads it and broadcasts it; the built-in table when the file does not exist, and, "
             "with a warning naming the problem, when it is malformed: [what is checked]"
             "(data-checkpoints.md#files-from-elsewhere-are-checked-before-they-are-trusted))"),
    _package("MPIDIST_CHECK", "flag", True, "`1`", "when a Communicator is made",
             "`0` skips the per-call [cross-rank signature check](collectives.md#the-cross-rank-call-check) (one "
             "small allgather per call, or on one node a comparison in the node window, which a small "
             "all-reduce there shares); a refused rank then leaves the others waiting `MPIDIST_TIMEOUT`"),
    _package("MPIDIST_TIMEOUT", "number", 300.0, "`300` (seconds)", "at every wait",
             "how long a rank waits for a peer: a rank that never joins a collective, a pipeline neighbour or "
             "parameter-server peer that never answers, a gradient bucket, an `hvd.join` announcement, a "
             "checkpoint saved by one rank alone; then the wait becomes a `DeadlineError` naming the silent peer "
             "([Errors](errors.md))"),
    _package("MPIDIST_ABORT_ON_EXCEPTION", "flag", True, "`1`", "by `md.init()`",
             "an uncaught exception on one rank prints its traceback, then aborts the whole job (`MPI_Abort`, as "
             "`python -m mpi4py` does) instead of leaving the other ranks waiting `MPIDIST_TIMEOUT`; `0` keeps "
             "Python's own behaviour, for programs that handle their ranks' failures themselves "
             "([Faults](faults.md)). Nothing changes in a world of one rank"),
    _package("MPIDIST_FINALIZE_TIMEOUT", "number", 5.0, "`5` (seconds)", "at exit, after a rank of the job died",
             "in a fault-tolerant run (`mpirun --with-ft ulfm`) in which a rank died, a survivor whose `MPI_Finalize` "
             "has not returned after this long at exit ends without it, with the exit status its program was "
             "going to return: Open MPI's `MPI_Finalize` sometimes never returns after a death "
             "([Elastic training](elastic.md#leaving-the-job))", minimum=0.1),
    _package("MPIDIST_EXIT_ON_RANK_LOSS", "count", 0, "`0` (the program's own status)",
             "by `md.init()` under ULFM (checked), and at exit",
             "in a fault-tolerant run that lost a rank and went on ([elastic training](elastic.md#the-summary-at-the-end), "
             "a [parameter server](parameter-server.md#when-a-rank-dies)), the exit status (1 to 255) of the ranks "
             "that know of the loss, after the summary line at the end, so that the batch system sees it; `0` "
             "leaves the status to the program (0 when it did its work)"),
    _package("MPIDIST_STALL_WARNING", "number", 60.0, "`60` (seconds)", "at every collective wait",
             "a rank that has waited this long in a collective prints a stall report: which ranks have not "
             "arrived and what each last called ([Faults](faults.md#stall-report)); the wait goes on until "
             "`MPIDIST_TIMEOUT`"),
    _package("MPIDIST_TIMELINE", "path", None, "unset", "by `md.init()`",
             "rank 0 writes a Chrome trace (Horovod's timeline) of every collective and gradient bucket "
             "all-reduce to this path ([Horovod](horovod.md#timeline))"),
    _package("MPIDIST_SEGMENT_BYTES", "count", 256 * 1024, "`262144` (256 KiB)", "at import of the collectives",
             "segment size of the pipelined ring and tree all-reduce: the reduction of one segment overlaps the "
             "arrival of the next", minimum=1),
    _package("MPIDIST_BCAST_SCATTER_BYTES", "count", 512 * 1024, "`524288` (512 KiB)", "at import of the collectives",
             "broadcasts of at least this many bytes over more than 2 ranks use scatter + ring allgather instead "
             "of the binomial tree"),
    _package("MPIDIST_RANKS_PER_NODE", "count", None, "unset (the real nodes)", "when a Communicator is made",
             "make groups of N consecutive ranks act as separate nodes (to try the hierarchical and node-aware "
             "paths on one machine)", minimum=1),
    _package("MPIDIST_DEVICE_WINDOW", "flag", None, "used where the node's ranks can share GPU memory",
             "at the first collective of a GPU buffer on a Communicator",
             "`0`: CUDA buffers on one node take the staged route (host memory) instead of the node window in GPU "
             "memory (CUDA IPC; `hierarchical`, broadcast, allgather, reduce-scatter)"),
    _package("MPIDIST_CUDA_AWARE", "flag", None,
             "detected ([the library's answer](cluster.md#gpu-memory-and-the-mpi-library)), then probed",
             "at the first GPU buffer of a Communicator",
             "`1`: hand GPU buffers to MPI directly, without the probe; `0`: stage them through pinned host memory "
             "(the way out when the probe of a detected library fails)"),
    _package("MPIDIST_NCCL_LIBRARY", "path", None,
             "unset (the nvidia-nccl wheel's, else the loader's `libnccl.so.2`)", "at the first NCCL call, by `mpidist info`",
             "the NCCL library (`libnccl.so.2`) of `algorithm=\"nccl\"` and the NCCL lane between nodes, e.g. the "
             "`.nccl/lib/libnccl.so.2` of [`make nccl`](gpu-check.md#a-small-nccl); a missing file, a "
             "library that is not NCCL, or NCCL older than 2.30 is refused on every rank with the reason"),
    _package("MPIDIST_GPU_LANE", "text", None, "`auto`", "at the first GPU buffer of a Communicator across nodes",
             "the lane between nodes of CUDA buffers' `auto` and `hierarchical` all-reduce ([GPU "
             "training](gpu-training.md#between-nodes)): `nccl`, `cuda-aware` (MPI reading GPU memory; both with "
             "the device window inside each node), `staged` (all through host memory); `auto` takes the first of "
             "them every rank can use. A lane forced but not usable is an error on every rank, naming the ranks "
             "and why"),
    *(_package(name, "text", None, "unset", "at the first GPU buffer (detection)", meaning, reader="the MPI library")
      for name, meaning in (
          ("OMPI_MCA_opal_cuda_support", "Open MPI 4 built with CUDA: `0` turns its CUDA support off"),
          ("OMPI_MCA_accelerator", "Open MPI 5: a list without `cuda` turns its CUDA support off"),
          ("UCX_TLS", "UCX's transports: a list without `cuda_copy`/`cuda_ipc` keeps Open MPI over UCX from GPU "
                      "memory"),
          ("MPIR_CVAR_ENABLE_GPU", "MPICH: `0` turns its GPU support off"),
          ("MPICH_GPU_SUPPORT_ENABLED", "Cray MPICH: `1` turns its GPU support on"),
          ("MV2_USE_CUDA", "MVAPICH2(-GDR): `1` turns its GPU support on"),
          ("I_MPI_OFFLOAD", "Intel MPI: `1` turns its GPU support on"))),
    _package("MPIDIST_EAGER_ON_NODE", "flag", True, "`1`", "when a torch.distributed process group is made",
             "a [torch.distributed](distributed-backend.md#asynchronous-operations) collective with `async_op=True` "
             "on CPU tensors, in a group whose ranks share one node, runs at once on the caller's thread (its Work "
             "is complete when returned) instead of on the group's background thread, which would only take CPU "
             "time from the ranks' computation; `0` queues it on the background thread"),
    _package("MPIDIST_KEEP_FREED_MEMORY", "flag", True, "`1`", "when DataParallel or hvd's optimizer starts",
             "`0` leaves glibc's malloc settings alone (by default `DataParallel` and `hvd.DistributedOptimizer` "
             "keep freed CPU memory for the next step, see [Data-parallel training](data-parallel.md))"),
    _package("MPIDIST_DATA_DIR", "path", None, "`data/` of the source checkout, else `./data`",
             "when the digits data set is looked for",
             "where `mpidist train` and `mpidist prepare-data` keep `digits.h5`"),
    _package("OMP_NUM_THREADS", "count", None, "cores / ranks on the node", "at the first kernel call",
             "threads of the extension's CPU kernels (once a call touches 65,536 elements over its arrays); "
             "`mpidist.kernels.set_num_threads(n)` overrides it", minimum=1, reader="mpidist._C"),
    _package("OMPI_MCA_osc", "text", "^ucx", "set to `^ucx` when unset", "at `import mpidist`",
             "Open MPI's one-sided components. mpidist sets it before MPI starts: the UCX component prints an "
             "error at the first shared-memory window when no UCX network is present, and the hierarchical "
             "all-reduce needs only the shared-memory component. On a cluster whose own RMA code needs UCX "
             "windows, set it yourself", reader="Open MPI"),
    _package("HOROVOD_FUSION_THRESHOLD", "count", 25 * 2 ** 20, "`26214400` (25 MiB)",
             "when `hvd.DistributedOptimizer` is made; at each hvd operation (rank 0's decides the fusion)",
             "`hvd.DistributedOptimizer`'s bucket size in bytes (`0`: a bucket per gradient, Horovod's \"no "
             "fusion\"); on the shared-memory path on one node buckets hold at most 4 MB. Also the most bytes "
             "of hvd all-reduces ready in one negotiation cycle that are fused into one buffer (`0`: none)",
             section="horovod"),
    _package("HOROVOD_CYCLE_TIME", "number", 1.0, "`1` (milliseconds)", "when hvd's negotiation starts",
             "the time between the starts of two negotiation cycles of hvd's operations, in milliseconds; while "
             "no rank has anything to negotiate the pause grows to 250 ms, and a submit ends it at once (see "
             "[Horovod compatibility](horovod.md))", section="horovod"),
    _package("HOROVOD_TIMELINE", "path", None, "unset", "by the first `hvd.init()`",
             "rank 0 writes a Chrome trace of the collectives to this path (`DYNAMIC`: wait for "
             "`hvd.start_timeline`)", section="horovod"),
    _outside("MPIDIST_CUDA", "`auto` (CUDA when `nvcc` is found)", "setup.py",
             "`1`: build the CUDA kernels or fail; `0`: build the extension CPU-only", "build"),
    _outside("MPIDIST_CUDA_ARCHS", "sm_75 to sm_90 (+ sm_70 with CUDA < 13), plus PTX of the newest", "setup.py",
             "GPU architectures to compile for, e.g. `\"80;90\"`; one the installed nvcc cannot build is refused "
             "by name", "build"),
    _outside("CUDA_HOME", "unset", "setup.py", "where to find `nvcc` (else `CUDA_PATH`, `PATH`, `/usr/local/cuda`)",
             "build"),
    _outside("MPIDIST_ROOT", "`$SLURM_SUBMIT_DIR`", "slurm/common.sh",
             "the repository, when submitting from elsewhere (also put first on `PYTHONPATH`)", "slurm"),
    _outside("MPIDIST_PYTHON", "`.venv/bin/python` of the repository, else `python3`", "slurm/common.sh",
             "the Python every rank runs", "slurm"),
    _outside("MPIDIST_LAUNCHER", "`srun`", "slurm/common.sh", "`srun` or `mpirun`", "slurm"),
    _outside("MPIDIST_SRUN_MPI", "`pmix`", "slurm/common.sh", "the `srun --mpi=` value", "slurm"),
    _outside("MPIDIST_SRUN_ARGS", "empty", "slurm/common.sh", "extra `srun` arguments", "slurm"),
    _outside("MPIDIST_MPIRUN", "the `mpirun` beside `MPIDIST_PYTHON`, else the one on `PATH`", "slurm/common.sh",
             "which mpirun", "slurm"),
    _outside("MPIDIST_MPIRUN_ARGS", "empty (`--bind-to none` under `test-scripts.sh`)", "slurm/common.sh",
             "extra `mpirun` arguments", "slurm"),
    _outside("RESULTS_DIR", "`runs/$SLURM_JOB_ID` of the repository", "slurm/common.sh",
             "where the job writes its results", "slurm"),
    _outside("MPIDIST_BENCH_COLLECTIVES", "`allreduce`", "slurm/bench.sbatch", "collectives to sweep, comma-separated",
             "slurm"),
    _outside("MPIDIST_BENCH_SIZES", "`1K,4K,16K,64K,256K,1M,4M,16M,64M`", "slurm/bench.sbatch", "message sizes",
             "slurm"),
    _outside("MPIDIST_BENCH_ALGORITHMS", "all", "slurm/bench.sbatch", "passed to `--algorithms`", "slurm"),
    _outside("MPIDIST_BENCH_ARGS", "empty", "slurm/bench.sbatch", "more `mpidist bench` arguments", "slurm"),
    _outside("MPIDIST_TRAIN_MODE", "`data`", "slurm/train.sbatch", "`data` or `pipeline`", "slurm"),
    _outside("MPIDIST_TRAIN_EPOCHS", "`12` (`train.sbatch`), `10` (`ps.sbatch`)", "slurm/train.sbatch, slurm/ps.sbatch",
             "epochs", "slurm"),
    _outside("MPIDIST_TRAIN_ARGS", "empty", "slurm/train.sbatch, slurm/ps.sbatch",
             "more `mpidist train` arguments (`--resume`, `--compression bf16`, `--replicas=2`, ...)", "slurm"),
    _outside("MPIDIST_TRAIN_REQUEUE", "`1`", "slurm/train.sbatch",
             "`1`: after `mpidist train` stopped on SLURM's signal before the time limit, requeue the job, which "
             "continues with `--resume` ([Faults](faults.md#walltime-on-slurm)); `0`: end it there", "slurm"),
    _outside("MPIDIST_PS_MODE", "`async`", "slurm/ps.sbatch",
             "the server's update rule, `sync`, `async` or `softsync`", "slurm"),
    _outside("MPIDIST_PS_SERVERS", "`1`", "slurm/ps.sbatch",
             "server tasks (the first ones), the model partitioned over them (`--servers`)", "slurm"),
    _outside("MPIDIST_SLURM_NODES", "`1` (`slurm/test-scripts.sh`: `2`)", "slurm/local-cluster.sh",
             "nodes of the local cluster: `1` is this machine, more are emulated nodes with a slurmd each", "local-cluster"),
    _outside("MPIDIST_SLURM_DIR", "`/tmp/mpidist-slurm`", "slurm/local-cluster.sh",
             "state, configuration and logs of the local cluster", "local-cluster"),
    _outside("MPIDIST_SLURM_MIN_CPUS", "`4`", "slurm/local-cluster.sh", "CPUs the node advertises, at least",
             "local-cluster"),
    _outside("MPIDIST_SLURM_PORT", "`6817`", "slurm/local-cluster.sh", "slurmctld's port; slurmd uses the next one",
             "local-cluster"),
    _outside("MPIDIST_SLURM_TIMEOUT", "`60` (seconds)", "slurm/local-cluster.sh", "how long `up` waits for the node",
             "local-cluster"),
    _outside("MPIDIST_TEST_TIMEOUT", "`600` (seconds)", "slurm/test-scripts.sh",
             "how long it waits for all jobs together", "local-cluster"),
    _outside("MPIDIST_TEST_KEEP_CLUSTER", "`0`", "slurm/test-scripts.sh", "`1` leaves the cluster up at exit",
             "local-cluster"),
    _outside("MPIDIST_MN_NODES", "`2`", "tests/multinode/cluster.sh", "number of emulated nodes", "multinode"),
    _outside("MPIDIST_MN_SLOTS", "`2`", "tests/multinode/cluster.sh", "ranks per node in the hostfile", "multinode"),
    _outside("MPIDIST_MN_RATE", "`10gbit`", "tests/multinode/cluster.sh", "every node's link rate (`tc` units)",
             "multinode"),
    _outside("MPIDIST_MN_DELAY", "`25us`", "tests/multinode/cluster.sh",
             "every node's one-way delay (`netem`; not applied where the kernel lacks it)", "multinode"),
    _outside("MPIDIST_MN_SUBNET", "`10.231.7`", "tests/multinode/cluster.sh",
             "the first three octets of the nodes' addresses (this machine: `.254`)", "multinode"),
    _outside("MPIDIST_MN_DIR", "`/tmp/mpidist-multinode`", "tests/multinode/cluster.sh",
             "state: hostfile, hosts, the nodes' pid files; also read by `node-agent.sh`", "multinode"),
    _outside("MPIDIST_MN_HOST_ADDR", "set by `cluster.sh env`", "slurm/local-cluster.sh",
             "this machine's address on the nodes' bridge", "multinode"),
    _outside("MPIDIST_MN_NODE_NAMES", "set by `cluster.sh env`", "slurm/local-cluster.sh",
             "the nodes' names as a Slurm host list", "multinode"),
    _outside("MPIDIST_MN_NODE_ADDRS", "set by `cluster.sh env`", "slurm/local-cluster.sh",
             "the nodes' addresses, comma-separated", "multinode"),
    _outside("MPIDIST_TESTS_TMP", "made per run", "tests/conftest.py",
             "the test run's temporary directory, handed to the ranks' test sessions", "tests"),
    _outside("MPIDIST_TESTS_SHARED_LAUNCH", "unset", "tests/mpi_shared_launch.py",
             "set in the ranks of a module's shared launch: the tests it runs, one after another", "tests"),
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
    ValueError from deep inside an import."""
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


def documentation(section: str) -> str:
    """The Markdown table of one section of docs/environment.md (SECTIONS)."""
    rows = ["| variable | default | read | meaning |", "|---|---|---|---|"]
    rows += [f"| `{v.name}` | {v.shown_default} | {v.read} | {v.meaning} |" for v in VARIABLES if v.section == section]
    return "\n".join(rows)


def table_marker(section: str) -> str:
    """The line before a generated table in docs/environment.md."""
    return f"<!-- generated by `python -m mpidist.runtime.config docs/environment.md`: {section} -->"


def with_tables(page: str) -> str:
    """`page` with the table after each section's marker replaced by documentation(section)."""
    lines, out, skipping = page.split("\n"), [], False
    for line in lines:
        if skipping and line.startswith("|"):
            continue
        skipping = False
        out.append(line)
        for section in SECTIONS:
            if line == table_marker(section):
                out.append(documentation(section))
                skipping = True
    return "\n".join(out)


if __name__ == "__main__":  # rewrite the tables of the page named on the command line
    with open(sys.argv[1]) as handle:
        text = handle.read()
    with open(sys.argv[1], "w") as handle:
        handle.write(with_tables(text))
