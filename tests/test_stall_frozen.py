"""The stall report names a rank frozen inside the collective the others wait in (runtime/stall.py):
its record says it waits there too, as the ranks waiting for it say, but its wait has stopped
polling. DataParallel's gradient buckets on one node need every rank to go on polling, so a rank
frozen there (SIGSTOP) holds the others until MPIDIST_TIMEOUT; the report before it must say who.

Each check launches mpirun itself: the report is printed to the job's output."""
import textwrap

from stall_output import launch, report_before_deadline

# Rank 2 comes first to the gradient exchange and freezes (SIGSTOP to itself) at its first poll
# of the bucket's wait, after it has published that it waits there. Ranks 0 and 1 come 2 s later.
FROZEN_IN_THE_WAIT = textwrap.dedent("""
    import os, signal, sys, time
    import torch
    import mpidist as md
    import mpidist.collectives.node_window as node_window
    md.init()
    rank = md.rank()
    if rank == 2:
        wait_in_collective = node_window.wait_in_collective

        def freezing_wait(test, *args, **kwargs):
            def test_then_freeze():
                os.kill(os.getpid(), signal.SIGSTOP)
                return test()
            return wait_in_collective(test_then_freeze, *args, **kwargs)
        node_window.wait_in_collective = freezing_wait
    model = md.DataParallel(torch.nn.Linear(3, 1, bias=False))
    md.barrier()
    if rank != 2:
        time.sleep(2)
    print(f"rank {rank}: backward", file=sys.stderr, flush=True)
    model(torch.ones(1, 3)).sum().backward()
""")


def test_a_rank_frozen_inside_the_gradient_exchange_is_named_before_the_deadline():
    result, output = launch(FROZEN_IN_THE_WAIT, deadline_s=5)
    assert result.returncode != 0, output
    report = report_before_deadline(output, "mpidist: stall: rank 0 has waited 1 s in the all-reduce of gradient "
                                    "bucket 0 (MPIDIST_STALL_WARNING); ranks [2] have not arrived:\n"
                                    "  rank 2: entered the all-reduce of gradient bucket 0 ",
                                    "did not complete within 5 s (MPIDIST_TIMEOUT)")
    assert "its wait has not polled for" in report, output
    assert output.count("mpidist: stall:") == 1, output  # rank 1 waits too: rank 0 alone reports
