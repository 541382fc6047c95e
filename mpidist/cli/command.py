"""The `mpidist` command's argument parser and dispatch: info, bench (collective micro-benchmarks),
tune (auto's table), train and prepare-data; only `train` imports torch."""
from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import sys

import numpy as np

from .. import __version__, init, is_initialized
from ..collectives import read_tuning_file, save_tuning_table
from ..data import default_digits_path, prepare_digits
from ..errors import DeadlineError, MpidistError
from ..launch import detect, launcher_place
from ..runtime import abort_job, note_exit_status
from . import bench, bench_plot
from . import tune as tuning
from .info import collect, format_report

# train is imported when its command runs: it needs torch, whose import takes seconds.


def cmd_info(args) -> int:
    comm = init()
    facts = collect(comm)
    if comm.rank == 0:
        print(json.dumps(facts, indent=2) if args.json else format_report(facts), flush=True)
    return 0


def add_prepare_data_command(subparsers) -> None:
    parser = subparsers.add_parser(
        "prepare-data", help="write the embedded handwritten-digits data set to HDF5",
        description="Convert scikit-learn's digits (shipped with scikit-learn, no download) to HDF5.")
    parser.add_argument("--path", default=None,
                        help="output file (default: $MPIDIST_DATA_DIR/digits.h5, else data/digits.h5)")
    parser.add_argument("--force", action="store_true", help="rewrite the file if it exists")
    parser.set_defaults(run=cmd_prepare_data)


def cmd_prepare_data(args) -> int:
    path = args.path or default_digits_path()
    if args.force or not os.path.exists(path):
        prepare_digits(path)
        print(f"wrote {path}", flush=True)
    else:
        print(f"{path} exists (--force rewrites it)", flush=True)
    return 0


# What a command imports beyond mpidist's own dependencies (setup.py's install_requires): by
# module, the package that provides it and mpidist's extra that installs it.
OPTIONAL_PACKAGES = {"torch": ("torch", "torch"), "sklearn": ("scikit-learn", "data"), "matplotlib": ("matplotlib", "bench")}


def importable(module: str) -> bool:
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


def report_missing_packages(comm, command: str, modules) -> bool:
    """Collective: whether some rank cannot import one of `modules` (keys of OPTIONAL_PACKAGES).
    Rank 0 names each missing package once, with the pip command that installs it, instead of a
    ModuleNotFoundError traceback from every rank."""
    lacking = np.array([not importable(module) for module in modules], dtype=np.int64)
    comm.allreduce(lacking, op="sum")
    lines = [f"mpidist: error: mpidist {command} needs {OPTIONAL_PACKAGES[module][0]} ({ranks} of {comm.size} ranks "
             f"cannot import {module}): pip install 'mpidist[{OPTIONAL_PACKAGES[module][1]}]'"
             for module, ranks in zip(modules, lacking) if ranks]
    if lines:
        report_once("\n".join(lines))
    return bool(lines)


def cmd_train(args) -> int:
    # SLURM's signal before the time limit (stopping.py) is caught from here, not after the
    # seconds of torch's import: a signal that came meanwhile would end the process.
    from .stopping import GracefulStop
    stop = GracefulStop()
    # scikit-learn makes the digits file when it is missing (mpidist.data.prepare_digits).
    makes_digits = args.model == "mlp" and not os.path.exists(args.data or default_digits_path())
    if report_missing_packages(init(), "train", ["torch"] + (["sklearn"] if makes_digits else [])):
        return 2
    from .train import cmd_train as train
    return train(args, stop)


def bench_options(args, collective):
    return bench.Options(collective=collective, sizes=args.sizes, dtypes=args.dtype,
                   algorithms=[a.strip() for a in args.algorithms.split(",")] if args.algorithms else None,
                   iters=args.iters, warmup=args.warmup, check_calls=args.check,
                   device=getattr(args, "device", "cpu"))


def cmd_bench(args) -> int:
    comm = init()
    # Checked before the measurement, not at its end: torch makes the inputs, matplotlib the plot.
    if report_missing_packages(comm, "bench", ["torch"] + (["matplotlib"] if args.plot else [])):
        return 2
    rows = bench.run(comm, bench_options(args, args.collective))
    if comm.rank == 0:
        if args.json:
            bench.write_json(rows, args.json)
        if args.plot:
            bench_plot.plot(rows, args.plot, title=f"mpidist bench {args.collective}, {comm.size} ranks")
    return 0 if all(row["wrong"] == 0 for row in rows) else 1


def cmd_tune(args) -> int:

    comm = init()
    if report_missing_packages(comm, "tune", ["torch"]):
        return 2
    tuned = tuning.tune(comm, bench_options(args, "allreduce"))
    if comm.rank == 0:
        # The cost model is fitted to these times with the layout they were taken on.
        path = save_tuning_table(tuned.table, comm.size, args.output, tuned.measurements,
                                 ranks_per_node=-(-comm.size // comm.num_nodes),
                                 one_shot_bytes=tuned.one_shot_bytes)
        print(f"# wrote the {comm.size}-rank table to {path}: {json.dumps(tuned.table)}", flush=True)
        if tuned.one_shot_bytes is not None:
            print(f"# the node window's one-shot all-reduce up to {tuned.one_shot_bytes} bytes", flush=True)
        parameters = read_tuning_file(path)["model"]["parameters"]
        print(f"# cost model parameters (seconds per call, message, byte): {json.dumps(parameters)}", flush=True)
    return 0


def size_list(text: str) -> list[int]:
    try:
        return bench.parse_sizes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def dtype_list(text: str) -> list[str]:
    # Unknown names are refused with the other measurement options (bench.refusal).
    return [name.strip() for name in text.split(",") if name.strip()]


def add_measurement_options(parser, sizes: str, default_dtype: str = "float32") -> None:
    parser.add_argument("--sizes", default=sizes, type=size_list,
                        help="comma-separated message sizes in bytes, K/M/G suffixes allowed (default %(default)s)")
    parser.add_argument("--dtype", default=default_dtype, type=dtype_list, help="comma-separated dtypes (default %(default)s)")
    parser.add_argument("--iters", type=int, default=None,
                        help="timed iterations per case (default: 1000 up to 8K, 200 up to 64K, 50 up to 1M, 20 above)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed iterations first (default iters/10, >= 2)")
    parser.add_argument("--check", action=argparse.BooleanOptionalAction, default=False,
                        help="keep the per-call cross-rank signature check on (default off, as in training "
                             "loops that set MPIDIST_CHECK=0)")


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a positive finite number, got {text}")
    return value


def add_train_command(subparsers) -> None:
    parser = subparsers.add_parser("train", help="training on the embedded digits data or on synthetic clicks "
                                                 "(data parallel, parameter server or pipeline)")
    parser.add_argument("--mode", choices=["data", "ddp", "ps", "pipeline"], default="data",
                        help="data parallel, torch's DDP over the mpidist backend, a parameter server on rank 0, "
                             "or a pipeline of one stage per rank")
    parser.add_argument("--model", choices=["mlp", "embedding"], default="mlp",
                        help="mlp: an MLP on the digits; embedding: a bag-of-embeddings click model on synthetic "
                             "Zipf-distributed ids, its table going by rows under --mode ps (default mlp)")
    parser.add_argument("--embedding-rows", type=positive_int, default=None,
                        help="--model embedding: rows of the embedding table (default 100000)")
    parser.add_argument("--ps-mode", choices=["sync", "async", "softsync"], default=None,
                        help="--mode ps: the server's update rule (default async)")
    parser.add_argument("--softsync", type=positive_int, default=None, help="--ps-mode softsync: n")
    parser.add_argument("--max-staleness", type=int, default=None, help="--mode ps: bounded staleness (steps)")
    parser.add_argument("--staleness-lr", action="store_true", help="--mode ps: learning rate / staleness")
    parser.add_argument("--servers", type=positive_int, default=None,
                        help="--mode ps: server ranks (0 .. k-1), the model partitioned over them (default 1)")
    parser.add_argument("--chunks", type=positive_int, default=None,
                        help="--mode pipeline: micro-batches per batch (default 4)")
    parser.add_argument("--schedule", choices=["1f1b", "gpipe"], default=None,
                        help="--mode pipeline: the schedule (default 1f1b)")
    parser.add_argument("--replicas", type=positive_int, default=None,
                        help="--mode pipeline: pipelines side by side, averaging their gradients (default 1)")
    parser.add_argument("--epochs", type=positive_int, default=12)
    parser.add_argument("--batch-size", type=positive_int, default=32,
                        help="per rank (--mode pipeline: per batch, which every stage sees)")
    parser.add_argument("--lr", type=positive_float, default=0.05)
    parser.add_argument("--compression", default="none",
                        help="--mode data: none, fp16, bf16, int8, powersgd:<rank> or topk:<fraction> "
                             "(docs/compression.md)")
    parser.add_argument("--zero", action="store_true",
                        help="--mode data: shard the optimizer state over the ranks (md.ZeroRedundancyOptimizer)")
    parser.add_argument("--algorithm", default="auto")
    parser.add_argument("--checkpoint-dir", default="checkpoints")
    parser.add_argument("--resume", nargs="?", const=True, default=False, choices=["auto"], metavar="auto",
                        help="continue from the latest checkpoint in --checkpoint-dir, which must hold one; "
                             "--resume=auto: from it if there is one, else from scratch (a requeued job's first run)")
    parser.add_argument("--elastic", action="store_true",
                        help="--mode data and ps: go on on the surviving ranks when one dies (launch with "
                             "`mpirun --with-ft ulfm`; see docs/elastic.md)")
    parser.add_argument("--data", default=None, help="digits HDF5 file (made if missing)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-progress", action="store_true", help="show no progress during an epoch")
    parser.add_argument("--progress-seconds", type=positive_float, default=30.0,
                        help="where standard error is not a terminal (a batch job's log): seconds between the "
                             "plain progress lines that stand in for the progress bar (default %(default)s)")
    parser.set_defaults(run=cmd_train)


def report_once(message: str) -> None:
    """Print `message`, an error that every rank met alike, once: on rank 0's standard error. Under
    a launcher the other ranks wait until rank 0 has printed it: when one rank exits with an error
    first, mpirun ends the others, rank 0 included, perhaps before it printed."""
    if detect().size == 1:
        print(message, file=sys.stderr, flush=True)
        return
    comm = init()
    if comm.rank == 0:
        print(message, file=sys.stderr, flush=True)
    comm.barrier()


class CommandParser(argparse.ArgumentParser):
    """argparse's parser, whose usage errors every rank meets alike: printed once, exit status 2
    as argparse's, before MPI starts. `check`: a function of the parsed arguments that returns
    the usage error of arguments that are wrong together (a size against a dtype), or None."""

    def __init__(self, *args, check=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.check = check

    def parse_known_args(self, args=None, namespace=None):
        namespace, extras = super().parse_known_args(args, namespace)
        problem = self.check(namespace) if self.check else None
        if problem:
            self.error(problem)
        return namespace, extras

    def error(self, message):
        usage_error = f"{self.format_usage()}{self.prog}: error: {message}"
        if is_initialized():
            report_once(usage_error)
            sys.exit(2)
        # MPI is not started for a usage error, so the launcher's rank says who prints it. The
        # other ranks leave with status 0: a rank that ended with an error first would have
        # mpirun end rank 0, perhaps before it printed; the job's status is rank 0's.
        if launcher_place().get("RANK", 0) != 0:
            sys.exit(0)
        print(usage_error, file=sys.stderr, flush=True)
        sys.exit(2)


def measurement_refusal(args) -> str | None:
    """bench.refusal of the measurement `args` ask for (`mpidist tune`: all-reduce's)."""
    return bench.refusal(bench_options(args, getattr(args, "collective", "allreduce")))


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(prog="mpidist", description="MPI-based HPC training for PyTorch")
    parser.add_argument("--version", action="version", version=f"mpidist {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="versions, MPI library, CUDA support, ranks and nodes")
    info.add_argument("--json", action="store_true", help="print the facts as JSON")
    info.set_defaults(run=cmd_info)

    bench_parser = sub.add_parser("bench", help="collective micro-benchmarks (nccl-tests style table, JSON, plot)",
                                  check=measurement_refusal)
    bench_parser.add_argument("collective", choices=bench.COLLECTIVES)
    add_measurement_options(bench_parser, bench.DEFAULT_SIZES)
    bench_parser.add_argument("--algorithms", default=None,
                       help="comma-separated algorithms (default: all of mpidist's plus the peers mpi and gloo; for an "
                            "all-reduce on one node also the bound, bench_bound.py)")
    bench_parser.add_argument("--json", metavar="FILE", help="write the rows as JSON to FILE")
    bench_parser.add_argument("--plot", metavar="FILE.png", help="plot busbw against size to FILE.png")
    bench_parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                              help="cuda: all-reduce on each rank's GPU, by route (docs/gpu-training.md)")
    bench_parser.set_defaults(run=cmd_bench)

    tune = sub.add_parser("tune", help="measure the all-reduce algorithms here and write auto's decision table",
                          check=measurement_refusal)
    add_measurement_options(tune, tuning.TUNE_SIZES)
    tune.add_argument("--output", default=None,
                      help="table file (default: $MPIDIST_TUNING_FILE or ~/.cache/mpidist/tuning.json); "
                           "other rank counts already in it are kept")
    tune.set_defaults(run=cmd_tune, algorithms=None)
    add_train_command(sub)
    add_prepare_data_command(sub)
    return parser


def main(argv=None) -> int:
    status = run_command(build_parser().parse_args(argv))
    # The status MPI_Finalize's time limit after a death leaves with (runtime/leave.py).
    note_exit_status(status)
    return status


def run_command(args) -> int:
    try:
        return args.run(args)
    except MpidistError as exc:
        if getattr(exc, "on_every_rank", False):
            report_once(f"mpidist: error: {exc}")
        else:
            print(f"mpidist: error: {exc}", file=sys.stderr, flush=True)
        if isinstance(exc, DeadlineError):
            # The silent rank may be frozen or stuck, not gone: this rank's MPI_Finalize would wait
            # for it forever, so the job ends here, as an uncaught exception ends it.
            abort_job(2)
        return 2

