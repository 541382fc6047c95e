"""One run of the GPU check: its settings, the facts it learns, the environment and the log of the
commands it runs (cut off at its time budget), and the steps it records."""
from __future__ import annotations

import dataclasses
import datetime
import os
import signal
import subprocess
import sys
import tempfile
import time

from . import report

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CUDA_MPI = os.path.join(REPO, ".cuda-mpi")  # `make cuda-mpi` builds it
CARRIED_NCCL = os.path.join(REPO, ".nccl", "lib", "libnccl.so.2")  # `make nccl` builds it
SITE = os.path.join(REPO, "build", "gpu-site")


@dataclasses.dataclass
class Step:
    name: str
    status: str  # "passed", "failed" or "skipped"
    detail: str = ""
    seconds: float = 0.0


class GpuCheck:
    """One run: its settings, the facts it learned, its steps and its log."""

    def __init__(self, out: str, wheels: str, dry_run: bool, require_targets: bool = False, cuda_mpi: str = CUDA_MPI,
                 budget: float | None = None):
        self.out, self.wheels, self.dry_run, self.require_targets = out, wheels, dry_run, require_targets
        # A machine lent for minutes: past this moment no step starts, and every command is cut
        # off at it, so that the report is written before the machine goes back.
        self.deadline = time.monotonic() + budget if budget else None
        self.cuda_mpi = cuda_mpi  # the carried CUDA-aware Open MPI, used where the machine's is not
        self.carried = False  # whether it is in use
        self.device = "cpu" if dry_run else "cuda"
        self.steps: list[Step] = []
        self.facts: dict = {}
        self.launches: list[dict] = []
        self.benchmark_rows: list[dict] = []
        self.allreduce_rows: list[dict] = []  # mpidist bench allreduce --device cuda, every launch
        self.targets: list[dict] = []
        self.site = None  # where missing wheels went
        self.mpi_prefix = None  # where a carried MPI library went
        self.launcher = None  # [mpirun, its options..., "-np"]
        self.started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        os.makedirs(out, exist_ok=True)
        self.log_path = os.path.join(out, "gpu-check.log")
        open(self.log_path, "w").close()

    def env(self, **extra) -> dict:
        """The environment of every command: this tree and the installed wheels first on the path,
        the carried MPI library where it is in use, the NCCL built by `make nccl` where there is
        one (unless the caller names another); `extra` set (None: removed)."""
        env = dict(os.environ)
        paths = [REPO] + ([self.site] if self.site else []) + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        env["PYTHONPATH"] = os.pathsep.join(paths)
        env["PYTHONUNBUFFERED"] = "1"
        if self.mpi_prefix:
            env["PATH"] = os.path.join(self.mpi_prefix, "bin") + os.pathsep + env.get("PATH", "")
            env["MPI4PY_LIBMPI"] = os.path.join(self.mpi_prefix, "lib")
        if self.carried:
            # Open MPI finds its components and help files under OPAL_PREFIX; its libraries, and
            # mpi4py's libmpi, come from the carried tree before the machine's own.
            lib = os.path.join(self.cuda_mpi, "lib")
            env["PATH"] = os.path.join(self.cuda_mpi, "bin") + os.pathsep + env.get("PATH", "")
            env["LD_LIBRARY_PATH"] = os.pathsep.join([lib] + [p for p in env.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p])
            env["OPAL_PREFIX"] = self.cuda_mpi
            env["MPI4PY_LIBMPI"] = lib
            if self.dry_run:  # no CUDA driver: Open MPI's banner saying so is expected
                env["OMPI_MCA_opal_warn_on_missing_libcuda"] = "0"
        if os.path.exists(CARRIED_NCCL):
            env.setdefault("MPIDIST_NCCL_LIBRARY", CARRIED_NCCL)
        env.setdefault("HOME", tempfile.gettempdir())  # Open MPI will not start without one
        if os.geteuid() == 0:  # Open MPI refuses root unless told
            env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
            env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        env.setdefault("OMPI_MCA_rmaps_base_oversubscribe", "1")
        for key, value in extra.items():
            if value is None:
                env.pop(key, None)
            else:
                env[key] = value
        return env

    def command(self, args, timeout: float = 120, env=None) -> subprocess.CompletedProcess:
        """Run `args` in the tree, its output appended to the log; never raises for a bad exit."""
        start = time.perf_counter()
        if self.deadline is not None:
            timeout = max(1.0, min(timeout, self.deadline - time.monotonic()))
        try:
            # A session of its own, so that a timeout ends mpirun's ranks too, not mpirun alone.
            with subprocess.Popen(args, cwd=REPO, env=env or self.env(), stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, start_new_session=True) as process:
                try:
                    stdout, stderr = process.communicate(timeout=timeout)
                    code = process.returncode
                except subprocess.TimeoutExpired:
                    os.killpg(process.pid, signal.SIGKILL)
                    stdout, stderr = process.communicate()
                    code, stderr = 124, stderr + f"\n(killed after {timeout:.0f} s)"
            result = subprocess.CompletedProcess(args, code, stdout, stderr)
        except OSError as error:
            result = subprocess.CompletedProcess(args, 127, "", str(error))
        with open(self.log_path, "a") as log:
            log.write(f"$ {' '.join(map(str, args))}\n(exit {result.returncode}, "
                      f"{time.perf_counter() - start:.1f} s)\n{result.stdout}{result.stderr}\n")
        return result

    def python(self, code: str, timeout: float = 120, env=None) -> subprocess.CompletedProcess:
        return self.command([sys.executable, "-c", code], timeout, env)

    def step(self, name: str, work) -> Step:
        """Run work() -> (status, detail) as a step; an exception fails it."""
        start = time.perf_counter()
        print(f"gpu-check: {name} ...", flush=True)
        if self.deadline is not None and time.monotonic() >= self.deadline:
            work = lambda: ("skipped", "the run's time budget (--budget) was spent before this step")  # noqa: E731
        try:
            status, detail = work()
        except Exception as error:  # the step fails, the run goes on and reports it
            status, detail = "failed", f"{type(error).__name__}: {error}"
        step = Step(name, status, detail, round(time.perf_counter() - start, 1))
        self.steps.append(step)
        print(f"gpu-check: {name}: {status.upper()} ({step.seconds} s){': ' + detail if detail else ''}", flush=True)
        report.write(self, finished=False)  # a run cut short still leaves what it found
        return step

    def finish(self) -> int:
        """Write the final report and say the result; the exit status: 1 if anything failed."""
        return report.finish(self)


def tail(result, lines: int = 15) -> str:
    """The end of a command's output, on one line."""
    text = (result.stdout or "") + (result.stderr or "")
    return " | ".join(line for line in text.strip().splitlines()[-lines:] if line.strip()) or f"exit {result.returncode}"


def first_line(text: str) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip()), "")
