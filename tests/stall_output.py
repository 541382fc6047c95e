"""The stall report as the tests of stall reports find it: a script launched under mpirun with
the report after 1 s of waiting (MPIDIST_STALL_WARNING) and a deadline (MPIDIST_TIMEOUT), and the
report searched for in the job's output, where it must come before the deadline's error."""
from conftest import run_python


def launch(code: str, *, deadline_s: int, ranks: int = 3, timeout: int = 120):
    """Run ``code`` on ``ranks`` ranks with the stall report after 1 s and MPIDIST_TIMEOUT
    ``deadline_s``; returns the result and its output (standard output, then standard error)."""
    result = run_python(code, ranks=ranks, env={"MPIDIST_STALL_WARNING": "1", "MPIDIST_TIMEOUT": str(deadline_s)},
                        timeout=timeout)
    return result, result.stdout + result.stderr


def report_before_deadline(output: str, report: str, deadline: str) -> str:
    """The output from the first ``report`` to the first ``deadline`` (the deadline's error);
    asserts that both are there, the report first."""
    start, end = output.find(report), output.find(deadline)
    assert -1 < start < end, output
    return output[start:end]
