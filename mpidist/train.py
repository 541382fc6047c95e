"""`mpidist train`: training of a small network on the embedded digits data, or (--model
embedding) of a bag-of-embeddings click model on synthetic Zipf-distributed ids (clicks.py).

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
"""
from __future__ import annotations

import concurrent.futures
import copy
import os
import sys
import time

import numpy as np
import torch
from tqdm import tqdm

import mpidist as md

from . import clicks
from .checkpoint import (
    CHECKPOINT_NAME,
    CheckpointError,
    checkpoint_path,
    latest_checkpoint,
    load_checkpoint,
    on_every_rank,
    save_checkpoint,
    share_failure,
)
from .data import DataFileError, HDF5Dataset, ShardedSampler, ensure_digits
from .errors import InvalidArgumentError, MpidistError
from .stopping import GracefulStop

# The first words of the line `mpidist train` prints when a stop signal ended it early (slurm/train.sbatch
# looks for them to requeue the job).
STOPPED_EARLY = "mpidist train: stopped early"


def build_model(hidden: int = 128) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(64, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, hidden),
                               torch.nn.ReLU(), torch.nn.Linear(hidden, 10))


def build_network(args, sparse: bool = False) -> torch.nn.Module:
    """The network --model names; `sparse`: the embedding table's gradients are sparse rows."""
    if args.model == "embedding":
        return clicks.ClickModel(args.embedding_rows or EMBEDDING_ROWS, sparse=sparse)
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
        return (*clicks.click_datasets(args.embedding_rows or EMBEDDING_ROWS, seed=args.seed), "click bags")
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


class ProgressLines:
    """Progress for output that is not a terminal (a batch job's log): a plain line every
    `seconds`, with the steps done and the latest values, in place of tqdm's bar. The bar redraws
    itself after a carriage return, which in a file makes one line of every redraw of an epoch."""

    def __init__(self, total: int, desc: str, seconds: float):
        self.total, self.desc, self.seconds = total, desc, seconds
        self.done, self.values = 0, {}
        self.last = time.monotonic()

    def set_postfix(self, **values) -> None:
        self.values = values

    def update(self, steps: int = 1) -> None:
        self.done += steps
        now = time.monotonic()
        if now - self.last >= self.seconds:
            self.last = now
            values = "".join(f", {name} {value}" for name, value in self.values.items())
            print(f"{self.desc}: step {self.done}/{self.total}{values}", file=sys.stderr, flush=True)

    def close(self) -> None:
        pass


def progress(args, total: int, desc: str, shown: bool):
    """What shows an epoch's progress on this rank (`shown`, unless --no-progress): tqdm's bar on
    a terminal, elsewhere a plain line every --progress-seconds (ProgressLines)."""
    shown = shown and not args.no_progress
    if shown and not sys.stderr.isatty():
        return ProgressLines(total, desc, args.progress_seconds)
    return tqdm(total=total, desc=desc, disable=not shown, leave=True)


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


EMBEDDING_ROWS = 100_000  # --model embedding's table, unless --embedding-rows says otherwise
# The options of one mode only (argparse attribute names); given in another mode they are refused.
MODE_OPTIONS = {"ps": ("ps_mode", "softsync", "max_staleness", "staleness_lr", "servers"),
                "pipeline": ("chunks", "schedule", "replicas"),
                "data": ("zero",)}


def check_mode_options(args) -> None:
    """Options that belong to another mode are refused (on every rank, before MPI starts)."""
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
        raise InvalidArgumentError(f"--compression applies to --mode data; --mode {args.mode} sends full precision")


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


def nothing_to_resume(args, directory, say, which: str = "") -> None:
    """--resume found no checkpoint in `directory` (every rank alike): an error, unless
    --resume=auto, which starts from scratch. A mistyped --checkpoint-dir would otherwise throw
    away the progress of the run it was to continue."""
    if args.resume == "auto":
        say(f"no checkpoint {which}in {directory}: starting from scratch (--resume=auto)", flush=True)
        return
    found = "does not exist" if not os.path.exists(directory) else f"holds no checkpoint {which}".rstrip()
    raise on_every_rank(CheckpointError(
        f"--resume: {directory} {found}; check --checkpoint-dir, or pass --resume=auto to start from scratch "
        "when there is no checkpoint yet (the first run of a requeued job)"))


def save_data_parallel(args, comm, model, optimizer, sampler, step: int, epoch: int) -> str:
    """Checkpoint of the data-parallel run after `step` steps, in epoch `epoch` (complete when
    the sampler has handed out all its indices)."""
    if args.zero:  # rank 0 writes the whole state, as a plain optimizer's: either kind resumes from it
        optimizer.consolidate_state_dict(to=0)
    return save_checkpoint(checkpoint_path(args.checkpoint_dir, epoch, step), model, optimizer,
                           step=step, epoch=epoch, sampler=sampler, comm=comm)


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
            say(f"resumed from {latest} (epoch {start_epoch}, step {step})", flush=True)
    elif os.path.isdir(args.checkpoint_dir) and any(map(CHECKPOINT_NAME.match, os.listdir(args.checkpoint_dir))):
        say(f"{args.checkpoint_dir} holds checkpoints of an earlier run: this run starts from scratch and "
            "writes its own beside them (--resume continues the newest)", flush=True)
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        bar = progress(args, len(loader), f"epoch {epoch + 1}/{args.epochs} (rank 0)", comm.rank == 0)
        seen, correct, loss_sum, started = 0, 0, 0.0, time.perf_counter()
        for x, y in loader:
            output, batch_loss = train_batch(ddp, optimizer, optimizer.step, x, y)
            step += 1
            if stop.should_stop(comm):
                bar.close()
                # The sampler has handed out exactly the indices of the steps taken (a DataLoader
                # without workers), so --resume continues with the next batch of this epoch.
                path = save_data_parallel(args, comm, model, optimizer, sampler, step, epoch)
                say(f"{STOPPED_EARLY}: a stop signal ({stop.signalled or 'on another rank'}) came; every rank "
                    f"stopped after step {step} (epoch {epoch + 1}/{args.epochs}); checkpoint {path}; --resume "
                    "continues from it", flush=True)
                stop.close()
                return 0
            seen += len(y)
            loss_sum += batch_loss * len(y)
            correct += (output.argmax(dim=1) == y).sum().item()
            # Every rank runs as many steps of equal batches, so this rank's count times the
            # ranks is the job's.
            rate = seen * comm.size / (time.perf_counter() - started)
            bar.set_postfix(loss=f"{batch_loss:.3f}", acc=f"{correct / seen:.3f}",
                                 samples_per_s=f"{rate:.0f}")
            bar.update()
        bar.close()
        # The bar shows rank 0's own batches; the epoch's line sums every rank's.
        totals = comm.allreduce(np.array([loss_sum, correct, seen], dtype=np.float64))
        elapsed = time.perf_counter() - started
        say(f"epoch {epoch + 1}/{args.epochs}: loss {totals[0] / max(totals[2], 1):.4f}, train accuracy "
            f"{totals[1] / max(totals[2], 1):.4f} ({int(totals[2])} samples on {comm.size} ranks, "
            f"{totals[2] / elapsed:.0f} samples/s)", flush=True)
        save_data_parallel(args, comm, model, optimizer, sampler, step, epoch + 1)
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


class BackgroundCheckpoints:
    """Checkpoints written by a thread of their own from copies of the weights and the optimizer
    state, so that the parameter server goes on answering its workers while a file is written.
    One write at a time, in order; a failed write raises at the next save() or at close()."""

    def __init__(self):
        self._writer = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="mpidist-checkpoint")
        self._pending = None

    def save(self, path, model, optimizer, **fields) -> None:
        snapshot = (_Snapshot(copy.deepcopy(model.state_dict())), _Snapshot(copy.deepcopy(optimizer.state_dict())))
        self._finish_pending()
        self._pending = self._writer.submit(save_checkpoint, path, *snapshot, **fields)

    def close(self) -> None:
        try:
            self._finish_pending()
        finally:
            self._writer.shutdown()

    def _finish_pending(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()  # the earlier write's error, if any, is this rank's now


class _Snapshot:
    """Something with the state_dict() save_checkpoint asks for: a copy taken earlier."""

    def __init__(self, state):
        self._state = state

    def state_dict(self):
        return self._state


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
    started = time.perf_counter()
    if ps.is_server:
        os.makedirs(directory, exist_ok=True)
        checkpoints = BackgroundCheckpoints()

        def save(write, version: int):
            """The checkpoint of update `version`, which rank 0's model and optimizer hold, by `write`."""
            return write(checkpoint_path(directory, version // len(loader), version), model, optimizer, step=version,
                         epoch=version // len(loader),
                         extra={"version": version, "applied": {str(w): n for w, n in applied.items()}})

        def checkpoint(update):
            for worker, _step, _version in update.gradients:
                applied[worker] += 1
            if stop.signalled:
                ps.request_stop()  # on the coordinator, rank 0; the other servers leave it to it
            if update.version % len(loader) == 0:
                ps.gather_state()  # with several servers, onto rank 0, the coordinator
                if comm.rank == 0:
                    save(checkpoints.save, update.version)

        try:
            updates = ps.serve(on_update=checkpoint)
        finally:
            checkpoints.close()
            stop.close()
        gradients = sum(len(u.gradients) for u in updates)
        staleness = [u.version - 1 - held for u in updates for _, _, held in u.gradients] or [0]
        placement = f"{servers} servers, " if servers > 1 else ""
        say(f"parameter server ({mode}, {placement}{len(ps.workers)} workers): {len(updates)} updates of "
            f"{gradients} gradients in {time.perf_counter() - started:.1f} s; staleness mean "
            f"{np.mean(staleness):.2f}, max {max(staleness)}", flush=True)
        if ps.stopping:  # rank 0 (the coordinator), which holds the whole state since serve() ended
            path = save(save_checkpoint, ps.version)
            say(f"{STOPPED_EARLY}: a stop signal ({stop.signalled or 'on a worker'}) came; the workers stopped after "
                f"update {ps.version} (gradients per worker {list(applied.values())}); checkpoint {path}; --resume "
                "continues from it", flush=True)
            return 0
        if comm.rank == 0:
            save_checkpoint(os.path.join(args.checkpoint_dir, "ps-final.h5"), model, optimizer, step=ps.version,
                            epoch=args.epochs)
    else:
        # The sampler continues after the batches the weights already hold (it resumes mid-epoch).
        start_epoch, skip = divmod(applied[comm.rank], len(loader))
        sampler.set_epoch(start_epoch)
        sampler.load_state_dict(sampler.state_dict(consumed=skip * args.batch_size))
        for epoch in range(start_epoch, args.epochs):
            sampler.set_epoch(epoch)
            batches = -(-sampler.remaining() // args.batch_size)
            bar = progress(args, batches, f"epoch {epoch + 1}/{args.epochs} (chief, rank {comm.rank})", ps.is_chief)
            seen, correct, epoch_started = 0, 0, time.perf_counter()
            for x, y in loader:
                if stop.signalled:
                    ps.request_stop()  # goes with this step's gradient
                if args.model == "embedding":
                    ps.pull_rows(model.embedding, x)
                output, batch_loss = train_batch(model, optimizer, ps.step, x, y)
                seen += len(y)
                correct += (output.argmax(dim=1) == y).sum().item()
                bar.set_postfix(loss=f"{batch_loss:.3f}", acc=f"{correct / seen:.3f}",
                                     own_samples_per_s=f"{seen / (time.perf_counter() - epoch_started):.0f}")
                bar.update()
                if ps.stopping:
                    break
            bar.close()
            if ps.stopping:
                break
        ps.close()
        stop.close()
    # Every rank now holds the final weights.
    accuracy = evaluate(model, test_set)
    died = f", {len(ps.lost)} of them dropped when they died" if ps.lost else ""
    say(f"final test accuracy: {accuracy:.4f} ({len(test_set)} test {items}, parameter server and "
        f"{len(workers)} workers{died})", flush=True)
    return 0


def say_what_survives(mode: str, servers: int, say) -> None:
    """--elastic --mode ps: what a death does to this run, said at the start (with ULFM, whether
    the mode survives a dead worker; without it, what a death loses)."""
    from .runtime.mpi import fault_tolerance_missing
    missing = fault_tolerance_missing()
    newest = "--resume continues from the newest checkpoint in ps/" if servers == 1 else \
        "with --servers > 1 there is no checkpoint on the way to resume from"
    if missing is not None:
        say(f"mpidist train --elastic: {missing}. A rank that dies ends the whole job, and what the servers applied "
            f"since the newest checkpoint is lost ({newest})", flush=True)
    elif mode == "sync":
        say("mpidist train --elastic: plain sync mode waits for every worker: a worker that dies ends the job, as a "
            f"server that dies does ({newest}); --ps-mode async or softsync go on without a dead worker", flush=True)
    else:
        say(f"mpidist train --elastic: a worker that dies is dropped and the others go on; a server that dies ends "
            f"the job ({newest})", flush=True)


def common_checkpoint(directory, comm):
    """(epoch, step) of the newest checkpoint that every rank has in its own `directory`, or None
    when a rank has none. Where ranks' newest differ (a job stopped while some ranks were writing
    an epoch's files), the oldest of them, if every rank has it; otherwise every rank raises."""
    latest = latest_checkpoint(directory)
    match = CHECKPOINT_NAME.match(os.path.basename(latest)) if latest else None
    mine = [int(match.group(1)), int(match.group(2))] if match else [-1, -1]
    table = comm.allgather(np.array(mine, dtype=np.int64)).reshape(comm.size, 2)
    if (table[:, 0] < 0).any():
        return None
    epoch, step = min(map(tuple, table.tolist()))
    have = comm.allreduce(np.array([os.path.exists(checkpoint_path(directory, epoch, step))], dtype=np.int64),
                          op="min")
    if not have[0]:
        newest = ", ".join(f"rank {r}: epoch {e}" for r, (e, _) in enumerate(table.tolist()))
        raise CheckpointError(f"the ranks' newest pipeline checkpoints differ ({newest}) and not every rank has "
                              f"epoch {epoch}'s; start again without --resume")
    return epoch, step


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
            state = load_checkpoint(checkpoint_path(directory, *found), pipe, optimizer, sampler, comm=comm)
            step, start_epoch = state["step"], state["epoch"]
            say(f"resumed from {checkpoint_path(directory, *found)} and the other ranks' of epoch {start_epoch} "
                f"(step {step})", flush=True)
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        bar = progress(args, len(loader), f"epoch {epoch + 1}/{args.epochs} (rank 0)", comm.rank == 0)
        seen, loss_sum, started = 0, 0.0, time.perf_counter()
        for x, y in loader:
            pipe.zero_grad()
            loss = pipe.train_step(x, y)  # the batch's mean loss, on every rank
            if optimizer is not None:
                optimizer.step()
            step += 1
            if stop.should_stop(comm):
                bar.close()
                # As in --mode data, the sampler has handed out exactly the indices of the steps taken.
                os.makedirs(directory, exist_ok=True)
                path = save_checkpoint(checkpoint_path(directory, epoch, step), pipe, optimizer, step=step, epoch=epoch,
                                       sampler=sampler)
                say(f"{STOPPED_EARLY}: a stop signal ({stop.signalled or 'on another rank'}) came; every rank "
                    f"stopped after step {step} (epoch {epoch + 1}/{args.epochs}); checkpoint {path} and the other "
                    "ranks' of the same step; --resume continues from them", flush=True)
                stop.close()
                return 0
            seen += len(y)
            loss_sum += loss * len(y)
            # Every replica runs as many steps of equal batches (ShardedSampler).
            rate = seen * pipe.replicas / (time.perf_counter() - started)
            bar.set_postfix(loss=f"{loss:.3f}", samples_per_s=f"{rate:.0f}")
            bar.update()
        bar.close()
        # Each rank holds its replica's mean loss; every rank counts it once per stage.
        loss_sum = comm.allreduce(np.array([loss_sum / pipe.stages]))[0]
        seen *= pipe.replicas
        say(f"epoch {epoch + 1}/{args.epochs}: loss {loss_sum / seen:.4f} ({seen} samples through "
            f"{pipe.replicas} x {pipe.stages} stages, {seen / (time.perf_counter() - started):.0f} samples/s)",
            flush=True)
        os.makedirs(directory, exist_ok=True)
        save_checkpoint(checkpoint_path(directory, epoch + 1, step), pipe, optimizer, step=step, epoch=epoch + 1,
                        sampler=sampler)
    stop.close()
    os.makedirs(args.checkpoint_dir, exist_ok=True)
    save_checkpoint(os.path.join(args.checkpoint_dir, f"pipeline-final-rank{comm.rank}.h5"), pipe, optimizer,
                    step=step, epoch=args.epochs)
    accuracy = evaluate(pipe, test_set)  # pipe(x) gives the output on every rank
    layout = f"{pipe.replicas} pipelines" if pipe.replicas > 1 else "a pipeline"
    say(f"final test accuracy: {accuracy:.4f} ({len(test_set)} test images, {layout} of {pipe.stages} stages, "
        f"bounds {pipe.bounds})", flush=True)
    return 0
