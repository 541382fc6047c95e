"""What a job does when one of its ranks fails (docs/faults.md): an uncaught exception on any rank
aborts the whole job at once, with that rank's traceback (runtime/abort.py), unless
MPIDIST_ABORT_ON_EXCEPTION=0; a rank whose program ends (sys.exit) before a collective the others
wait in makes them raise PeerExitedError within seconds (runtime/stall.py's ExitWatch); and a
wait in a collective past MPIDIST_STALL_WARNING prints the stall report naming the ranks that have
not arrived (runtime/stall.py); after a rank died under ULFM, a survivor whose MPI_Finalize does not
return within MPIDIST_FINALIZE_TIMEOUT leaves with its program's exit status (runtime/leave.py).

Each check launches mpirun itself: the job must end (or stall) as a whole, which a test running
inside the ranks cannot watch."""
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from conftest import REPO, run_python

# The last rank fails at step 3 of a loop of barriers (saying when, so that the test measures
# from there, not from the ranks' start-up); the others wait in the next barrier.
FAILING_RANK = textwrap.dedent("""
    import time
    import mpidist as md
    md.init()
    for step in range(100):
        if step == 3 and md.rank() == md.size() - 1:
            print(f"raising at {{time.time()}}", flush=True)
            raise {exception}("bad value at step 3")
        md.barrier()
""")


def seconds_after_raising(output: str) -> float:
    return time.time() - float(re.search(r"raising at ([0-9.]+)", output).group(1))


def launch(code: str, ranks: int, env: dict, timeout: int = 120):
    result = run_python(code, ranks=ranks, env=env, timeout=timeout)
    return result, result.stdout + result.stderr


@pytest.mark.parametrize("ranks, exception", [(2, "ValueError"), (3, "KeyboardInterrupt"), (5, "ValueError")])
def test_an_uncaught_exception_on_one_rank_ends_the_job_with_its_traceback(ranks, exception):
    # A deadline far beyond the 15 s allowed: only the abort can end the job in time.
    result, output = launch(FAILING_RANK.format(exception=exception), ranks, {"MPIDIST_TIMEOUT": "120"})
    seconds = seconds_after_raising(output)
    assert seconds < 15, f"the job took {seconds:.1f} s to end after the exception:\n{output}"
    assert result.returncode != 0
    traceback = output.index("Traceback (most recent call last)")
    assert f"{exception}: bad value at step 3" in output, output
    announcement = output.index(f"mpidist: rank {ranks - 1} of {ranks} ended with an uncaught {exception}")
    # The rank's own lines come in its order; mpirun's notice of the abort may overtake them.
    assert traceback < announcement and "MPI_ABORT was invoked" in output, output
    assert "DeadlineError" not in output  # no other rank waited out its deadline


# The same failure in a DDP loop over torch.distributed: init_process_group wraps the abort hook
# in its own, which holds what the hooks inside it print until they return.
FAILING_DDP_RANK = textwrap.dedent("""
    import sys
    import time
    import torch
    import torch.distributed as dist
    import mpidist
    dist.init_process_group(sys.argv[1])
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
    for step in range(100):
        if step == 3 and dist.get_rank() == 1:
            print(f"raising at {time.time()}", flush=True)
            raise ValueError("bad value at step 3")
        model(torch.ones(2, 4)).sum().backward()
""")


@pytest.mark.parametrize("backend", ["mpidist", "gloo"])
def test_an_uncaught_exception_under_torch_distributed_ends_the_job_with_its_traceback(backend):
    result = run_python(FAILING_DDP_RANK, ranks=2, env={"MPIDIST_TIMEOUT": "120"}, args=[backend])
    output = result.stdout + result.stderr
    assert seconds_after_raising(output) < 15, output
    assert result.returncode != 0
    traceback = output.index("Traceback (most recent call last)")
    assert "ValueError: bad value at step 3" in output, output
    assert traceback < output.index("mpidist: rank 1 of 2 ended with an uncaught ValueError"), output


def test_without_abort_the_other_ranks_learn_that_the_failed_rank_ended():
    # Without the abort the failed rank's program ends with its traceback, and the rank waiting
    # for it in the next barrier raises PeerExitedError naming it, long before its deadline.
    result, output = launch(FAILING_RANK.format(exception="ValueError"), 2,
                               {"MPIDIST_ABORT_ON_EXCEPTION": "0", "MPIDIST_TIMEOUT": "120"}, timeout=60)
    assert result.returncode != 0
    assert "ValueError: bad value at step 3" in output, output
    assert ("PeerExitedError: rank 0: the barrier call check cannot complete: the program of rank(s) [1] ended "
            "(it returned, called sys.exit or raised an uncaught exception) without entering it" in output), output
    assert "aborting the whole job" not in output and "MPI_ABORT" not in output


EXITING_RANK = textwrap.dedent("""
    import sys
    import time
    import numpy as np
    import mpidist as md
    md.init()
    values = np.ones(4)
    md.allreduce(values)
    if md.rank() == md.size() - 1:
        print(f"raising at {time.time()}", flush=True)  # the moment of the exit, for seconds_after_raising
        sys.exit(3)
    md.allreduce(values)
""")


def test_a_rank_that_exits_without_entering_a_collective_ends_the_job_quickly():
    ranks = 3
    result, output = launch(EXITING_RANK, ranks, {"MPIDIST_TIMEOUT": "120"})
    seconds = seconds_after_raising(output)
    assert seconds < 15, f"the job took {seconds:.1f} s to end after the exit:\n{output}"
    assert result.returncode != 0
    # Whichever waiting rank sees the exit first raises, and its abort ends the others.
    assert re.search(r"PeerExitedError: rank [0-9]+: the allreduce call check cannot complete: the program of "
                     rf"rank\(s\) \[{ranks - 1}\] ended", output), output
    assert "MPI_ABORT was invoked" in output or "calling\n\"abort\"" in output, output


def test_ranks_that_exit_at_different_times_after_the_same_calls_end_normally():
    # The last rank leaves first; rank 0 computes for longer than the grace the others give an
    # exited rank, then makes a collective over a communicator without the exited rank.
    code = textwrap.dedent("""
        import time
        import numpy as np
        import mpidist as md
        from mpi4py import MPI
        md.init()
        values = np.ones(4)
        last = md.rank() == md.size() - 1
        rest = md.world().mpi.Split(MPI.UNDEFINED if last else 0)
        md.allreduce(values)
        if not last:
            time.sleep(4)
            md.Communicator(rest).allreduce(values)
            assert (values == md.size() * (md.size() - 1)).all(), values
    """)
    result, output = launch(code, 3, {"MPIDIST_TIMEOUT": "60"})
    assert result.returncode == 0, output
    assert "PeerExitedError" not in output


def test_a_world_of_one_ends_as_python_does():
    code = FAILING_RANK.format(exception="ValueError").replace("md.size() - 1", "0")
    aborting = run_python(code)
    plain = run_python(code, env={"MPIDIST_ABORT_ON_EXCEPTION": "0"})
    assert aborting.returncode == plain.returncode == 1
    assert aborting.stderr == plain.stderr and "ValueError: bad value at step 3" in plain.stderr


def test_the_stall_report_names_the_rank_that_has_not_arrived():
    # Rank 2 arrives at the second all-reduce 3 s late; the report comes after 1 s, once (from
    # rank 0, the lowest of the ranks waiting), and the all-reduce then completes.
    code = textwrap.dedent("""
        import time
        import numpy as np
        import mpidist as md
        md.init()
        values = np.ones(4)
        md.allreduce(values)
        if md.rank() == 2:
            time.sleep(3)
        md.allreduce(values)
        assert (values == md.size() ** 2).all(), values
    """)
    result, output = launch(code, 3, {"MPIDIST_STALL_WARNING": "1", "MPIDIST_TIMEOUT": "60"})
    assert result.returncode == 0, output
    assert output.count("mpidist: stall:") == 1, output
    assert "rank 0 has waited 1 s in the allreduce call check (MPIDIST_STALL_WARNING); ranks [2] have not arrived" \
        in output, output
    assert "rank 2: last called the allreduce call check, which returned" in output, output


# The last rank stops taking part after one all-reduce (it sleeps, as a frozen rank or one whose
# node lost the network would); the others go on into the ring's transfers with it. Without the
# call check nothing before the algorithm notices: its own waits must end, naming that rank.
SILENT_IN_THE_ALGORITHM = textwrap.dedent("""
    import os, sys, time
    import numpy as np
    import mpidist as md
    from mpidist.errors import DeadlineError
    md.init()
    values = np.ones(1 << 20, dtype=np.float32)
    md.allreduce_async(values, algorithm="ring").wait()  # the engine and the connections exist
    if md.rank() == md.size() - 1:
        time.sleep(60)
        os._exit(0)
    try:
        if sys.argv[1] == "async":
            md.allreduce_async(values, algorithm="ring").wait()
        else:
            md.allreduce(values, algorithm="ring")
    except DeadlineError as error:
        print(f"rank {md.rank()} raised at {time.time()}: {error} peers={error.peers}", flush=True)
        os._exit(0)
""")


@pytest.mark.parametrize("call", ["blocking", "async"])
def test_a_rank_silent_inside_an_algorithm_is_named_at_the_deadline(call):
    started = time.time()
    result = run_python(SILENT_IN_THE_ALGORITHM, ranks=3, args=[call], timeout=90,
                        env={"MPIDIST_CHECK": "0", "MPIDIST_TIMEOUT": "3", "MPIDIST_STALL_WARNING": "60"})
    output = result.stdout + result.stderr
    for rank in (0, 1):
        match = re.search(rf"rank {rank} raised at ([0-9.]+): rank {rank}: the allreduce's transfers with "
                          r"rank\(s\) \[2\] did not complete within 3 s \(MPIDIST_TIMEOUT\): no answer from "
                          r"rank\(s\) \[2\]\..* peers=\(2,\)", output)
        assert match, output
        assert float(match.group(1)) - started < 60, output  # at the deadline, not when rank 2 woke


def test_after_a_death_a_survivor_stuck_in_mpi_finalize_leaves_with_its_exit_status():
    # Under ULFM, rank 2 dies; rank 1 comes to MPI_Finalize 4 s late (after the survivors'
    # agreement at exit), so rank 0 waits for it there past MPIDIST_FINALIZE_TIMEOUT (1 s), as a
    # survivor waits forever when Open MPI's end-of-job barrier does not complete, and must leave
    # with the status given to sys.exit.
    code = textwrap.dedent("""
        import os, signal, sys, time
        import mpidist as md
        from mpi4py import MPI
        from mpidist.runtime import leave
        from mpidist.runtime.mpi import failed_ranks
        md.init()
        if md.rank() == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        assert failed_ranks(MPI.COMM_WORLD, wait=30) == [2]
        if md.rank() == 1:
            agree = leave.a_survivor_knows_of_a_death
            leave.a_survivor_knows_of_a_death = lambda MPI, known: (agree(MPI, known), time.sleep(4))[0]
        sys.exit(3)
    """)
    result = run_python(code, ranks=3, env={"MPIDIST_FINALIZE_TIMEOUT": "1"}, mpirun_options=("--with-ft", "ulfm"))
    output = result.stdout + result.stderr
    assert result.returncode == 3, output
    assert "mpidist: rank 0: MPI_Finalize has not returned 1 s (MPIDIST_FINALIZE_TIMEOUT) after rank(s) [2] of the " \
        "job died" in output and "exiting with status 3 without it" in output, output
    assert "rank 1: MPI_Finalize has not returned" not in output, output


def test_a_survivor_that_has_not_heard_of_the_death_still_leaves_a_stuck_mpi_finalize():
    # Under ULFM, rank 2 dies. Rank 1 has not heard of it by the time it leaves (as a rank that
    # never exchanged with the dead one may not have; here its own knowledge is hidden), and its
    # MPI_Finalize never returns (Open MPI's end-of-job barrier after a death). It learns of the
    # death from the survivors' agreement at exit, so its MPI_Finalize runs under the watchdog.
    code = textwrap.dedent("""
        import os, signal, sys, time
        import mpidist as md
        from mpi4py import MPI
        from mpidist.runtime import leave
        from mpidist.runtime.mpi import failed_ranks
        md.init()
        if md.rank() == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        if md.rank() == 0:
            assert failed_ranks(MPI.COMM_WORLD, wait=30) == [2]
        else:
            leave.failed_ranks = lambda comm, wait=0.0: []
            leave._mpi_function = lambda name: lambda: time.sleep(120)
        sys.exit(3)
    """)
    result = run_python(code, ranks=3, env={"MPIDIST_FINALIZE_TIMEOUT": "1"}, mpirun_options=("--with-ft", "ulfm"),
                        timeout=90)
    output = result.stdout + result.stderr
    assert "mpidist: rank 1: MPI_Finalize has not returned 1 s (MPIDIST_FINALIZE_TIMEOUT) after a rank of the job " \
        "died, as another rank knew" in output and "exiting with status 3 without it" in output, output
    assert result.returncode == 3, output


@pytest.mark.parametrize("uncaught, requested, status", [
    (None, None, 0), (None, 3, 3), (None, 258, 2), (None, "a message", 1), (ValueError("bad"), None, 1),
    (KeyboardInterrupt(), None, 130)])
def test_the_exit_status_a_stuck_mpi_finalize_is_left_with(monkeypatch, uncaught, requested, status):
    from mpidist.runtime import leave
    monkeypatch.setattr(leave.sys, "last_value", uncaught, raising=False)
    monkeypatch.setattr(leave, "_requested_status", requested)
    assert leave.exit_status() == status


def test_mpidist_train_ends_the_job_when_a_frozen_rank_makes_the_others_miss_their_deadline(tmp_path):
    # Rank 1 stops itself (SIGSTOP: frozen, not dead) at its third step; the others raise
    # DeadlineError at MPIDIST_TIMEOUT, which `mpidist train` reports as its error: the job must
    # then end, not wait in MPI_Finalize for the frozen rank forever.
    code = textwrap.dedent("""
        import os, signal, sys
        import mpidist.cli.train as train
        from mpidist.cli import main
        real_batch, steps = train.train_batch, []
        def freezing_batch(*args):
            steps.append(1)
            if len(steps) == 3 and os.environ["OMPI_COMM_WORLD_RANK"] == "1":
                os.kill(os.getpid(), signal.SIGSTOP)
            return real_batch(*args)
        train.train_batch = freezing_batch
        sys.exit(main(sys.argv[1:]))
    """)
    env = {k: v for k, v in os.environ.items() if k not in ("OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK",
                                                           "PYTEST_ISOLATE_MPI_IS_FORKED")}
    env.update({"MPIDIST_TIMEOUT": "5", "MPIDIST_STALL_WARNING": "2"})
    cmd = ["mpirun", "--oversubscribe", "--bind-to", "none", "-np", "3", sys.executable, "-c", code, "train",
           "--epochs", "1", "--no-progress", "--checkpoint-dir", str(tmp_path)]
    process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO,
                               start_new_session=True)
    try:
        output = process.communicate(timeout=150)[0]
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output = process.communicate()[0]
        pytest.fail("the job still ran 150 s after it began (MPIDIST_TIMEOUT 5 s):\n" + output)
    assert process.returncode == 2, output
    assert "did not complete within 5 s (MPIDIST_TIMEOUT)" in output, output


def test_the_status_of_the_mpidist_command_is_the_one_a_stuck_mpi_finalize_is_left_with(monkeypatch):
    # The mpidist command runs `sys.exit(main())`, which looks sys.exit up before main() calls
    # md.init(), where the sys.exit that notes the status is put in place: under ULFM, after a
    # death, a command that failed left a stuck MPI_Finalize with status 0.
    from mpidist.cli import main
    from mpidist.runtime import leave
    monkeypatch.setattr(leave, "_requested_status", None)
    monkeypatch.setattr(leave.sys, "last_value", None, raising=False)
    assert main(["train", "--mode", "pipeline", "--elastic"]) == 2
    assert leave.exit_status() == 2
