"""md.elastic and hvd.elastic: training on 3 ranks under `mpirun --with-ft ulfm`, one rank killed
with SIGKILL mid-epoch; the commit the survivors restore must hold the parameters of an
independent single-process float64 replay of the 3 ranks' training up to it, and the 2 survivors
must finish with those of a replay from that commit, on the samples the elastic sampler had not
yet processed, dealt out over 2 ranks."""
import os
import re
import signal
import subprocess
import sys

import pytest
import torch
from conftest import REPO, run_python
from tolerances import assert_within
from ulfm_job import loss_summaries

SAMPLES, FEATURES, BATCH, EPOCHS, LR, MOMENTUM = 24, 3, 2, 3, 0.1, 0.9
VICTIM, KILL_AFTER_STEPS, COMMIT_EVERY = 1, 7, 2  # killed in epoch 1, one step after the commit at step 6

WORKER = f"""
import os, signal, sys
import torch
import mpidist as md
import mpidist.torch as hvd

out, api = sys.argv[1], sys.argv[2]
torch.set_num_threads(1)
comm = md.init()
generator = torch.Generator().manual_seed(1)
x = torch.randn({SAMPLES}, {FEATURES}, dtype=torch.float64, generator=generator)
y = torch.randn({SAMPLES}, 1, dtype=torch.float64, generator=generator)
dataset = torch.utils.data.TensorDataset(x, y)
torch.manual_seed(comm.rank)  # different starts: the first sync must give every rank rank 0's
model = torch.nn.Linear({FEATURES}, 1, dtype=torch.float64)
if api == "md":
    model = md.DataParallel(model)
    optimizer = torch.optim.SGD(model.parameters(), lr={LR}, momentum={MOMENTUM})
    sampler = md.elastic.ElasticSampler(dataset, shuffle=False)
    state = md.elastic.State(model=model, optimizer=optimizer, sampler=sampler, epoch=0, steps=0)
else:
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr={LR}, momentum={MOMENTUM}),
                                         named_parameters=model.named_parameters())
    sampler = hvd.elastic.ElasticSampler(dataset, shuffle=False)
    state = hvd.elastic.TorchState(model, optimizer, train_sampler=sampler, epoch=0, steps=0)
resets = []

def on_reset():
    resets.append(md.size())
    if md.rank() == 0:
        torch.save({{"steps": state.steps, "epoch": state.epoch, "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(), "processed": sorted(sampler.processed_indices)}},
                   os.path.join(out, "restored.pt"))

state.register_reset_callbacks([on_reset])

def train(state):
    while state.epoch < {EPOCHS}:
        loader = torch.utils.data.DataLoader(dataset, batch_size={BATCH}, sampler=sampler)
        for batch, (inputs, targets) in enumerate(loader):
            if md.size() == 3 and md.rank() == {VICTIM} and state.steps == {KILL_AFTER_STEPS}:
                os.kill(os.getpid(), signal.SIGKILL)
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(inputs), targets).backward()
            optimizer.step()
            sampler.record_batch(batch, {BATCH})
            state.steps += 1
            if state.steps % {COMMIT_EVERY} == 0:
                state.commit()
                if md.rank() == 0:
                    torch.save(model.state_dict(), os.path.join(out, f"commit-{{state.steps}}.pt"))
        state.epoch += 1
        sampler.set_epoch(state.epoch)
        state.commit()
    return state.steps

if api == "md":
    steps = md.elastic.run(train, state)
else:
    steps = hvd.elastic.run(train)(state)
torch.save({{"model": model.state_dict(), "steps": steps, "size": md.size(), "resets": resets}},
           os.path.join(out, f"final-{{md.rank()}}.pt"))
"""


def initial_state():
    """Where the 3 ranks start, as a commit: rank 0's weights (the first sync gives every rank
    rank 0's), no momentum yet, nothing processed."""
    torch.manual_seed(0)
    model = torch.nn.Linear(FEATURES, 1, dtype=torch.float64)
    momentum = {k: {"momentum_buffer": torch.zeros_like(p)} for k, p in enumerate(model.parameters())}
    return {"model": model.state_dict(), "optimizer": {"state": momentum}, "processed": [], "steps": 0, "epoch": 0}


def replay(restored, size=2, until_steps=None):
    """The training from the commit `restored` on `size` ranks, in one process: SGD with momentum
    on the average over the ranks of each rank's mean-squared-error gradient, rank r taking every
    size-th sample not yet processed in the epoch (sampler without shuffling), then whole epochs;
    up to step `until_steps`, by default to the end. Returns (weight, bias, steps)."""
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(SAMPLES, FEATURES, dtype=torch.float64, generator=generator)
    y = torch.randn(SAMPLES, 1, dtype=torch.float64, generator=generator)
    model = {name.removeprefix("module."): value for name, value in restored["model"].items()}  # DataParallel's
    weight, bias = model["weight"].clone(), model["bias"].clone()
    momentum = [restored["optimizer"]["state"][k]["momentum_buffer"].clone() for k in (0, 1)]
    processed = set(restored["processed"])
    steps = restored["steps"]
    for epoch in range(restored["epoch"], EPOCHS):
        remaining = [i for i in range(SAMPLES) if i not in processed]
        assert len(remaining) % (size * BATCH) == 0  # no padding in this layout
        shards = [remaining[r::size] for r in range(size)]
        for start in range(0, len(shards[0]), BATCH):
            if steps == until_steps:
                return weight, bias, steps
            grads = [torch.zeros_like(weight), torch.zeros_like(bias)]
            for shard in shards:
                rows = shard[start:start + BATCH]
                error = x[rows] @ weight.T + bias - y[rows]  # d(mean((xw+b-y)^2)) = 2 e x / n
                grads[0] += (2 * error.T @ x[rows] / len(rows)) / size
                grads[1] += (2 * error.sum(0) / len(rows)) / size
            for k, (param, grad) in enumerate(zip((weight, bias), grads)):
                momentum[k] = MOMENTUM * momentum[k] + grad
                param -= LR * momentum[k]
            steps += 1
        processed = set()
    return weight, bias, steps


def launch_under_ulfm(out, api, exit_on_rank_loss=None) -> tuple:
    """(output, exit status) of WORKER on 3 ranks under `mpirun --with-ft ulfm`, with
    MPIDIST_EXIT_ON_RANK_LOSS set when given; the status is None when the job had not ended after
    150 s and was killed (its whole process group)."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK",
                                                           "PYTEST_ISOLATE_MPI_IS_FORKED", "MPIDIST_EXIT_ON_RANK_LOSS")}
    env["MPIDIST_TIMEOUT"] = "60"
    if exit_on_rank_loss is not None:
        env["MPIDIST_EXIT_ON_RANK_LOSS"] = str(exit_on_rank_loss)
    cmd = ["mpirun", "--with-ft", "ulfm", "--oversubscribe", "--bind-to", "none", "-np", "3", sys.executable, "-c",
           WORKER, str(out), api]
    process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO,
                               start_new_session=True)
    try:
        return process.communicate(timeout=150)[0], process.returncode
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        return process.communicate()[0], None


# The md launch leaves MPIDIST_EXIT_ON_RANK_LOSS unset (the job exits 0), the hvd one asks for 3.
EXIT_ON_RANK_LOSS = {"md": None, "hvd": 3}


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    """api -> (its folder, output, exit status) of one launch each, shared by the checks."""
    done = {}

    def launch(api):
        if api not in done:
            out = tmp_path_factory.mktemp(f"elastic-{api}")
            done[api] = (out, *launch_under_ulfm(out, api, EXIT_ON_RANK_LOSS[api]))
        return done[api]

    return launch


@pytest.mark.parametrize("api", ["md", "hvd"])
def test_elastic_run_survives_a_killed_rank_and_matches_the_replay(api, launches):
    tmp_path, output, status = launches(api)
    assert f"rank {VICTIM} of 3 died; going on with 2 ranks" in output, output
    finals = [torch.load(tmp_path / f"final-{rank}.pt") for rank in range(2)]
    assert not os.path.exists(tmp_path / "final-2.pt"), output
    restored = torch.load(tmp_path / "restored.pt")
    # The survivors went back to the last commit before the death (step 6), as rank 0 saved it.
    assert restored["steps"] == KILL_AFTER_STEPS - 1 and restored["epoch"] == 1
    committed = torch.load(tmp_path / f"commit-{restored['steps']}.pt")
    assert all(torch.equal(committed[name], restored["model"][name]) for name in committed)
    assert len(restored["processed"]) == (KILL_AFTER_STEPS - 1 - SAMPLES // (3 * BATCH)) * 3 * BATCH
    prefix = "module." if api == "md" else ""
    # Per step: each rank's gradient sums its rows' products, the ranks' are averaged, the
    # momentum and the weights updated; the steps' errors add up.
    per_step = BATCH * (FEATURES + 1) + 3 + 2
    weight, bias, steps = replay(initial_state(), size=3, until_steps=restored["steps"])
    assert steps == restored["steps"]
    assert_within(restored["model"][prefix + "weight"], weight, roundings=steps * per_step)
    assert_within(restored["model"][prefix + "bias"], bias, roundings=steps * per_step)
    weight, bias, steps = replay(restored)
    for final in finals:
        assert final["size"] == 2 and final["resets"] == [2] and final["steps"] == steps
        model = final["model"]
        assert_within(model[prefix + "weight"], weight, roundings=steps * per_step)
        assert_within(model[prefix + "bias"], bias, roundings=steps * per_step)


@pytest.mark.parametrize("api", ["md", "hvd"])
def test_elastic_run_ends_with_one_summary_of_the_rank_lost(api, launches):
    _, output, _ = launches(api)
    summaries = loss_summaries(output)
    assert len(summaries) == 1, output
    # The victim died as the others were in the all-reduce of step KILL_AFTER_STEPS; they went
    # back to the commit of the step before.
    assert f"mpidist: the job lost rank {VICTIM} of 3 (elastic training) at epoch=1 steps={KILL_AFTER_STEPS} (" \
        in summaries[0], summaries
    assert f"the training since the last commit (epoch=1 steps={KILL_AFTER_STEPS - 1}) was done again on the 2 " \
        "ranks left" in summaries[0], summaries


@pytest.mark.parametrize("api", ["md", "hvd"])
def test_elastic_run_that_lost_a_rank_exits_0_or_with_the_status_of_mpidist_exit_on_rank_loss(api, launches):
    _, output, status = launches(api)
    # Open MPI's MPI_Finalize sometimes never returns after a death; the survivors then leave it
    # after MPIDIST_FINALIZE_TIMEOUT with their own status (runtime/leave.py).
    assert status == (EXIT_ON_RANK_LOSS[api] or 0), output
    print(f"{api}: MPI_Finalize left after MPIDIST_FINALIZE_TIMEOUT on {output.count('MPI_Finalize has not returned')} "
          "rank(s)")


def test_without_fault_tolerance_elastic_run_says_what_is_lost(tmp_path):
    code = """
import warnings
import torch
import mpidist as md
md.init()
state = md.elastic.State(value=1)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    print("returned", md.elastic.run(lambda state: state.value + md.size(), state))
if md.rank() == 0:
    print("warned:", caught[0].message)
"""
    result = run_python(code, ranks=2, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("returned 3") == 2
    warning = re.search("warned: (.*)", result.stdout).group(1)
    assert "mpirun --with-ft ulfm" in warning and "ends the whole job" in warning


FROZEN_WORKER = f"""
import os, signal
import torch
import mpidist as md

torch.set_num_threads(1)
md.init()
print(f"rank {{md.rank()}} began", flush=True)
generator = torch.Generator().manual_seed(1)
dataset = torch.utils.data.TensorDataset(torch.randn({SAMPLES}, {FEATURES}, generator=generator),
                                         torch.randn({SAMPLES}, 1, generator=generator))
model = md.DataParallel(torch.nn.Linear({FEATURES}, 1))
optimizer = torch.optim.SGD(model.parameters(), lr={LR})
sampler = md.elastic.ElasticSampler(dataset, shuffle=False)
state = md.elastic.State(model=model, optimizer=optimizer, sampler=sampler, epoch=0, steps=0)

def train(state):
    while state.epoch < 50:
        for batch, (inputs, targets) in enumerate(torch.utils.data.DataLoader(dataset, batch_size={BATCH},
                                                                              sampler=sampler)):
            if md.size() == 3 and md.rank() == 2 and state.steps == 5:
                os.kill(os.getpid(), signal.SIGSTOP)  # frozen, not dead
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(inputs), targets).backward()
            optimizer.step()
            sampler.record_batch(batch, {BATCH})
            state.steps += 1
            state.commit()
        state.epoch += 1
        sampler.set_epoch(state.epoch)
        state.commit()

md.elastic.run(train, state)
print(f"rank {{md.rank()}} of {{md.size()}} finished", flush=True)
"""


def _launch_under_ulfm(code: str, ranks: int, limit: float, *mca: str):
    """(output, exit status or None where it ran past `limit` seconds and was killed) of
    `code` on `ranks` ranks under `mpirun --with-ft ulfm`."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK",
                                                           "PYTEST_ISOLATE_MPI_IS_FORKED")}
    env["MPIDIST_TIMEOUT"] = "60"
    cmd = ["mpirun", "--with-ft", "ulfm", *mca, "--oversubscribe", "--bind-to", "none", "-np", str(ranks),
           sys.executable, "-c", code]
    process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO,
                               start_new_session=True)
    try:
        return process.communicate(timeout=limit)[0], process.returncode
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        return process.communicate()[0], None


def _launch_until_every_rank_began(code: str, ranks: int, limit: float, *mca: str):
    """`_launch_under_ulfm`, launched again (twice at most) where fewer than `ranks` ranks printed
    "rank R began": Open MPI crashed before the scenario did (seen in full runs on two cores, a
    segmentation fault in MPI_Init under the heartbeat detector, in no code of ours)."""
    for _ in range(3):
        output, status = _launch_under_ulfm(code, ranks, limit, *mca)
        if len(set(re.findall(r"rank (\d+) began", output))) == ranks:
            break
        print("launched again: not every rank began the scenario:\n" + output)
    return output, status


DIES_BEFORE_THE_WORLD = """
import os, signal
from mpi4py import MPI
import mpidist as md

MPI.COMM_WORLD.Barrier()  # every rank is past MPI_Init
print(f"rank {MPI.COMM_WORLD.Get_rank()} began", flush=True)
if MPI.COMM_WORLD.Get_rank() == 2:
    os.kill(os.getpid(), signal.SIGKILL)
md.init()
print("md.init() returned without rank 2", flush=True)
"""


DETECTOR = ("--mca", "mpi_ft_detector", "true", "--mca", "mpi_ft_detector_thread", "true",
            "--mca", "mpi_ft_detector_period", "1", "--mca", "mpi_ft_detector_timeout", "4")


@pytest.mark.parametrize("detector", [(), DETECTOR], ids=["", "detector"])
def test_a_rank_that_dies_while_md_init_makes_the_world_ends_the_job_with_an_error_naming_it(detector):
    # The survivors' first collective calls fail; MPI's bare MPI_ERR_PROC_FAILED became an error
    # naming the dead rank, and their MPI_Finalize, which may wait forever after a death (with
    # ULFM's detector on, it did), has its time limit from md.init()'s start (runtime/leave.py).
    output, status = _launch_until_every_rank_began(DIES_BEFORE_THE_WORLD, 3, 90, *detector)
    assert status not in (0, None), output
    assert "returned without rank 2" not in output, output
    assert output.count("RankDiedError: ") == 2, output
    for rank in (0, 1):
        assert f"rank {rank}: rank(s) [2] of 3 died while md.init() was making mpidist's world" in output, output


def test_a_rank_that_ulfms_detector_declares_dead_but_is_frozen_does_not_keep_the_job_running():
    # ULFM's heartbeat detector declares the stopped rank dead and the survivors go on without
    # it; its process, frozen on their node, must not keep mpirun waiting after they end.
    output, status = _launch_until_every_rank_began(FROZEN_WORKER, 3, 150, *DETECTOR)
    assert "rank 2 of 3 died; going on with 2 ranks" in output, output
    assert output.count("of 2 finished") == 2, output
    assert status == 0, output
