"""ParameterServer when a rank dies (parallel/ps/survival.py): one job of 8 ranks under
`mpirun --with-ft ulfm` runs eight parameter servers one after another, each on its own
communicator of ranks still alive, and in seven of them a rank kills itself with SIGKILL:

  async          servers 0, 1; workers 2, 3, 4; nobody killed (the reference)
  async-killed   the same; worker 4 killed halfway through its step KILL_STEP's gradient: the
                 header has reached the coordinator, the payload never comes
  closed         servers 0, 1; workers 2, 7 (plain sync); 7 killed in its close(), after telling
                 the servers it is done and before the final weights reach it (a wider model:
                 a message under the MPI library's eager limit reaches a dead rank without error)
  softsync       server 0; workers 1, 2, 3, 5 (2-softsync: 2 gradients per update); 5 killed
  backup         server 0; workers 1, 2, 3 (sync, 1 backup worker); 3 killed by the server, after
                 KILL_UPDATE updates: wherever it is (computing, or waiting with its gradient
                 taken or not)
  sync           server 0; workers 1, 2 (plain sync); 2 killed
  server-killed  server 0, killed after KILL_UPDATE updates; worker 1
  building       server 1; worker 6, killed as the server starts building the ParameterServer (last:
                 placed before softsync, it left every member of softsync waiting in MPI_Comm_dup)

The first five go on without the dead worker; the last three end with a RankDiedError naming the
dead rank on every survivor. One launch for all of them: each start of a rank costs seconds of
CPU (torch's import), more than the training.

Each rank writes what it saw in each phase to a JSON file; the checks read them. The job itself
is stopped (its whole process group) when it has not ended RUN_SECONDS after its start, or
EXIT_SECONDS after every survivor wrote its last file: Open MPI's MPI_Finalize sometimes never
returns after a death (docs/elastic.md), and the survivor must then leave it after
MPIDIST_FINALIZE_TIMEOUT with its own exit status (runtime/leave.py), which the last check
checks."""

import pytest
from ulfm_job import job_start, loss_summaries, phase_records, run_ulfm_job

RANKS, FEATURES, CLASSES, SAMPLES, TESTS, BATCH, EPOCHS, LR = 8, 8, 3, 1536, 2000, 64, 3, 0.5
KILL_STEP, KILL_UPDATE = 9, 12
KILLED_BY_THE_SERVER = "backup"
KILLED_HALFWAY = "async-killed"
KILLED_IN_CLOSE, WIDE = "closed", 4096  # its model's hidden width: final weights of 2 x 106 KB
# name: (the phase's world ranks, its servers, its options, the world rank killed)
PHASES = {
    "async": ([0, 1, 2, 3, 4], 2, {"mode": "async"}, None),
    "async-killed": ([0, 1, 2, 3, 4], 2, {"mode": "async"}, 4),
    "closed": ([0, 1, 2, 7], 2, {"mode": "sync"}, 7),
    "softsync": ([0, 1, 2, 3, 5], 1, {"mode": "softsync", "softsync": 2}, 5),
    "backup": ([0, 1, 2, 3], 1, {"mode": "sync", "backup_workers": 1}, 3),
    "sync": ([0, 1, 2], 1, {"mode": "sync"}, 2),
    "server-killed": ([0, 1], 1, {"mode": "async"}, 0),
    "building": ([1, 6], 1, {"mode": "async"}, 6),
}
EXIT_ON_RANK_LOSS = 4  # the servers that dropped a worker exit with it, and so mpirun
RUN_SECONDS, EXIT_SECONDS = 150, 30  # the exit: the interpreter's end, then MPI_Finalize (MPIDIST_FINALIZE_TIMEOUT at most)
DETECTION_SECONDS = 10  # from a kill to the end of the waits it ends (seen: under 1 s, on a loaded host)

JOB = job_start(FEATURES, CLASSES, SAMPLES, TESTS) + f"""
import os, signal, time
from mpidist.runtime import wire


pids = world.mpi.allgather(os.getpid())


def kill(name, rank):
    with open(os.path.join(out, f"killed-{{name}}"), "w") as file:
        file.write(repr(time.time()))
    os.kill(pids[rank], signal.SIGKILL)


def accuracy(model):
    with torch.no_grad():
        return (model(x[{SAMPLES}:]).argmax(1) == y[{SAMPLES}:]).float().mean().item()


for name, (members, servers, options, victim) in phases.items():
    comm = comms[name]
    if comm is None:
        continue
    torch.manual_seed(0)
    if name == "{KILLED_IN_CLOSE}":
        model = torch.nn.Sequential(torch.nn.Linear({FEATURES}, {WIDE}), torch.nn.ReLU(), torch.nn.Linear({WIDE}, {CLASSES}))
    else:
        model = torch.nn.Linear({FEATURES}, {CLASSES})
    optimizer = torch.optim.SGD(model.parameters(), lr={LR}) if comm.rank < servers else None
    record = {{"started": time.time()}}
    try:
        if name == "building":  # the victim waits for the server to come to it (a file says so), then dies
            if world.rank == victim:
                while not os.path.exists(os.path.join(out, "building")):
                    time.sleep(0.05)
                kill(name, victim)
            open(os.path.join(out, "building"), "w").close()
        ps = md.ParameterServer(model, optimizer, comm=comm, servers=servers, **options)
        if ps.is_server:
            def on_update(update):
                if update.version == {KILL_UPDATE} and (world.rank == victim or name == "{KILLED_BY_THE_SERVER}"):
                    kill(name, victim)
            updates = ps.serve(on_update=on_update)
            record["updates"] = [[worker for worker, _, _ in update.gradients] for update in updates]
            record["lost"] = [[lost.worker, lost.steps] for lost in ps.lost]
            record["seen"] = [lost.time for lost in ps.lost]
        else:
            index, steps = ps.workers.index(comm.rank), 0
            own = torch.arange(index, {SAMPLES}, len(ps.workers))
            for epoch in range({EPOCHS}):
                for start in range(0, len(own), {BATCH}):
                    if world.rank == victim and steps == {KILL_STEP} and name == "{KILLED_HALFWAY}":
                        def header_then_death(mpi, tensor, dest, tag, fields=()):  # step()'s first send: to the coordinator
                            mpi.Send(wire.header_of(tensor.detach().cpu().contiguous(), fields), dest=dest, tag=tag)
                            kill(name, victim)
                        wire.send = header_then_death
                    elif world.rank == victim and steps == {KILL_STEP} and name not in ("{KILLED_BY_THE_SERVER}",
                                                                                      "{KILLED_IN_CLOSE}"):
                        kill(name, victim)
                    rows = own[start:start + {BATCH}]
                    model.zero_grad()
                    torch.nn.functional.cross_entropy(model(x[rows]), y[rows]).backward()
                    ps.step()
                    steps += 1
            if name == "{KILLED_IN_CLOSE}" and world.rank == victim:
                def die():  # in close(): its message to the servers sent, the final weights not yet taken
                    for _ in range(20):
                        ps.mpi.Iprobe()  # lets the MPI library move the message on
                        time.sleep(0.01)
                    kill(name, victim)
                ps._receive_weights = die
            ps.close()
            record["steps"] = steps
        record["accuracy"] = accuracy(model)
    except md.RankDiedError as error:
        record["error"], record["ranks"] = str(error), list(error.ranks)
    record["ended"] = time.time()
    with open(os.path.join(out, f"{{name}}-{{world.rank}}.json"), "w") as file:
        json.dump(record, file)
with open(os.path.join(out, f"done-{{world.rank}}"), "w") as file:
    file.write("done")
"""


def survivors():
    return [rank for rank in range(RANKS) if rank not in {victim for *_, victim in PHASES.values()}]


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """(the job's output, its exit status or None when it was stopped, the records by phase and
    world rank, when each phase's victim killed itself (time.time()), the seconds the job took)."""
    out = tmp_path_factory.mktemp("ps-faults")
    text, status, seconds = run_ulfm_job(out, RANKS, JOB, PHASES, survivors(), RUN_SECONDS, EXIT_SECONDS,
                                         exit_on_rank_loss=EXIT_ON_RANK_LOSS)
    records = phase_records(out, PHASES)
    kills = {name: float((out / f"killed-{name}").read_text()) for name in PHASES if (out / f"killed-{name}").exists()}
    return text, status, records, kills, seconds


def living(name):
    members, _, _, victim = PHASES[name]
    return [rank for rank in members if rank != victim]


def test_async_servers_drop_a_killed_worker_and_reach_the_undisturbed_accuracy(job):
    output, _, records, kills, _ = job
    undisturbed, killed = records["async"], records["async-killed"]
    assert sorted(undisturbed) == PHASES["async"][0], output
    assert sorted(killed) == living("async-killed"), output
    # Both servers dropped worker 4 after the same KILL_STEP gradients, and said so.
    assert killed[0]["lost"] == killed[1]["lost"] == [[4, KILL_STEP]], output
    assert "worker 4 died (seen at " in output and f"after {KILL_STEP} steps, its last step {KILL_STEP - 1}); " \
        "dropped, going on with workers [2, 3] (async)" in output, output
    assert killed[0]["updates"] == killed[1]["updates"]
    seen = killed[0]["seen"][0] - kills["async-killed"]
    print(f"async: the death was seen {seen:.2f} s after the kill")
    assert 0 < seen < DETECTION_SECONDS
    assert sum(update == [4] for update in killed[0]["updates"]) == KILL_STEP
    for worker in (2, 3):
        assert killed[worker]["steps"] == undisturbed[worker]["steps"] == EPOCHS * SAMPLES // 3 // BATCH
    # Every rank left holds the final weights, and they are as good as the undisturbed run's.
    accuracies = {record["accuracy"] for record in killed.values()}
    assert len(accuracies) == 1, killed
    reference = undisturbed[0]["accuracy"]
    assert reference > 0.85, undisturbed
    assert abs(accuracies.pop() - reference) <= 0.02, (killed, reference)


def test_a_worker_that_dies_in_its_close_is_let_go_even_in_plain_sync_mode(job):
    output, _, records, kills, _ = job
    phase = records[KILLED_IN_CLOSE]
    assert sorted(phase) == living(KILLED_IN_CLOSE), output
    assert not [record for record in phase.values() if "error" in record], phase
    steps = EPOCHS * SAMPLES // 2 // BATCH
    assert phase[0]["updates"] == phase[1]["updates"] == [[2, 3]] * steps  # workers 2 and 3 of the phase
    assert phase[0]["lost"] == phase[1]["lost"] == []
    assert phase[2]["steps"] == steps
    assert "worker 3 died after its close(), before the final weights reached it; nothing is lost" in output, output
    assert len({record["accuracy"] for record in phase.values()}) == 1, phase
    ended = max(record["ended"] for record in phase.values()) - kills[KILLED_IN_CLOSE]
    print(f"closed: every survivor had finished {ended:.2f} s after the kill")
    assert ended < DETECTION_SECONDS, phase


@pytest.mark.parametrize("name, victim, per_update", [("softsync", 4, 2), ("backup", 3, 2)])
def test_softsync_and_backup_workers_go_on_without_a_killed_worker(job, name, victim, per_update):
    output, _, records, kills, _ = job
    members = PHASES[name][0]
    phase = records[name]
    assert sorted(phase) == living(name), output
    server = phase[0]
    (lost, steps), = server["lost"]
    assert lost == victim, output  # the phase's own rank of the killed one
    assert steps == KILL_STEP or name == KILLED_BY_THE_SERVER
    assert 0 < server["seen"][0] - kills[name] < DETECTION_SECONDS
    assert f"dropped, going on with workers {[members.index(r) for r in living(name)[1:]]} " \
        f"({PHASES[name][2]['mode']})" in output, output
    applied = [worker for update in server["updates"] for worker in update]
    assert all(len(update) <= per_update for update in server["updates"])
    assert applied.count(victim) <= steps
    per_worker = EPOCHS * -(-(SAMPLES // (len(members) - 1)) // BATCH)
    for rank in living(name)[1:]:
        assert phase[rank]["steps"] == per_worker
    assert len({record["accuracy"] for record in phase.values()}) == 1, phase


@pytest.mark.parametrize("name, dead, said", [
    ("building", 1, "rank 1 of its communicator died while the parameter server was being built, and the parameter "
                    "server cannot start without it"),
    ("sync", 2, "worker 2 died, and the parameter server cannot go on without it"),
    ("server-killed", 0, "the server (rank 0) died, and the parameter server cannot go on without it")])
def test_a_death_in_the_building_plain_sync_or_of_a_server_ends_with_an_error_naming_the_dead_rank_on_every_survivor(
        job, name, dead, said):
    output, _, records, kills, _ = job
    phase = records[name]
    assert sorted(phase) == living(name), output
    for rank, record in phase.items():
        assert record["ranks"] == [dead], record
        assert said in record["error"], record
        assert "--resume" in record["error"]
    ended = max(record["ended"] for record in phase.values()) - kills[name]
    print(f"{name}: every survivor raised within {ended:.2f} s of the kill")
    assert ended < DETECTION_SECONDS, phase


# The phases that went on without a worker: each coordinator's one line at the end of serve()
# names it by its rank in the phase, and where it was lost.
SUMMARIES = {
    "async-killed": ("rank 4 of 5 (a worker of the parameter server, async) at update ",
                     f", after its {KILL_STEP} gradients ("),
    "closed": ("rank 3 of 4 (a worker of the parameter server, sync) at its close() (",
               "nothing: its training was over, and the servers hold the final weights"),
    "softsync": ("rank 4 of 5 (a worker of the parameter server, softsync) at update ",
                 f", after its {KILL_STEP} gradients ("),
    "backup": ("rank 3 of 4 (a worker of the parameter server, sync) at update ",),
}


@pytest.mark.parametrize("name", SUMMARIES)
def test_a_parameter_server_that_dropped_a_worker_sums_it_up_once_at_its_end(job, name):
    output = job[0]
    assert len(loss_summaries(output, *SUMMARIES[name])) == 1, output


def test_the_summaries_tell_only_the_workers_dropped(job):
    output = job[0]
    assert len(loss_summaries(output)) == len(SUMMARIES), output


def test_the_job_ends_with_the_status_of_mpidist_exit_on_rank_loss(job):
    output, status, records, _, seconds = job
    assert all(records[name] for name in PHASES), output
    assert status == EXIT_ON_RANK_LOSS, output
    left = "MPI_Finalize has not returned" in output
    print(f"the job took {seconds:.1f} s" + (" (MPI_Finalize left after MPIDIST_FINALIZE_TIMEOUT)" if left else ""))


@pytest.mark.parametrize("missing, mode, said", [
    ("Open MPI runs without fault tolerance: launch with `mpirun --with-ft ulfm`", "async",
     "launch with `mpirun --with-ft ulfm`. A rank that dies ends the whole job, and what the servers applied since "
     "the newest checkpoint is lost (--resume continues from the newest checkpoint in ps/)"),
    (None, "async", "a worker that dies is dropped and the others go on; a server that dies ends the job"),
    (None, "sync", "plain sync mode waits for every worker: a worker that dies ends the job"),
])
def test_train_elastic_in_ps_mode_says_at_the_start_what_a_death_does(monkeypatch, missing, mode, said):
    from mpidist import runtime  # the command reads the runtime's public name
    from mpidist.cli.train import say_what_survives
    monkeypatch.setattr(runtime, "fault_tolerance_missing", lambda: missing)
    lines = []
    say_what_survives(mode, 1, lambda line, **_: lines.append(line))
    assert len(lines) == 1 and said in lines[0], lines
