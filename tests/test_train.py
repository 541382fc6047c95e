"""`mpidist train`, the main job, started the way users start it: mpirun -np 2 mpidist train."""
import json
import os
import re
import shutil
from typing import NamedTuple

import pytest
from conftest import run_python

TRAIN = "from mpidist.cli import main; raise SystemExit(main({args!r}))"


def train(directory, *extra, data, ranks=2):
    """`mpidist train` on `ranks` ranks (0: one process, no mpirun), checkpoints in directory/ck,
    digits from `data`; returns its output."""
    args = ["train", "--no-progress", "--checkpoint-dir", str(directory / "ck"), "--data", str(data), *extra]
    result = run_python(TRAIN.format(args=args), ranks=ranks, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    """The digits file of the module's runs, made once: making it imports scikit-learn, seconds of
    a launch's start-up. (The plain run has `mpidist train` make its own.)"""
    from mpidist.data import prepare_digits
    return prepare_digits(tmp_path_factory.mktemp("digits") / "digits.h5")


class PlainRun(NamedTuple):
    output: str
    checkpoints: object  # its checkpoint directory (a pathlib.Path)


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory) -> PlainRun:
    """A plain data-parallel run of 2 epochs on 2 ranks, the default seed: the reference that the
    other modes must train as, and a run that the resuming tests continue (from a copy of its
    checkpoints). One launch for the module: each launch costs seconds of start-up. It is started
    with --resume=auto into an empty directory, which must start from scratch: the other modes'
    fresh runs match it only if it does."""
    directory = tmp_path_factory.mktemp("plain")
    output = train(directory, "--epochs", "2", "--resume=auto", data=directory / "d.h5")
    assert sorted(name[:9] for name in os.listdir(directory / "ck")) == ["ckpt-0001", "ckpt-0002"]
    return PlainRun(output, directory / "ck")


class ZeroRun(NamedTuple):
    fresh: str
    resumed: str


@pytest.fixture(scope="module")
def zero_run(tmp_path_factory, plain_run, digits) -> ZeroRun:
    """A --zero run of one epoch, started without --resume in a directory that holds the plain
    run's checkpoints (of 2 epochs), then resumed to 2 epochs: the resume must continue the newest
    run (at its epoch 1), not the longer old one."""
    directory = tmp_path_factory.mktemp("zero")
    shutil.copytree(plain_run.checkpoints, directory / "ck")
    fresh = train(directory, "--epochs", "1", "--zero", data=digits)
    resumed = train(directory, "--epochs", "2", "--zero", "--resume", data=digits)
    return ZeroRun(fresh, resumed)


def test_resume_continues_the_newest_run_and_says_what_it_does(plain_run, zero_run):
    assert "no checkpoint in" in plain_run.output and "starting from scratch (--resume=auto)" in plain_run.output
    assert "holds checkpoints of an earlier run" in zero_run.fresh
    assert re.search(r"resumed from \S+ckpt-0001-\d+\.h5 \(epoch 1,", zero_run.resumed), zero_run.resumed
    # The epoch line counts every rank's samples.
    assert "epoch 2/2: loss" in zero_run.resumed and "(1500 samples on 2 ranks" in zero_run.resumed


def test_zero_trains_as_plain_sgd_does_and_resumes(plain_run, zero_run):
    """--zero shards SGD's momentum over the ranks: the same epoch lines and test accuracy as
    plain SGD, and its checkpoints (a plain SGD's state, consolidated on rank 0) resume it."""
    def lines(output):
        return re.findall(r"epoch \d+/2: loss .*? \(1500 samples|final test accuracy: \S+", output)

    plain = plain_run.output
    assert lines(zero_run.resumed) == lines(plain)[1:] and len(lines(plain)) == 3, (plain, zero_run.resumed)


# As TRAIN, but rank 1 sends itself SIGUSR1 (SLURM's warning before the time limit) in its 3rd step.
TRAIN_SIGNALLED = """
import os, signal
import mpidist, mpidist.cli.train
steps = 0
train_batch = mpidist.cli.train.train_batch
def signalling_train_batch(*args):
    global steps
    steps += 1
    if steps == 3 and mpidist.rank() == 1:
        os.kill(os.getpid(), signal.SIGUSR1)
    return train_batch(*args)
mpidist.cli.train.train_batch = signalling_train_batch
from mpidist.cli import main; raise SystemExit(main({args!r}))
"""


class StoppedRun(NamedTuple):
    stopped: str  # the output of the run that the stop signal stopped
    stopped_checkpoints: list  # the names of the files that it left
    resumed: str  # the output of its resumption, trained on to 12 epochs
    checkpoints: object  # the checkpoint directory of both (a pathlib.Path)


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory, digits) -> StoppedRun:
    """A run of 2 epochs that a stop signal stops in epoch 1, resumed and trained on to 12 epochs:
    the checks of the stop and of the long training share its launches. (--epochs only bounds the
    loop: the first 2 epochs of a run of 12 are those of a run of 2.)"""
    directory = tmp_path_factory.mktemp("stopped")
    args = ["train", "--no-progress", "--checkpoint-dir", str(directory / "ck"), "--data", str(digits), "--epochs", "2"]
    stopped = run_python(TRAIN_SIGNALLED.format(args=args), ranks=2, timeout=300)
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    left = os.listdir(directory / "ck")
    resumed = train(directory, "--epochs", "12", "--resume", data=digits)
    return StoppedRun(stopped.stdout, left, resumed, directory / "ck")


def test_a_stop_signal_checkpoints_where_every_rank_stops_and_resume_finishes_the_run(plain_run, stopped_run):
    import torch

    from mpidist.checkpoint import load_checkpoint
    from mpidist.cli.train import build_model
    # Rank 1's signal came in step 3; the ranks learn of it at the next step boundary, together.
    assert "mpidist train: stopped early: a stop signal (on another rank) came; every rank stopped after step 4 " \
           "(epoch 1/2)" in stopped_run.stopped, stopped_run.stopped
    assert stopped_run.stopped_checkpoints == ["ckpt-0000-00000004.h5"]
    resumed = stopped_run.resumed
    assert "resumed from" in resumed and "(epoch 0, step 4)" in resumed, resumed
    second = re.compile(r"epoch 2/\d+: (loss \S+ train accuracy \S+) \(1500 samples")
    assert second.findall(resumed) == second.findall(plain_run.output) != [], (plain_run.output, resumed)
    # The interrupted run has the uninterrupted one's weights after each epoch, bit for bit.
    for name in ("ckpt-0001-00000024.h5", "ckpt-0002-00000048.h5"):
        models = [build_model(), build_model()]
        for model, directory in zip(models, (plain_run.checkpoints, stopped_run.checkpoints)):
            load_checkpoint(directory / name, model, restore_rng=False)
        for one, other in zip(*(model.state_dict().values() for model in models)):
            assert torch.equal(one, other), name


def test_train_reaches_95_percent_and_resumes(stopped_run):
    # The stopped run, resumed in its epoch 1 and trained on to 12 epochs.
    output = stopped_run.resumed
    assert "epoch 1/12: loss" in output and "epoch 12/12: loss" in output, output
    accuracy = float(re.search(r"final test accuracy: ([0-9.]+)", output).group(1))
    assert accuracy >= 0.95, output
    assert sorted(name[:9] for name in os.listdir(stopped_run.checkpoints)) == \
        [f"ckpt-{epoch:04d}" for epoch in range(0, 13)]


def test_parameter_server_mode_trains_to_90_percent_and_resumes(tmp_path, digits):
    output = train(tmp_path, "--mode", "ps", "--max-staleness", "2", "--staleness-lr", "--epochs", "10", data=digits, ranks=3)
    assert re.search(r"parameter server \(async, 2 workers\): \d+ updates of \d+ gradients", output), output
    # Asynchronous updates land in whatever order the workers run: 0.94-0.98 after 6 epochs, 0.976-0.987 after 10 in three runs.
    accuracy = float(re.search(r"final test accuracy: ([0-9.]+)", output).group(1))
    assert accuracy >= 0.9, output
    import h5py
    import torch

    from mpidist.checkpoint import load_checkpoint
    from mpidist.cli.train import build_model
    model = build_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    state = load_checkpoint(str(tmp_path / "ck" / "ps-final.h5"), model, optimizer)
    assert state["epoch"] == 10 and state["step"] > 0
    # The server checkpoints every `batches per worker epoch` updates, with each worker's count of
    # applied gradients. Resumed from the one before the last two (the workers do not move in
    # step, so it may fall mid-way through their epochs), every worker restarts at its first
    # batch not in the weights: the resumed run applies exactly the rest.
    total = int(re.search(r"updates of (\d+) gradients", output).group(1))
    batches = total // 20  # per worker and epoch: 2 workers, 10 epochs
    names = sorted(os.listdir(tmp_path / "ck" / "ps"))
    assert len(names) == 20, names  # one per `batches` updates (async: a gradient per update)
    for name in names[-2:]:
        os.remove(tmp_path / "ck" / "ps" / name)
    with h5py.File(tmp_path / "ck" / "ps" / names[-3]) as f:
        saved = json.loads(f.attrs["extra"])
    assert saved["version"] == 18 * batches == sum(saved["applied"].values()), saved
    resumed = train(tmp_path, "--mode", "ps", "--max-staleness", "2", "--staleness-lr", "--epochs", "10", "--resume",
                    data=digits, ranks=3)
    assert f"resumed from {tmp_path / 'ck' / 'ps' / names[-3]} (update {18 * batches}," in resumed, resumed
    rest = int(re.search(r"updates of (\d+) gradients", resumed).group(1))
    assert rest == 2 * batches, resumed


def test_parameter_server_mode_with_two_servers(tmp_path, digits):
    """Synchronous updates over two servers, each holding half of the network: training goes as
    with one server, and the final weights (every server's range) are written."""
    output = train(tmp_path, "--mode", "ps", "--servers", "2", "--ps-mode", "sync", "--epochs", "3", data=digits, ranks=4)
    assert re.search(r"parameter server \(sync, 2 servers, 2 workers\): \d+ updates", output), output
    accuracy = float(re.search(r"final test accuracy: ([0-9.]+)", output).group(1))
    assert accuracy >= 0.85, output
    from mpidist.checkpoint import load_checkpoint
    from mpidist.cli.train import build_model, evaluate
    from mpidist.data import HDF5Dataset
    model = build_model()
    load_checkpoint(str(tmp_path / "ck" / "ps-final.h5"), model)
    assert abs(evaluate(model, HDF5Dataset(digits, "test")) - accuracy) < 1e-4


def test_pipeline_mode_trains_as_one_process_does(tmp_path, digits):
    """Three stages, five uneven micro-batches per batch: the same epoch losses and test accuracy
    as the same network trained by one process on the same batches (4 printed decimals)."""
    def losses_and_accuracy(output):
        losses = [float(v) for v in re.findall(r"epoch \d+/2: loss ([0-9.]+)", output)]
        return losses, float(re.search(r"final test accuracy: ([0-9.]+)", output).group(1))

    one_process = train(tmp_path / "one", "--epochs", "2", data=digits, ranks=0)
    pipeline = train(tmp_path / "pipe", "--mode", "pipeline", "--chunks", "5", "--epochs", "2", data=digits, ranks=3)
    assert "a pipeline of 3 stages" in pipeline, pipeline
    (expected_losses, expected_accuracy), (losses, accuracy) = map(losses_and_accuracy, (one_process, pipeline))
    assert len(losses) == 2 and losses == pytest.approx(expected_losses, abs=1.5e-4), pipeline
    assert accuracy == expected_accuracy, (one_process, pipeline)
    checkpoints = tmp_path / "pipe" / "ck"
    assert sorted(os.listdir(checkpoints)) == sorted([f"pipeline-final-rank{r}.h5" for r in range(3)] +
                                                     [f"pipeline-rank{r}" for r in range(3)])
    # Every rank checkpoints its stage each epoch. A job stopped after epoch 1 on rank 1 but
    # after epoch 2 (the last) on the others resumes from epoch 1 on every rank and trains on as
    # the uninterrupted run did.
    for rank in range(3):
        epochs = sorted(os.listdir(checkpoints / f"pipeline-rank{rank}"))
        assert [name[:9] for name in epochs] == ["ckpt-0001", "ckpt-0002"], epochs
        if rank == 1:
            os.remove(checkpoints / f"pipeline-rank{rank}" / epochs[1])
    resumed = train(tmp_path / "pipe", "--mode", "pipeline", "--chunks", "5", "--epochs", "2", "--resume", data=digits, ranks=3)
    assert re.search(r"resumed from \S+pipeline-rank0/ckpt-0001-\d+\.h5 and the other ranks' of epoch 1", resumed), \
        resumed
    assert "epoch 1/2" not in resumed
    assert losses_and_accuracy(resumed) == (losses[1:], accuracy), (pipeline, resumed)


def test_pipelines_with_replicas_train_as_data_parallelism_does(tmp_path, plain_run, digits):
    """Two pipelines of two stages, each on its share of the data, averaging their gradients:
    the same batches and updates as data parallelism on two ranks."""
    def losses_and_accuracy(output):
        losses = [float(v) for v in re.findall(r"epoch \d+/2: loss ([0-9.]+)", output)]
        return losses, float(re.search(r"final test accuracy: ([0-9.]+)", output).group(1))

    data_parallel = plain_run.output
    pipelines = train(tmp_path / "pipe", "--mode", "pipeline", "--replicas", "2", "--epochs", "2", data=digits, ranks=4)
    assert "2 pipelines of 2 stages" in pipelines and "(1500 samples through 2 x 2 stages" in pipelines, pipelines
    (expected_losses, expected_accuracy), (losses, accuracy) = map(losses_and_accuracy, (data_parallel, pipelines))
    assert len(losses) == 2 and losses == pytest.approx(expected_losses, abs=1.5e-4), pipelines
    # Float32 sums in another order: at most one of the 297 test images may differ.
    assert accuracy == pytest.approx(expected_accuracy, abs=1.01 / 297), (data_parallel, pipelines)
    assert sorted(name for name in os.listdir(tmp_path / "pipe" / "ck") if name.endswith(".h5")) == \
        [f"pipeline-final-rank{r}.h5" for r in range(4)]


def test_bad_options_are_refused_on_every_rank(tmp_path):
    from mpidist.cli import build_parser
    from mpidist.cli.train import check_mode_options
    from mpidist.errors import InvalidArgumentError
    for bad in (["--epochs", "0"], ["--batch-size", "-4"], ["--lr", "nan"], ["--lr", "-1"], ["--mode", "model"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["train", *bad])
    for wrong_mode, message in ((["--max-staleness", "0"], "go with --mode ps"),
                                (["--ps-mode", "async"], "go with --mode ps"),
                                (["--mode", "pipeline", "--staleness-lr"], "go with --mode ps"),
                                (["--chunks", "2"], "go with --mode pipeline"),
                                (["--mode", "ps", "--schedule", "gpipe"], "go with --mode pipeline"),
                                (["--replicas", "2"], "go with --mode pipeline"),
                                (["--mode", "ps", "--zero"], "--zero: these options go with --mode data"),
                                (["--mode", "ps", "--compression", "bf16"], "--compression applies to --mode data"),
                                (["--compression", "topk:2"], "compression 'topk:2': top-k fraction=2.0"),
                                (["--servers", "2"], "--servers: these options go with --mode ps"),
                                (["--model", "embedding", "--mode", "pipeline"], "--model embedding goes with"),
                                (["--embedding-rows", "10"], "--embedding-rows goes with --model embedding"),
                                (["--mode", "pipeline", "--elastic"], "--elastic with --mode pipeline is not offered"),
                                (["--elastic", "--zero"], "--elastic goes without --zero"),
                                (["--elastic", "--resume"], "without --resume")):
        with pytest.raises(InvalidArgumentError, match=message):
            check_mode_options(build_parser().parse_args(["train", *wrong_mode]))
    (tmp_path / "file").write_text("")
    args = ["train", "--checkpoint-dir", str(tmp_path / "file"), "--data", str(tmp_path / "d.h5")]
    result = run_python(TRAIN.format(args=args), ranks=2, timeout=300)
    assert result.returncode != 0
    assert result.stderr.count("is not a directory") == 2, result.stderr


def test_ddp_mode_trains_as_data_mode_does(tmp_path, plain_run, digits):
    """--mode ddp (torch's DDP over the mpidist backend) averages the same gradients as --mode
    data: the same epoch losses and accuracies, to float rounding."""
    def numbers(output):
        return [float(n) for n in re.findall(r"(?:loss|train accuracy|final test accuracy:) ([0-9.]+)", output)]

    data = plain_run.output
    ddp = train(tmp_path, "--mode", "ddp", "--epochs", "2", data=digits)
    assert len(numbers(data)) == 5, data
    assert numbers(ddp) == pytest.approx(numbers(data), abs=2e-4), (data, ddp)


def test_embedding_model_trains_alike_with_data_parallel_and_a_sparse_parameter_server(tmp_path, digits):
    """--model embedding: a bag-of-embeddings click model. Data parallel all-reduces the table's
    dense gradient; the synchronous parameter server moves only the rows each batch touches and
    applies sparse Adagrad, which leaves untouched rows as dense Adagrad does: the same updates
    on the same batches, so the same test accuracy (up to float rounding)."""
    common = ("--model", "embedding", "--embedding-rows", "1000", "--epochs", "1", "--batch-size", "64")
    data_parallel = train(tmp_path / "data", *common, data=digits, ranks=2)
    accuracy = float(re.search(r"final test accuracy: ([0-9.]+) \(2048 test click bags", data_parallel).group(1))
    assert accuracy >= 0.7, data_parallel  # half the bags are clicks: a constant guess scores 0.5
    sparse = train(tmp_path / "ps", *common, "--mode", "ps", "--ps-mode", "sync", data=digits, ranks=3)
    assert re.search(r"parameter server \(sync, 2 workers\): 128 updates of 256 gradients", sparse), sparse
    ps_accuracy = float(re.search(r"final test accuracy: ([0-9.]+)", sparse).group(1))
    assert ps_accuracy == pytest.approx(accuracy, abs=2.01 / 2048), (data_parallel, sparse)


# Each case's `mpidist` command, run in turn by every rank of one launch; a rank prints, per case,
# its exit status and what the command wrote to standard error, as JSON.
MISTAKES = """
import contextlib, io, json, sys
from mpidist.cli import main
import mpidist
for name, args in {cases!r}:
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        try:
            status = main(args)
        except SystemExit as exc:
            status = exc.code
    print(json.dumps([name, mpidist.rank(), status, stderr.getvalue()]), flush=True)
"""


def test_mistakes_are_one_line_from_rank_0_naming_the_file_with_a_usage_errors_status(tmp_path, digits):
    """Resuming from a missing or empty directory (without --resume=auto) or from another model's
    checkpoint, a --data file that is not HDF5 or was cut short, a --sizes or --dtype of bench
    that is none, an option of another mode: exit status 2 on every rank, and one line on rank 0 alone (the last
    line: argparse's usage comes before it) naming the file and the problem."""
    import torch

    from mpidist.checkpoint import checkpoint_path, save_checkpoint
    other_model = torch.nn.Linear(3, 3)
    save_checkpoint(checkpoint_path(tmp_path / "other", 1, 24), other_model, torch.optim.SGD(other_model.parameters()))
    (tmp_path / "empty").mkdir()
    (tmp_path / "text.h5").write_text("x,y\n0.5,1\n")
    data = open(digits, "rb").read()
    (tmp_path / "cut.h5").write_bytes(data[:len(data) // 2])
    train = ["train", "--no-progress", "--data", str(digits), "--checkpoint-dir"]
    cases = [
        ("missing", [*train, str(tmp_path / "mistyped"), "--resume"],
         f"--resume: {tmp_path / 'mistyped'} does not exist; check --checkpoint-dir, or pass --resume=auto"),
        ("empty", [*train, str(tmp_path / "empty"), "--resume"], f"--resume: {tmp_path / 'empty'} holds no checkpoint;"),
        ("empty_ps", [*train, str(tmp_path / "empty"), "--resume", "--mode", "ps"],
         f"--resume: {tmp_path / 'empty' / 'ps'} does not exist;"),
        ("other_model", [*train, str(tmp_path / "other"), "--resume"],
         f"{tmp_path / 'other' / 'ckpt-0001-00000024.h5'} holds the state of another model (entries the model has "
         "and the file lacks: 6 (0.weight, 0.bias, 2.weight, ...); entries the model lacks: 2 (weight, bias))"),
        ("not_hdf5", ["train", "--data", str(tmp_path / "text.h5")],
         f"{tmp_path / 'text.h5'} cannot be read as HDF5 (Unable to synchronously open file (file signature not found))"),
        ("cut_short", ["train", "--data", str(tmp_path / "cut.h5")],
         f"{tmp_path / 'cut.h5'} cannot be read as HDF5 (Unable to synchronously open file (truncated file: "),
        ("sizes", ["bench", "allreduce", "--sizes", "8Q"],
         "mpidist bench: error: argument --sizes: cannot read size '8Q': use a number with an optional K, M or G"),
        ("dtype", ["bench", "allreduce", "--dtype", "float32,float99"],
         "mpidist bench: error: argument --dtype: unknown dtype float99; choose from float16, bfloat16, float32"),
        ("mode_option", ["train", "--chunks", "2"], "mpidist: error: --chunks: these options go with --mode pipeline"),
    ]
    result = run_python(MISTAKES.format(cases=[(name, args) for name, args, _ in cases]), ranks=2, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    reports = {}
    for line in result.stdout.splitlines():
        name, rank, status, stderr = json.loads(line)
        reports[name, rank] = (status, stderr)
    for name, _, expected in cases:
        (status, stderr), (other_status, other_stderr) = reports[name, 0], reports[name, 1]
        assert status == other_status == 2, (name, reports[name, 0], reports[name, 1])
        assert other_stderr == "", (name, other_stderr)
        assert expected in stderr.splitlines()[-1], (name, stderr)
        assert "Traceback" not in stderr and (name in ("sizes", "dtype") or stderr.count("\n") == 1), (name, stderr)


def test_a_mistake_is_printed_once_by_the_whole_job(tmp_path, digits):
    """The launch of the command ends with exit status 2 and the error written once: rank 0 had
    printed it before the others' exit ended the job."""
    import torch

    from mpidist.checkpoint import checkpoint_path, save_checkpoint
    save_checkpoint(checkpoint_path(tmp_path / "other", 1, 24), torch.nn.Linear(3, 3))
    args = ["train", "--no-progress", "--data", str(digits), "--checkpoint-dir", str(tmp_path / "other"), "--resume"]
    result = run_python(TRAIN.format(args=args), ranks=3, timeout=300)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.count("holds the state of another model") == 1, result.stderr
    assert "Traceback" not in result.stderr, result.stderr


def test_every_damaged_byte_of_a_data_file_is_refused_naming_the_file(tmp_path, digits):
    """A bit flipped in any byte of the digits file's first 2 KiB (its superblock, groups and
    names): the training split opens, or is refused with an mpidist error naming the file; never
    h5py's own error, nor "no dataset 'x'" when x is there but cannot be read."""
    from mpidist.data import HDF5Dataset
    from mpidist.errors import MpidistError
    damaged = shutil.copy(digits, tmp_path / "damaged.h5")
    refusals = 0
    with open(damaged, "r+b") as file:
        for offset in range(2048):
            original = os.pread(file.fileno(), 1, offset)
            os.pwrite(file.fileno(), bytes([original[0] ^ 0x10]), offset)
            try:
                HDF5Dataset(damaged, "train", preload=False)
            except MpidistError as exc:
                refusals += 1
                assert str(damaged) in str(exc), (offset, exc)
                listed = re.search(r"has no dataset '(\w+)' \(it holds (\[.*\])\)", str(exc))
                assert listed is None or f"'{listed.group(1)}'" not in listed.group(2), (offset, exc)
            os.pwrite(file.fileno(), original, offset)
    assert refusals > 0


def test_progress_is_plain_lines_where_the_output_is_not_a_terminal(tmp_path, digits):
    """Standard error captured (a batch job's log): no progress bar redrawn after carriage returns,
    but a plain line every --progress-seconds, here after every step; on a terminal, tqdm's bar."""
    args = ["train", "--epochs", "1", "--batch-size", "256", "--progress-seconds", "1e-9", "--data", str(digits),
            "--checkpoint-dir", str(tmp_path / "ck")]
    result = run_python(TRAIN.format(args=args), timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "\r" not in result.stderr, result.stderr
    steps = [int(step) for step in re.findall(r"^epoch 1/1 \(rank 0\): step (\d+)/6, loss \S+, acc \S+, "
                                              r"samples_per_s \d+$", result.stderr, re.MULTILINE)]
    assert steps == list(range(1, 7)), result.stderr

    import argparse
    import io

    from tqdm import tqdm

    from mpidist.cli import train

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    options = argparse.Namespace(no_progress=False, progress_seconds=30.0)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("sys.stderr", Terminal())
        assert isinstance(train.progress(options, 6, "epoch 1/1", True), tqdm)


def test_the_sparse_parameter_server_job_runs_without_warnings(tmp_path):
    """The project's own sparse example, `mpidist train --mode ps --model embedding`, warns of
    nothing: the server's Adagrad gets a coalesced gradient whose invariants are checked, and
    builds its own sparse tensors with the checks on (torch warns, of segfaults, where no one said
    whether to check them). Warnings are errors in the ranks, and none may reach their output."""
    args = ["train", "--mode", "ps", "--model", "embedding", "--embedding-rows", "100", "--epochs", "1",
            "--batch-size", "256", "--no-progress", "--checkpoint-dir", str(tmp_path / "ck")]
    code = "import warnings; warnings.simplefilter('error', UserWarning)\n" + TRAIN.format(args=args)
    result = run_python(code, ranks=2, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Warning" not in result.stderr, result.stderr
    assert "final test accuracy" in result.stdout, result.stdout
