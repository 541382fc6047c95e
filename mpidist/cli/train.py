"""`mpidist train`: training of a small network on the embedded digits data, or (--model
embedding) of a bag-of-embeddings click model on synthetic Zipf-distributed ids (sparse_workload.py).

    mpirun -np 2 mpidist train --epochs 12            # data parallel
    mpirun -np 3 mpidist train --mode ps --ps-mode async --max-staleness 2
    mpirun -np 3 mpidist train --model embedding --mode ps --ps-mode sync

Data parallel (--mode data): rank 0 shows a progress bar (its own loss and accuracy, the job's
samples/s; where standard error is not a terminal, a plain line every --progress-seconds) and,
after each epoch, the loss and accuracy over all ranks; a checkpoint is written every epoch, and
the final test accuracy is printed. --resume continues from the latest checkpoint (--resume=auto:
if there is one).

Parameter server (--mode ps): rank 0 serves, the other ranks train on their shares of the data
at their own pace; the chief (rank 1) shows its progress; rank 0 checkpoints the weights in ps/
as it goes (--resume continues from the newest), and at the end prints what it applied, writes
ps-final.h5 and the final test accuracy. --servers k: ranks 0 .. k-1 serve, the model
partitioned over them; rank 0 gathers their parts for each checkpoint. On a stop signal the
workers stop through the parameter server and rank 0 checkpoints the last update.

torch DDP (--mode ddp): --mode data with torch's DistributedDataParallel over the "mpidist"
torch.distributed backend in place of mpidist's DataParallel.
Elastic (--elastic, launched with `mpirun --with-ft ulfm`): under --mode data a rank that dies is
dropped and the others go on from their last commit in memory (md.elastic; no checkpoints);
under --mode ps the servers drop a worker that dies and go on (a server's death ends the job, and
--resume continues from the newest checkpoint). Without ULFM it says at the start what is lost.

Pipeline (--mode pipeline): the network's layers cut into one stage per rank, every batch run
through the stages in micro-batches (--replicas k: k such pipelines averaging their gradients);
each rank checkpoints its stage every epoch, and at a stop signal's step, in pipeline-rank<r>/
(--resume continues from the newest every rank has) and writes it to pipeline-final-rank<r>.h5
at the end.

--model embedding trains with Adagrad (the MLP with SGD and momentum) in --mode data, ddp and
ps; under --mode data and ddp its table's gradient is dense (all-reduced whole), under --mode ps the table
has sparse gradients and each worker pulls the rows of its batch before the forward pass.

Every mode trains in one loop (run_epochs) and plugs into it a Mode (training.py): how a step
runs, what a stop signal's step and an epoch's end do (the mode's checkpoints), what the
progress shows; --mode ps's and pipeline's are in train_ps.py and train_pipeline.py.
"""
from __future__ import annotations

import os
import time

import numpy as np
import torch

import mpidist as md

from ..checkpoint import (
    CHECKPOINT_NAME,
    CheckpointError,
    checkpoint_path,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from ..data import DataFileError, HDF5Dataset, ShardedSampler, ensure_digits
from ..errors import InvalidArgumentError, MpidistError
from ..parallel.compressors import parse_compression
from ..runtime import on_every_rank, share_failure
from . import sparse_workload
from .stopping import GracefulStop
from .train_pipeline import PipelineMode, common_checkpoint
from .train_ps import WorkerMode, say_what_survives, serve_and_checkpoint
from .training import Mode, nothing_to_resume, progress, stopped_line


def build_model(hidden: int = 128) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(64, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, hidden),
                               torch.nn.ReLU(), torch.nn.Linear(hidden, 10))


def build_network(args, sparse: bool = False) -> torch.nn.Module:
    """The network --model names; `sparse`: the embedding table's gradients are sparse rows."""
    if args.model == "embedding":
        return sparse_workload.ClickModel(args.embedding_rows or EMBEDDING_ROWS, sparse=sparse)
    return build_model()


def optimizer_kind(args) -> tuple:
    """(optimizer class, its keyword arguments) for --model: Adagrad, whose sparse form updates
    only the rows a gradient touches, for the embedding table; SGD with momentum for the MLP."""
    if args.model == "embedding":
        return torch.optim.Adagrad, {"lr": args.lr}
    return torch.optim.SGD, {"lr": args.lr, "momentum": 0.9}


def make_optimizer(args, params):
    kind, options = optimizer_kind(args)
    return kind(params, **options)


def load_datasets(args, comm) -> tuple:
    """(training set, test set, what a test item is called) for --model."""
    if args.model == "embedding":
        return (*sparse_workload.click_datasets(args.embedding_rows or EMBEDDING_ROWS, seed=args.seed), "click bags")
    path = ensure_digits(args.data, comm=comm)
    splits = failure = None
    try:
        splits = HDF5Dataset(path, "train"), HDF5Dataset(path, "test")
    except (OSError, MpidistError) as exc:
        failure = exc
    share_failure(comm, failure, f"reading {path}", DataFileError)
    return *splits, "images"


def shard_loader(train_set, shard: int, shards: int, args):
    """The sampler of shard `shard` of `shards` (reshuffled each epoch) and its DataLoader."""
    sampler = ShardedSampler(len(train_set), shard, shards, shuffle=True, seed=args.seed)
    loader = torch.utils.data.DataLoader(train_set, batch_size=args.batch_size, sampler=sampler,
                                         generator=torch.Generator().manual_seed(args.seed))
    return sampler, loader


def train_batch(model, optimizer, apply, x, y):
    """Forward, loss and backward of one batch, then `apply` (the optimizer's step, or the
    parameter server's). Returns the output and the loss."""
    optimizer.zero_grad()
    output = model(x)
    loss = torch.nn.functional.cross_entropy(output, y)
    loss.backward()
    apply()
    return output, loss.item()


def evaluate(model, dataset) -> float:
    model.eval()
    with torch.no_grad():
        x, y = dataset.x, dataset.y
        predictions = model(torch.as_tensor(x)).argmax(dim=1)
        correct = (predictions == torch.as_tensor(y)).sum().item()
    model.train()
    return correct / len(y)


def run_epochs(args, mode: Mode, sampler, loader, start_epoch: int, step: int):
    """The training loop of every mode: epochs of steps with a progress bar, from `start_epoch`
    after `step` steps. Returns the steps taken in all, or None when a stop signal ended the run
    (the mode has checkpointed)."""
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        bar = progress(args, mode.batches(loader), f"epoch {epoch + 1}/{args.epochs} ({mode.who})", mode.shown)
        seen, correct, loss_sum, started = 0, 0, 0.0, time.perf_counter()
        for x, y in loader:
            output, batch_loss = mode.run_step(x, y, train_batch)
            step += 1
            if mode.interrupted(step, epoch):
                bar.close()
                return None
            seen += len(y)
            loss_sum += batch_loss * len(y)
            if output is not None:
                correct += (output.argmax(dim=1) == y).sum().item()
            bar.set_postfix(**mode.postfix(batch_loss, seen, correct, time.perf_counter() - started))
            bar.update()
            if mode.finished():
                break
        bar.close()
        if mode.finished():
            break
        mode.end_epoch(epoch, step, (loss_sum, correct, seen), time.perf_counter() - started)
    return step


EMBEDDING_ROWS = 100_000  # --model embedding's table, unless --embedding-rows says otherwise
# The options of one mode only (argparse attribute names); given in another mode they are refused.
MODE_OPTIONS = {"ps": ("ps_mode", "softsync", "max_staleness", "staleness_lr", "servers"),
                "pipeline": ("chunks", "schedule", "replicas"),
                "data": ("zero",)}


def check_mode_options(args) -> None:
    """Options that belong to another mode are refused (on every rank, before MPI starts)."""
    parse_compression(args.compression)
    for mode, names in MODE_OPTIONS.items():
        given = [name for name in names if getattr(args, name) is not None and getattr(args, name) is not False]
        if given and args.mode != mode:
            options = ", ".join("--" + name.replace("_", "-") for name in given)
            raise InvalidArgumentError(f"{options}: these options go with --mode {mode}")
    if args.model == "embedding" and args.mode == "pipeline":
        raise InvalidArgumentError("--model embedding goes with --mode data, ddp or ps")
    if args.embedding_rows is not None and args.model != "embedding":
        raise InvalidArgumentError("--embedding-rows goes with --model embedding")
    if args.elastic and args.mode not in ("data", "ps"):
        raise InvalidArgumentError(f"--elastic with --mode {args.mode} is not offered yet: elastic training is data "
                                   "parallel (--mode data) or with a parameter server (--mode ps)")
    if args.elastic and args.mode == "data" and (args.zero or args.resume):
        raise InvalidArgumentError("--elastic goes without --zero (a dead rank would take its share of the optimizer "
                                   "state with it) and without --resume (its commits are in memory, not on disk)")
    if args.mode != "data" and args.compression != "none":
        raise InvalidArgumentError(f"--compression applies to --mode data; --mode {args.mode} sends full precision "
                                   "(in your own script md.ParameterServer(compression=...) compresses the pushes)")


def cmd_train(args, stop: GracefulStop | None = None) -> int:
    """`stop`: the stop on a signal (stopping.py), made by the command before it imported torch;
    made here when not given."""
    try:
        check_mode_options(args)
    except InvalidArgumentError as exc:  # the same arguments, the same error on every rank
        raise on_every_rank(exc) from None
    comm = md.init()
    if stop is None:
        stop = GracefulStop()
    if os.path.exists(args.checkpoint_dir) and not os.path.isdir(args.checkpoint_dir):
        raise InvalidArgumentError(f"--checkpoint-dir {args.checkpoint_dir} exists and is not a directory")
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    train_set, test_set, items = load_datasets(args, comm)
    say = print if comm.rank == 0 else (lambda *a, **k: None)
    if args.mode == "ps":
        return train_with_parameter_server(args, comm, train_set, test_set, items, say, stop)
    if args.mode == "pipeline":
        return train_with_pipeline(args, comm, train_set, test_set, say, stop)
    if args.elastic:
        return train_elastic(args, comm, train_set, test_set)
    return train_data_parallel(args, comm, train_set, test_set, items, say, stop)


def save_data_parallel(args, comm, model, ddp, optimizer, sampler, step: int, epoch: int) -> str:
    """Checkpoint of the data-parallel run after `step` steps, in epoch `epoch` (complete when
    the sampler has handed out all its indices); with error-feedback compression each rank also
    writes its compression state (compression_state_path)."""
    if args.zero:  # rank 0 writes the whole state, as a plain optimizer's: either kind resumes from it
        optimizer.consolidate_state_dict(to=0)
    path = save_checkpoint(checkpoint_path(args.checkpoint_dir, epoch, step), model, optimizer,
                           step=step, epoch=epoch, sampler=sampler, comm=comm)
    if isinstance(ddp, md.DataParallel) and ddp.compression_state_dict():  # alike on every rank
        failure = None
        try:
            save_checkpoint(compression_state_path(path, comm), CompressionState(ddp))
        except Exception as exc:  # every rank's error, so that none goes on alone
            failure = exc
        share_failure(comm, failure, "writing the compression state", CheckpointError)
    return path


def compression_state_path(path, comm) -> str:
    """Where this rank keeps its compression state of the checkpoint at `path`: beside it, in
    compression-rank<rank>/ under the same name (the ranks' residuals differ)."""
    directory, name = os.path.split(path)
    return os.path.join(directory, f"compression-rank{comm.rank}", name)


class CompressionState:
    """A DataParallel's error-feedback state (this rank's) as the model part of a checkpoint."""

    def __init__(self, ddp):
        self.ddp = ddp

    def state_dict(self) -> dict:
        return self.ddp.compression_state_dict()

    def load_state_dict(self, state) -> None:
        self.ddp.load_compression_state_dict(state)


class DataParallelMode(Mode):
    """--mode data and ddp: every rank steps alike; rank 0 shows its progress; a checkpoint every
    epoch and at a stop signal's step."""

    def __init__(self, args, comm, model, ddp, optimizer, sampler, say, stop):
        self.args, self.comm, self.model, self.ddp, self.optimizer = args, comm, model, ddp, optimizer
        self.sampler, self.say, self.stop = sampler, say, stop
        self.shown = comm.rank == 0

    def run_step(self, x, y, train_batch) -> tuple:
        return train_batch(self.ddp, self.optimizer, self.optimizer.step, x, y)

    def interrupted(self, step: int, epoch: int) -> bool:
        if not self.stop.should_stop(self.comm):
            return False
        # The sampler has handed out exactly the indices of the steps taken (a DataLoader
        # without workers), so --resume continues with the next batch of this epoch.
        path = save_data_parallel(self.args, self.comm, self.model, self.ddp, self.optimizer, self.sampler, step,
                                  epoch)
        self.say(f"{stopped_line(self.stop, step, epoch, self.args.epochs, path)}; --resume continues from it",
                 flush=True)
        self.stop.close()
        return True

    def postfix(self, loss: float, seen: int, correct: int, elapsed: float) -> dict:
        # Every rank runs as many steps of equal batches, so this rank's count times the ranks is the job's.
        return {"loss": f"{loss:.3f}", "acc": f"{correct / seen:.3f}",
                "samples_per_s": f"{seen * self.comm.size / elapsed:.0f}"}

    def end_epoch(self, epoch: int, step: int, counts: tuple, elapsed: float) -> None:
        # The bar shows rank 0's own batches; the epoch's line sums every rank's.
        totals = self.comm.allreduce(np.array(counts, dtype=np.float64))
        self.say(f"epoch {epoch + 1}/{self.args.epochs}: loss {totals[0] / max(totals[2], 1):.4f}, train accuracy "
                 f"{totals[1] / max(totals[2], 1):.4f} ({int(totals[2])} samples on {self.comm.size} ranks, "
                 f"{totals[2] / elapsed:.0f} samples/s)", flush=True)
        save_data_parallel(self.args, self.comm, self.model, self.ddp, self.optimizer, self.sampler, step, epoch + 1)


def train_data_parallel(args, comm, train_set, test_set, items, say, stop) -> int:
    """--mode data: a checkpoint after each epoch; on a stop signal (stopping.py) a checkpoint at
    the step every rank stops at, and exit status 0."""
    sampler, loader = shard_loader(train_set, comm.rank, comm.size, args)
    model = build_network(args)
    compression = None if args.compression == "none" else args.compression
    if args.mode == "ddp":
        ddp = wrap_with_torch_ddp(model)
    else:
        ddp = md.DataParallel(model, comm=comm, compression=compression, algorithm=args.algorithm)
    if args.zero:  # each rank keeps the optimizer state of its share of the parameters
        kind, options = optimizer_kind(args)
        optimizer = md.ZeroRedundancyOptimizer(ddp.parameters(), kind, comm=comm, **options)
    else:
        optimizer = make_optimizer(args, ddp.parameters())
    step, start_epoch = 0, 0
    if args.resume:
        # Rank 0 chooses the file for everyone, and a failure to load it on any rank stops all.
        latest = latest_checkpoint(args.checkpoint_dir, comm=comm)
        if latest is None:
            nothing_to_resume(args, args.checkpoint_dir, say)
        else:
            state = load_checkpoint(latest, model, optimizer, sampler, comm=comm)
            step, start_epoch = state["step"], state["epoch"]
            if isinstance(ddp, md.DataParallel) and ddp.compression_state_dict():
                load_checkpoint(compression_state_path(latest, comm), CompressionState(ddp), restore_rng=False,
                                comm=comm)
            say(f"resumed from {latest} (epoch {start_epoch}, step {step})", flush=True)
    elif os.path.isdir(args.checkpoint_dir) and any(map(CHECKPOINT_NAME.match, os.listdir(args.checkpoint_dir))):
        say(f"{args.checkpoint_dir} holds checkpoints of an earlier run: this run starts from scratch and "
            "writes its own beside them (--resume continues the newest)", flush=True)
    if run_epochs(args, DataParallelMode(args, comm, model, ddp, optimizer, sampler, say, stop), sampler, loader,
                  start_epoch, step) is None:
        return 0
    stop.close()
    accuracy = evaluate(model, test_set)
    say(f"final test accuracy: {accuracy:.4f} ({len(test_set)} test {items}, {comm.size} ranks)", flush=True)
    return 0


def wrap_with_torch_ddp(model):
    """--mode ddp: torch's DistributedDataParallel over the "mpidist" torch.distributed backend
    (mpidist/distributed/); the rest of the job is --mode data's."""
    import torch.distributed as dist
    if not dist.is_initialized():
        dist.init_process_group("mpidist")
    return torch.nn.parallel.DistributedDataParallel(model)


ELASTIC_COMMIT_STEPS = 10  # --elastic: steps between commits (in memory; a death redoes at most these)


def train_elastic(args, comm, train_set, test_set) -> int:
    """--mode data --elastic: data parallel training that goes on on the surviving ranks when one
    dies (md.elastic; launched with `mpirun --with-ft ulfm`). The state is committed in memory
    every ELASTIC_COMMIT_STEPS steps and at the end of each epoch; nothing is written to disk."""
    def say(*args, **kwargs):
        if md.rank() == 0:  # rank 0 of the world of the moment: the old one may have died
            print(*args, **kwargs)

    sampler = md.elastic.ElasticSampler(train_set, shuffle=True, seed=args.seed)
    model = build_network(args)
    compression = None if args.compression == "none" else args.compression
    ddp = md.DataParallel(model, comm=comm, compression=compression, algorithm=args.algorithm)
    optimizer = make_optimizer(args, ddp.parameters())
    state = md.elastic.State(model=ddp, optimizer=optimizer, sampler=sampler, epoch=0)

    def train(state):
        while state.epoch < args.epochs:
            loader = torch.utils.data.DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)
            bar = progress(args, len(loader), f"epoch {state.epoch + 1}/{args.epochs} (rank 0)", md.rank() == 0)
            for batch, (x, y) in enumerate(loader):
                _, batch_loss = train_batch(ddp, optimizer, optimizer.step, x, y)
                sampler.record_batch(batch, args.batch_size)
                bar.set_postfix(loss=f"{batch_loss:.3f}", ranks=md.size())
                bar.update()
                if (batch + 1) % ELASTIC_COMMIT_STEPS == 0:
                    state.commit()
            bar.close()
            state.epoch += 1
            sampler.set_epoch(state.epoch)
            state.commit()
            say(f"epoch {state.epoch}/{args.epochs} done on {md.size()} of {comm.size} ranks", flush=True)

    md.elastic.run(train, state)
    accuracy = evaluate(model, test_set)
    say(f"final test accuracy: {accuracy:.4f} ({len(test_set)} test images, {md.size()} ranks at the end)", flush=True)
    return 0


def train_with_parameter_server(args, comm, train_set, test_set, items, say, stop) -> int:
    """--mode ps: rank 0 (ranks 0 .. k-1 with --servers k) applies the workers' gradients; each
    worker trains on its share of the data, at its own pace (no collective among workers while
    they train). Rank 0 checkpoints the weights (with several servers, gathered from them all)
    every as many updates as a worker has batches per epoch, with the number of each worker's
    gradients they hold, so that --resume restarts every worker at the first batch the weights
    have not seen. On a stop signal (stopping.py) the workers stop through the parameter server
    (request_stop(): in sync mode all after the same update), rank 0 checkpoints the last update
    and the exit status is 0. The embedding model's table goes by rows: a worker pulls its
    batch's rows before each forward pass."""
    mode = args.ps_mode or "async"
    if args.elastic:
        say_what_survives(mode, args.servers or 1, say)
    model = build_network(args, sparse=True)
    optimizer = make_optimizer(args, model.parameters())
    directory = os.path.join(args.checkpoint_dir, "ps")
    servers = args.servers or 1
    if comm.size <= servers:
        raise InvalidArgumentError(f"--servers {servers} leaves no worker among the {comm.size} ranks")
    workers = list(range(servers, comm.size))  # the servers are ranks 0 .. servers - 1
    sampler, loader = shard_loader(train_set, max(comm.rank - servers, 0), len(workers), args)
    version, applied = 0, dict.fromkeys(workers, 0)  # worker -> its gradients the weights hold
    if args.resume:
        latest = latest_checkpoint(directory, comm=comm)
        if latest is None:
            nothing_to_resume(args, directory, say)
        else:
            # Every rank loads the weights (the chief's are everyone's start); the servers also
            # the optimizer, each keeping the state of its own range.
            state = load_checkpoint(latest, model, optimizer if comm.rank < servers else None, restore_rng=False,
                                    comm=comm)
            version = state["extra"]["version"]
            applied = {w: state["extra"]["applied"][str(w)] for w in workers}
            say(f"resumed from {latest} (update {version}, gradients per worker {list(applied.values())})",
                flush=True)
    ps = md.ParameterServer(model, optimizer, comm=comm, mode=mode, softsync=args.softsync,
                            max_staleness=args.max_staleness, staleness_lr=args.staleness_lr, version=version,
                            servers=servers)
    if ps.is_server:
        if serve_and_checkpoint(args, comm, ps, model, optimizer, len(loader), applied, say, stop):
            return 0
    else:
        # The sampler continues after the batches the weights already hold (it resumes mid-epoch).
        start_epoch, skip = divmod(applied[comm.rank], len(loader))
        sampler.set_epoch(start_epoch)
        sampler.load_state_dict(sampler.state_dict(consumed=skip * args.batch_size))
        run_epochs(args, WorkerMode(args, comm, ps, model, optimizer, sampler, stop), sampler, loader, start_epoch, 0)
        ps.close()
        stop.close()
    # Every rank now holds the final weights.
    accuracy = evaluate(model, test_set)
    died = f", {len(ps.lost)} of them dropped when they died" if ps.lost else ""
    say(f"final test accuracy: {accuracy:.4f} ({len(test_set)} test {items}, parameter server and "
        f"{len(workers)} workers{died})", flush=True)
    return 0


def train_with_pipeline(args, comm, train_set, test_set, say, stop) -> int:
    """--mode pipeline: one stage of the network per rank; every rank of a pipeline reads the
    same batches (the first stage uses the images, the last the labels). With --replicas k,
    k pipelines train on their shares of the data and average their gradients. On a stop signal
    (stopping.py) every rank checkpoints its stage at the step all stop at, and the exit status
    is 0."""
    pipe = md.Pipeline(build_model(), torch.nn.functional.cross_entropy, comm=comm, chunks=args.chunks or 4,
                       schedule=args.schedule or "1f1b", replicas=args.replicas or 1)
    params = list(pipe.parameters())  # none on a stage of activations only
    optimizer = torch.optim.SGD(params, lr=args.lr, momentum=0.9) if params else None
    sampler, loader = shard_loader(train_set, pipe.replica, pipe.replicas, args)
    # Each rank checkpoints its own stage every epoch, in a directory of its own.
    directory = os.path.join(args.checkpoint_dir, f"pipeline-rank{comm.rank}")
    step, start_epoch = 0, 0
    if args.resume:
        found = common_checkpoint(directory, comm)
        if found is None:
            nothing_to_resume(args, args.checkpoint_dir, say, "every rank has ")
        else:
            state = load_checkpoint(found, pipe, optimizer, sampler, comm=comm)
            step, start_epoch = state["step"], state["epoch"]
            say(f"resumed from {found} and the other ranks' of epoch {start_epoch} (step {step})", flush=True)
    step = run_epochs(args, PipelineMode(args, comm, pipe, optimizer, sampler, directory, say, stop), sampler,
                      loader, start_epoch, step)
    if step is None:
        return 0
    stop.close()
    os.makedirs(args.checkpoint_dir, exist_ok=True)
    save_checkpoint(os.path.join(args.checkpoint_dir, f"pipeline-final-rank{comm.rank}.h5"), pipe, optimizer,
                    step=step, epoch=args.epochs)
    accuracy = evaluate(pipe, test_set)  # pipe(x) gives the output on every rank
    layout = f"{pipe.replicas} pipelines" if pipe.replicas > 1 else "a pipeline"
    say(f"final test accuracy: {accuracy:.4f} ({len(test_set)} test images, {layout} of {pipe.stages} stages, "
        f"bounds {pipe.bounds})", flush=True)
    return 0
