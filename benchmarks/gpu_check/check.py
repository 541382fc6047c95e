"""Do mpidist's CUDA paths work on this NVIDIA GPU, and are its kernels as fast as they should be?

    make gpu-check                   # a machine with an NVIDIA GPU; no network needed
    make gpu-check GPU_DRY_RUN=1     # anywhere: the steps that need no GPU, the rest reported skipped

One command, in this order (docs/gpu.md):
  1. the machine: GPU, driver, CUDA, torch, CuPy; the MPI library mpi4py loads and the launchers
     (mpirun, mpiexec) on PATH, and which of them belongs to that library;
  2. the wheels of benchmarks/gpu-wheels.txt that this Python lacks, installed from the wheels
     folder (`make gpu-wheels`) into build/gpu-site, without touching the Python's own packages;
  3. mpidist._C built with CUDA for this GPU's architecture only (CPU-only, or as built, in a dry run);
  4. where the MPI library is not CUDA-aware, the CUDA-aware Open MPI carried with the tree
     (`make cuda-mpi`, .cuda-mpi) takes its place, launcher included, for every later step; where
     the library is CUDA-aware, a device-to-device send and receive through it must deliver the
     bytes sent (mpidist's own probe, mpidist/runtime/cuda_aware.py);
  5. real mpirun launches of 2 and 4 ranks sharing the GPU (benchmarks/gpu_check_ranks.py) through
     the node window in GPU memory (CUDA IPC): every all-reduce algorithm, broadcast, allgather and
     reduce_scatter on torch and CuPy GPU arrays, algorithm="nccl" as a peer, the training modes
     (DataParallel, Pipeline, ParameterServer, torch DDP over the backend) on a CUDA module against
     CPU training, and Horovod's behaviours on the GPU (mpidist.torch: mixed CPU/GPU tensors
     refused, alltoall with splits, hvd.join(device), SyncBatchNorm, a model over two devices);
  6. `mpidist bench allreduce --device cuda` on 2 and 4 ranks sharing the GPU, 4 KiB to 1 GiB (to
     256 MiB on 4 ranks), float32: the device window, the staged route, the CUDA-aware route
     where there is one, NCCL where it runs, and the bound; the targets from 64 MiB on: the
     window >= 20x the staged route, >= 0.5 of the bound, and at least NCCL's bus bandwidth where
     NCCL ran; then the window and NCCL on 2 ranks again with the GPU shared through MPS
     (nvidia-cuda-mps-control), where the machine has it, recorded beside the rest;
  7. the CUDA tests of tests/ (kernels against torch, host staging, Adasum) in one pytest run, and
     the collectives on 2 ranks through host staging (MPIDIST_DEVICE_WINDOW=0) and, where
     `mpidist info` reports a CUDA-aware MPI, straight from GPU memory;
  8. benchmarks/kernels.py --device cuda, 1 MiB to 1 GiB, against the device-to-device copy and
     torch's own ops, and the targets: reduce and reduce_scale reach 0.8 of the copy's bandwidth
     from 64 MiB on (float32, bfloat16), and bfloat16 reduce is at least as fast as torch's add_.

With --budget SECONDS no step starts after that many seconds and a command still running then is
stopped: the steps left are reported skipped, and the report is written all the same.

It writes results.json, summary.md, gpu-check.log and the benchmark's JSON and PNG to --out
(default: $OUT if set, else benchmarks/results/gpu-check, or build/gpu-check-dry-run for a dry
run), and exits 1 if any check failed (a missed speed target too, with --require-targets).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import glob
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CUDA_MPI = os.path.join(REPO, ".cuda-mpi")  # `make cuda-mpi` builds it
WHEEL_LIST = os.path.join(REPO, "benchmarks", "gpu-wheels.txt")
SITE = os.path.join(REPO, "build", "gpu-site")
MIB = 1 << 20
BENCH_SIZES = {"cuda": ["1M", "4M", "16M", "64M", "256M", "1G"], "cpu": ["4K"]}
BENCH_DTYPES = ["float32", "bfloat16", "float16"]
# By ranks: 4 ranks on one GPU stop at 256 MiB to keep the run within a lent machine's minutes.
ALLREDUCE_BENCH_SIZES = {2: "4K,1M,64M,256M,1G", 4: "4K,1M,64M,256M"}
ALLREDUCE_BENCH_DTYPES = "float32"
# Under MPS the ranks' kernels share the GPU at once instead of taking turns: the small sizes show
# the fixed cost of a call, the device window against NCCL where NCCL runs.
MPS_BENCH = ["--sizes", "4K,1M,64M,256M", "--dtype", "float32", "--algorithms",
             "hierarchical,staged:hierarchical,nccl,bound"]
STAGED_FACTOR = 20  # the device window's all-reduce against the staged route, from 64 MiB
BOUND_FRACTION = 0.5  # ... and against the bound
TARGET_FROM_BYTES = 64 * MIB
COPY_FRACTION = 0.8
# The tests of tests/ that need a GPU, in one pytest run. The two tests of a build without CUDA
# or a machine without a GPU ("without" in their names) cannot run here and are left out.
CUDA_TESTS = ["tests/test_kernels.py", "tests/test_buffers.py", "tests/test_adasum.py"]
CUDA_TEST_SELECTION = "cuda and not without"
LAUNCH_TIMEOUT = 240


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

    # ---- running things -------------------------------------------------------------------------

    def env(self, **extra) -> dict:
        """The environment of every command: this tree and the installed wheels first on the path."""
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
        self.write_report(finished=False)  # a run cut short still leaves what it found
        return step

    # ---- 1. the machine -----------------------------------------------------------------------

    def machine(self):
        facts = self.facts
        facts["python"] = f"{platform.python_version()} ({sys.executable})"
        facts["platform"] = platform.platform()
        facts["gpu"] = gpu_facts(self.command)
        nvcc = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if os.path.exists("/usr/local/cuda/bin/nvcc") else None)
        release = re.search(r"release [^\n]*", self.command([nvcc, "--version"]).stdout) if nvcc else None
        facts["nvcc"] = f"{nvcc}: {release.group(0)}" if release else f"{nvcc or 'not found'}"
        probe = self.python(LIBRARIES_PROBE)
        facts.update(json.loads(probe.stdout) if probe.returncode == 0 else {"torch": f"cannot import: {tail(probe)}"})
        if self.dry_run:
            return "passed", f"dry run: {facts['gpu'] or 'no GPU'} (nothing here needs one)"
        if not facts["gpu"]:
            return "failed", "no NVIDIA GPU found (nvidia-smi): run `make gpu-check GPU_DRY_RUN=1` on a machine without one"
        if not facts.get("torch_cuda_available"):
            return "failed", f"torch {facts.get('torch')} sees no GPU (torch.cuda.is_available() is False)"
        return "passed", f"{facts['gpu']['name']}, compute capability {facts['gpu']['compute_cap']}"

    # ---- 2. wheels ---------------------------------------------------------------------------------

    def install_wheels(self):
        wanted = read_wheel_list(WHEEL_LIST)
        missing = [w for w in wanted if w["import"] and not self.importable(w["import"])]
        if self.dry_run:
            return self.rehearse_install(wanted, missing)
        if not missing:
            return "passed", "every module of benchmarks/gpu-wheels.txt is already installed"
        self.site = self.pip_install([w["requirement"] for w in missing], SITE)
        still = [w["import"] for w in missing if not self.importable(w["import"])]
        if still:
            return "failed", f"installed {', '.join(w['name'] for w in missing)}, but {', '.join(still)} still cannot be imported"
        return "passed", f"installed from {self.wheels} into {self.site}: {', '.join(w['requirement'] for w in missing)}"

    def rehearse_install(self, wanted, missing):
        """Dry run: install the listed wheels that suit this Python into a scratch folder, so the
        install command itself runs, and say what it left out."""
        if missing:
            return "failed", f"this Python lacks {', '.join(w['name'] for w in missing)}: the later steps cannot run"
        if not os.path.isdir(self.wheels):
            return "skipped", f"no wheels folder {self.wheels} (`make gpu-wheels` makes it); this Python has every module"
        files = wheel_files(self.wheels)
        suitable = [w for w in wanted if any(f["name"] == w["name"] and f["version"] == w["version"] and f["suits"]
                                             for f in files)]
        others = [w["requirement"] for w in wanted if w not in suitable]
        if suitable:
            with tempfile.TemporaryDirectory() as scratch:
                site = self.pip_install([w["requirement"] for w in suitable], scratch)
                if not site:
                    return "failed", f"pip installed nothing importable from {self.wheels}"
        detail = f"this Python has every module; installing {len(suitable)} wheels of {self.wheels} into a scratch folder worked"
        if others:
            detail += f"; skipped (no wheel for this Python in the folder): {', '.join(others)}"
        return "passed", detail

    def pip_install(self, requirements, prefix: str):
        """Install `requirements` from the wheels folder only, with no dependencies (the list names
        them all), under `prefix`. Returns its site-packages folder."""
        if not os.path.isdir(self.wheels):
            raise RuntimeError(f"the wheels folder {self.wheels} is missing: run `make gpu-wheels` where PyPI can be "
                               f"reached and bring {os.path.relpath(self.wheels, REPO)} along")
        result = self.command([sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--no-compile",
                               "--ignore-installed", "--disable-pip-version-check", "--find-links", self.wheels,
                               "--prefix", prefix, *requirements], timeout=300)
        if result.returncode != 0:
            raise RuntimeError(f"pip install from {self.wheels} failed: {tail(result)}")
        sites = sorted(glob.glob(os.path.join(prefix, "**", "*-packages"), recursive=True), key=len)
        return sites[0] if sites else None

    def importable(self, module: str) -> bool:
        return self.python(f"import {module}", timeout=60).returncode == 0

    # ---- 3. the MPI library and its launcher -----------------------------------------------

    def mpi(self):
        found = self.python(MPI_PROBE)
        if found.returncode != 0:
            libmpi = [w for w in read_wheel_list(WHEEL_LIST) if w["libmpi"]]
            if self.dry_run or not libmpi:
                return "failed", f"mpi4py loads no MPI library: {tail(found)}"
            # The image's mpi4py without an MPI library of its own: the carried one.
            self.mpi_prefix = os.path.join(SITE, "mpi")
            self.pip_install([w["requirement"] for w in libmpi], self.mpi_prefix)
            found = self.python(MPI_PROBE)
            if found.returncode != 0:
                return "failed", f"mpi4py loads no MPI library, not even the carried {libmpi[0]['requirement']}: {tail(found)}"
            self.facts["mpi_installed_from_wheel"] = libmpi[0]["requirement"]
        library = json.loads(found.stdout)
        self.facts.update(library)
        family = mpi_family(library["mpi_library"])
        launchers = {}
        path = self.env()["PATH"]
        for name in ("mpirun", "mpiexec"):
            where = shutil.which(name, path=path)
            if where:
                launchers[name] = {"path": where, "version": first_line(self.command([where, "--version"], 30).stdout)}
        self.facts["launchers"] = launchers
        chosen = [info for info in launchers.values() if launcher_family(info["version"]) == family]
        if not chosen:
            return "failed", (f"mpi4py loads {library['mpi_library']!r}, but no mpirun/mpiexec on PATH belongs to it "
                              f"(found: {launchers or 'none'})")
        self.launcher = launch_prefix(chosen[0]["path"], family)
        self.facts["launcher"] = " ".join(self.launcher)
        return "passed", f"{library['mpi_library']} (mpi4py {library['mpi4py']}); launcher: {' '.join(self.launcher)} N"

    # ---- 4. the build ------------------------------------------------------------------------

    def build(self):
        if self.dry_run:
            # Rebuilt CPU-only when the sources are newer than the module; an existing build
            # (with or without CUDA) is used as it is.
            env = self.env(MPIDIST_CUDA="0")
            args = [sys.executable, "setup.py", "build_ext", "--inplace"]
        else:
            arch = self.facts["gpu"]["compute_cap"].replace(".", "")
            env = self.env(MPIDIST_CUDA="1", MPIDIST_CUDA_ARCHS=arch)
            args = [sys.executable, "setup.py", "build_ext", "--inplace", "--force"]
        result = self.command(args, timeout=420, env=env)
        if result.returncode != 0:
            return "failed", f"setup.py build_ext failed: {tail(result)}"
        probe = self.python("import json, mpidist._C as c; print(json.dumps([bool(c.built_with_cuda), "
                            "c.cuda_device_count() if c.built_with_cuda else 0]))")
        if probe.returncode != 0:
            return "failed", f"the built mpidist._C does not import: {tail(probe)}"
        with_cuda, devices = json.loads(probe.stdout)
        self.facts["extension_built_with_cuda"] = with_cuda
        if self.dry_run:
            return "passed", f"mpidist._C up to date ({'with' if with_cuda else 'without'} CUDA)"
        if not with_cuda or devices < 1:
            return "failed", f"mpidist._C built_with_cuda={with_cuda}, sees {devices} CUDA devices"
        return "passed", f"mpidist._C with CUDA for sm_{env['MPIDIST_CUDA_ARCHS']}, sees {devices} CUDA device(s)"

    def info(self):
        # What the library itself detects: a forced MPIDIST_CUDA_AWARE of the caller is left out.
        result = self.command([sys.executable, "-m", "mpidist.cli", "info", "--json"],
                              env=self.env(MPIDIST_CUDA_AWARE=None))
        if result.returncode != 0:
            return "failed", f"mpidist info failed: {tail(result)}"
        info = json.loads(result.stdout[result.stdout.index("{"):])
        self.facts["mpidist_info"] = info
        return "passed", (f"cuda_aware_mpi={info['cuda_aware_mpi']} ({info.get('cuda_aware_mpi_how', '-')}), "
                          f"mpi library {info['mpi_library']}")

    def carried_mpi(self):
        """Where the library is not CUDA-aware: the carried CUDA-aware Open MPI instead, its
        launcher and what mpidist detects in it."""
        if self.facts.get("mpidist_info", {}).get("cuda_aware_mpi"):
            return "skipped", "the machine's MPI library is CUDA-aware"
        if not os.path.exists(os.path.join(self.cuda_mpi, "bin", "mpirun")):
            return "skipped", f"no carried MPI in {self.cuda_mpi} (`make cuda-mpi` builds it)"
        machine = (self.launcher, dict(self.facts))
        self.carried = True
        self.facts["mpi_carried"] = self.cuda_mpi
        status, detail = self.mpi()
        if status == "passed":
            status, detail = self.info()
        if status != "passed":  # the later steps go on with the machine's MPI library
            self.carried, (self.launcher, self.facts) = False, machine
            return status, f"the carried MPI in {self.cuda_mpi}: {detail}"
        if self.dry_run:
            # Without a CUDA driver Open MPI turns its CUDA support off: built with it is what counts.
            built = "MPIX_Query_cuda_support() = 1" in self.facts["mpidist_info"].get("cuda_aware_mpi_how", "")
            return ("passed" if built else "failed"), f"{self.cuda_mpi} (dry run: the launch uses it): {detail}"
        if not self.facts["mpidist_info"]["cuda_aware_mpi"]:
            self.carried, (self.launcher, self.facts) = False, machine
            return "failed", f"the carried MPI in {self.cuda_mpi} is not CUDA-aware: {detail}"
        return "passed", f"{self.cuda_mpi}: {detail}"

    def probe(self):
        """mpidist's probe of a CUDA-aware library: a device-to-device send and receive."""
        if not self.facts.get("mpidist_info", {}).get("cuda_aware_mpi"):
            return "skipped", "the MPI library is not CUDA-aware"
        if self.dry_run:
            return "skipped", "no GPU to probe"
        result = self.python("import json; from mpidist.runtime.cuda_aware import probe; print(json.dumps(probe(0)))",
                             timeout=180, env=self.env(MPIDIST_CUDA_AWARE=None))
        if result.returncode != 0:
            return "failed", f"the probe did not run: {tail(result)}"
        failure = json.loads(result.stdout.strip().splitlines()[-1])
        return ("failed", failure) if failure else ("passed", "the bytes sent from GPU memory arrived intact")

    # ---- 5. the CUDA tests --------------------------------------------------------------------

    def cuda_tests(self):
        junit = os.path.join(tempfile.mkdtemp(prefix="gpu-check-"), "cuda-tests.xml")
        args = [sys.executable, "-m", "pytest", *CUDA_TESTS, "-k", CUDA_TEST_SELECTION, "-p", "no:cacheprovider",
                f"--junitxml={junit}", "-q", *pytest_mpi_options(self.launcher)]
        result = self.command(args, timeout=420)
        if not os.path.exists(junit):
            return "failed", f"pytest wrote no report (exit {result.returncode}): {tail(result)}"
        counts = read_junit(junit)
        return judge_tests(counts, self.dry_run, result.returncode)

    # ---- 6. multi-rank launches ---------------------------------------------------------------

    def launch_plan(self, window: bool):
        """(ranks, route, environment changes, --expect-cuda-aware, more arguments) of each launch
        through the device window (`window`), else of the other routes. The training modes and
        Horovod's behaviours run in the device window's launches, whose route they take; the
        staged and CUDA-aware routes' training passed on the H100 before the window existed
        (benchmarks/results/gpu-check-h100/), and they run on 2 ranks only (4 ranks of host
        staging passed there too), to keep the run within a lent machine's minutes."""
        if self.dry_run:
            return [(2, "CPU buffers", {}, None, [])] if window else []
        if window:
            return [(ranks, "device window", {"MPIDIST_CUDA_AWARE": "0", "MPIDIST_DEVICE_WINDOW": None,
                                              "NCCL_MULTI_RANK_GPU_ENABLE": "1"}, "no",
                     ["--device-window", "yes", "--nccl"]) for ranks in (2, 4)]
        plan = [(2, "host staging", {"MPIDIST_CUDA_AWARE": "0", "MPIDIST_DEVICE_WINDOW": "0"}, "no",
                 ["--skip-training"])]
        if self.facts.get("mpidist_info", {}).get("cuda_aware_mpi"):
            plan.append((2, "CUDA-aware MPI", {"MPIDIST_CUDA_AWARE": None, "MPIDIST_DEVICE_WINDOW": "0"}, "yes",
                         ["--skip-training"]))
        return plan

    def launches_of(self, window: bool):
        for ranks, route, changes, expect_aware, more in self.launch_plan(window):
            what = "collectives" if "--skip-training" in more else "collectives, training modes and Horovod's behaviours"
            self.step(f"{ranks} ranks, {route}: {what}", lambda: self.launch(ranks, route, changes, expect_aware, more))

    def launch(self, ranks: int, route: str, changes: dict, expect_aware, more=()):
        folder = tempfile.mkdtemp(prefix=f"gpu-check-{ranks}ranks-")
        args = [*self.launcher, str(ranks), sys.executable, os.path.join(REPO, "benchmarks", "gpu_check_ranks.py"),
                "--device", self.device, "--out", folder, "--expect-ranks", str(ranks), *more]
        if expect_aware:
            args += ["--expect-cuda-aware", expect_aware]
        # A rank whose peer died waits this long, not the default five minutes, before it says so.
        result = self.command(args, timeout=LAUNCH_TIMEOUT, env=self.env(MPIDIST_TIMEOUT="60", **changes))
        launch = merge_ranks(folder, ranks, result.returncode)
        launch.update(ranks=ranks, route=route)
        self.launches.append(launch)
        if "--nccl" in more:
            self.facts.setdefault("nccl_runs", {})[f"{ranks} ranks"] = nccl_outcome(launch["checks"])
        failed = [c for c in launch["checks"] if not c["ok"] and not is_peer(c)]
        if failed:
            shown = "; ".join(f"{c['name']}: {c['detail'][:300]}" for c in failed[:5])
            more = f" (and {len(failed) - 5} more, see results.json)" if len(failed) > 5 else ""
            return "failed", f"{len(failed)} of {len(launch['checks'])} checks failed: {shown}{more}"
        if launch["problem"]:
            return "failed", launch["problem"] + (f": {tail(result)}" if result.returncode else "")
        return "passed", passed_on_every_rank(launch["checks"])

    # ---- 7. the kernel benchmark -----------------------------------------------------------------

    def benchmark(self):
        path = os.path.join(self.out, f"kernels-{self.device}.json")
        args = [sys.executable, os.path.join(REPO, "benchmarks", "kernels.py"), "--device", self.device,
                "--sizes", *BENCH_SIZES[self.device], "--dtypes", *BENCH_DTYPES, "--json", path]
        args += ["--reps", "3"] if self.dry_run else ["--reps", "20", "--plot", path.replace(".json", ".png")]
        result = self.command(args, timeout=420)
        if result.returncode != 0 or not os.path.exists(path):
            return "failed", f"benchmarks/kernels.py failed: {tail(result)}"
        with open(path) as f:
            self.benchmark_rows = json.load(f)
        if not self.benchmark_rows:
            return "failed", "benchmarks/kernels.py wrote no rows"
        self.targets += evaluate_targets(self.benchmark_rows)
        return "passed", f"{len(self.benchmark_rows)} rows"

    # ---- 8. the all-reduce benchmark by route ---------------------------------------------------

    def allreduce_benchmark(self, ranks: int, name: str = "", options=None, env=None, setting: str = ""):
        """`mpidist bench allreduce --device cuda` on `ranks` ranks, its rows judged against the
        targets; `setting` names a run under other conditions in the targets' names."""
        path = os.path.join(self.out, f"bench-allreduce-cuda-{ranks}ranks{name}.json")
        options = options or ["--sizes", ALLREDUCE_BENCH_SIZES[ranks], "--dtype", ALLREDUCE_BENCH_DTYPES]
        args = [*self.launcher, str(ranks), sys.executable, "-m", "mpidist.cli", "bench", "allreduce", "--device",
                "cuda", *options, "--iters", "5", "--warmup", "1", "--json", path]
        result = self.command(args, timeout=LAUNCH_TIMEOUT, env=env or self.env(MPIDIST_TIMEOUT="60",
                                                                                NCCL_MULTI_RANK_GPU_ENABLE="1"))
        with open(path.replace(".json", ".txt"), "w") as f:
            f.write(result.stdout + result.stderr)
        if not os.path.exists(path):
            return "failed", f"mpidist bench wrote no rows: {tail(result)}"
        with open(path) as f:
            rows = json.load(f)
        self.allreduce_rows += [dict(row, setting=setting) for row in rows] if setting else rows
        self.targets += allreduce_targets(rows, setting)
        wrong = [f"{r['algorithm']} {r['dtype']} {r['bytes']}" for r in rows if r["wrong"]]
        if wrong or result.returncode:
            return "failed", f"wrong results in {wrong}" if wrong else f"exit {result.returncode}: {tail(result)}"
        return "passed", f"{len(rows)} rows: {sorted({r['algorithm'] for r in rows})}"

    def allreduce_benchmark_mps(self):
        """The 2-rank benchmark again with the GPU shared through an MPS daemon of this run's own."""
        control = shutil.which("nvidia-cuda-mps-control")
        if control is None:
            return "skipped", "no nvidia-cuda-mps-control on PATH"
        folder = tempfile.mkdtemp(prefix="gpu-check-mps-")
        mps = {"CUDA_MPS_PIPE_DIRECTORY": os.path.join(folder, "pipe"),
               "CUDA_MPS_LOG_DIRECTORY": os.path.join(folder, "log")}
        for path in mps.values():
            os.makedirs(path)
        started = self.command([control, "-d"], timeout=30, env=self.env(**mps))
        if started.returncode != 0:
            return "skipped", f"the MPS daemon did not start: {tail(started)}"
        try:
            return self.allreduce_benchmark(2, "-mps", MPS_BENCH, setting="under MPS",
                                            env=self.env(MPIDIST_TIMEOUT="60", NCCL_MULTI_RANK_GPU_ENABLE="1", **mps))
        finally:
            subprocess.run([control], input="quit\n", text=True, env=self.env(**mps), timeout=30,
                           capture_output=True)

    def judge_targets(self):
        measured = [t for t in self.targets if t["holds"] is not None]
        missed = [t for t in measured if not t["holds"]]
        if not measured:
            why = "dry run: the targets apply from 64 MiB on a GPU" if self.dry_run else "no benchmark rows to judge"
            return ("skipped" if self.dry_run else "failed"), why
        status = "failed" if missed and self.require_targets else "passed"
        return status, targets_met(self.targets)

    # ---- the whole run -----------------------------------------------------------------------

    def run(self) -> int:
        machine = self.step("machine", self.machine)
        if machine.status == "failed":
            return self.finish()
        self.step("wheels", self.install_wheels)
        self.step("MPI library and launcher", self.mpi)
        built = self.step("build mpidist._C", self.build)
        if built.status == "failed":
            return self.finish()
        self.step("mpidist info", self.info)
        self.step("CUDA-aware MPI carried with the tree", self.carried_mpi)
        self.step("CUDA-aware MPI probe: a device-to-device send and receive", self.probe)
        # What ran on a GPU before (the CUDA tests, the kernels, host staging) comes last, so that
        # a run cut short by --budget has done the newer checks.
        if self.launcher is None:
            self.steps.append(Step("multi-rank checks", "failed", "no launcher for the MPI library (see above)"))
        else:
            self.launches_of(window=True)
            if not self.dry_run:
                for ranks in (2, 4):
                    self.step(f"mpidist bench allreduce --device cuda, {ranks} ranks",
                              lambda: self.allreduce_benchmark(ranks))
                self.step("mpidist bench allreduce --device cuda, 2 ranks under MPS", self.allreduce_benchmark_mps)
        self.step("CUDA tests of tests/", self.cuda_tests)
        if self.launcher is not None:
            self.launches_of(window=False)
            if not self.dry_run and not self.facts.get("mpidist_info", {}).get("cuda_aware_mpi"):
                self.steps.append(Step("collectives through CUDA-aware MPI", "skipped",
                                       "mpidist info reports this MPI library is not CUDA-aware"))
        self.step(f"kernel benchmark ({self.device})", self.benchmark)
        self.step("speed targets", self.judge_targets)
        return self.finish()

    def finish(self) -> int:
        if self.dry_run:
            for name, why in DRY_RUN_SKIPS:
                self.steps.append(Step(name, "skipped", why))
        failed = self.write_report(finished=True)
        skipped = [s.name for s in self.steps if s.status == "skipped"]
        passed = [s.name for s in self.steps if s.status == "passed"]
        print(f"gpu-check: {verdict(not failed, self.targets)}: {len(passed)} steps passed, "
              f"{len(failed)} failed{' (' + '; '.join(failed) + ')' if failed else ''}, {len(skipped)} skipped"
              f"{' (' + '; '.join(skipped) + ')' if skipped else ''}; results in {self.out}", flush=True)
        return 1 if failed else 0

    def write_report(self, finished: bool) -> list:
        """results.json and summary.md as they stand; returns what failed: the failed steps, and
        any launch with a failed check, whatever step ran it."""
        failed = [s.name for s in self.steps if s.status == "failed"]
        failed += [f"{launch['ranks']} ranks, {launch['route']}" for launch in self.launches
                   if launch["problem"] or not all(check["ok"] or is_peer(check) for check in launch["checks"])]
        results = {"started": self.started, "finished": finished, "dry_run": self.dry_run, "passed": finished and not failed,
                   "facts": self.facts, "steps": [dataclasses.asdict(s) for s in self.steps],
                   "launches": self.launches, "targets": self.targets, "benchmark": self.benchmark_rows,
                   "allreduce_benchmark": self.allreduce_rows}
        with open(os.path.join(self.out, "results.json"), "w") as f:
            json.dump(results, f, indent=1)
        with open(os.path.join(self.out, "summary.md"), "w") as f:
            f.write(summary_markdown(results))
        return failed


# What a dry run leaves out, beside the steps it runs on the CPU instead.
DRY_RUN_SKIPS = [
    ("CUDA build for this GPU's architecture", "no GPU: the extension was built (or kept) as it is"),
    ("collectives on torch/CuPy GPU arrays, host staging and CUDA-aware MPI",
     "no GPU: the same checks ran on NumPy and torch CPU arrays, 2 ranks"),
    ("training modes on a CUDA module", "no GPU: the same checks ran on a CPU module"),
    ("CUDA kernel benchmark 1 MiB to 1 GiB and its targets", "no GPU: benchmarks/kernels.py ran on the CPU at 4 KiB"),
    ("mpidist bench allreduce --device cuda (device window, staged, CUDA-aware, NCCL, bound) and its targets",
     "no GPU"),
]

LIBRARIES_PROBE = """
import json
facts = {}
import numpy, torch
facts["numpy"] = numpy.__version__
facts["torch"] = torch.__version__
facts["torch_cuda"] = torch.version.cuda
facts["torch_cuda_available"] = torch.cuda.is_available()
if torch.cuda.is_available():
    facts["torch_device"] = torch.cuda.get_device_name(0)
    facts["torch_capability"] = "%d.%d" % torch.cuda.get_device_capability(0)
try:
    import cupy
    facts["cupy"] = cupy.__version__
except Exception as error:
    facts["cupy"] = "cannot import: %s" % error
try:
    from cupy.cuda import nccl
    facts["nccl_cupy"] = nccl.get_version()
except Exception as error:
    facts["nccl_cupy"] = "cannot import: %s" % error
try:
    facts["nccl_torch"] = ".".join(map(str, torch.cuda.nccl.version()))
except Exception as error:
    facts["nccl_torch"] = "unknown: %s" % error
print(json.dumps(facts))
"""

MPI_PROBE = """
import json, mpi4py
from mpi4py import MPI
print(json.dumps({"mpi4py": mpi4py.__version__, "mpi_standard": "%d.%d" % MPI.Get_version(),
                  "mpi_library": MPI.Get_library_version().replace("\\x00", "").strip().splitlines()[0]}))
"""


# ---- helpers (module level, so that tests reach them) -------------------------------------------

def tail(result, lines: int = 15) -> str:
    text = (result.stdout or "") + (result.stderr or "")
    return " | ".join(line for line in text.strip().splitlines()[-lines:] if line.strip()) or f"exit {result.returncode}"


def first_line(text: str) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip()), "")


def gpu_facts(command):
    """Name, driver, compute capability, memory and the driver's CUDA version of GPU 0, from
    nvidia-smi; None without an NVIDIA GPU."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    query = command([smi, "--query-gpu=name,driver_version,compute_cap,memory.total", "--format=csv,noheader"], 60)
    if query.returncode != 0 or not query.stdout.strip():
        return None
    name, driver, compute_cap, memory = [part.strip() for part in first_line(query.stdout).split(",")]
    banner = re.search(r"CUDA Version:\s*([\d.]+)", command([smi], 60).stdout)
    return {"name": name, "driver": driver, "compute_cap": compute_cap, "memory": memory,
            "driver_cuda": banner.group(1) if banner else "unknown"}


def read_wheel_list(path: str) -> list:
    """The lines of benchmarks/gpu-wheels.txt: requirement, name, version, the module whose
    absence calls for it ("import: X"), or whether it is an MPI library ("libmpi")."""
    wheels = []
    with open(path) as f:
        for line in f:
            requirement, _, note = line.partition("#")
            requirement = requirement.strip()
            if not requirement:
                continue
            name, _, version = requirement.partition("==")
            module = re.search(r"import:\s*(\S+)", note)
            wheels.append({"requirement": requirement, "name": normalize(name), "version": version,
                           "import": module.group(1) if module else None, "libmpi": "libmpi" in note})
    return wheels


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def wheel_files(folder: str) -> list:
    """The wheels in `folder`: name, version and whether this Python can install it."""
    from packaging.tags import sys_tags
    from packaging.utils import parse_wheel_filename
    ours = set(sys_tags())
    files = []
    for path in sorted(glob.glob(os.path.join(folder, "*.whl"))):
        name, version, _, tags = parse_wheel_filename(os.path.basename(path))
        files.append({"name": normalize(name), "version": str(version), "suits": bool(ours & set(tags))})
    return files


def mpi_family(library: str) -> str:
    """"openmpi" or "mpich" (MPICH and its derivatives: Intel MPI, MVAPICH, Cray MPICH)."""
    lower = library.lower()
    return "openmpi" if "open mpi" in lower else "mpich"


def launcher_family(version: str):
    lower = version.lower()
    if "open mpi" in lower or "openrte" in lower or "prte" in lower:
        return "openmpi"
    if any(word in lower for word in ("hydra", "mpich", "intel", "mvapich")):
        return "mpich"
    return None


def launch_prefix(launcher: str, family: str) -> list:
    """The command line before the rank count: the ranks share the node's cores and GPU."""
    if family == "openmpi":
        return [launcher, "--oversubscribe", "--bind-to", "none", "-np"]
    return [launcher, "-n"]


def pytest_mpi_options(prefix) -> list:
    """pytest-isolate-mpi's launcher settings (pyproject.toml's are Open MPI's) for this launcher."""
    if not prefix:
        return []
    return ["-o", f"mpi_executable={prefix[0]}", "-o", f"mpi_command_line_args={' '.join(prefix[1:-1])}",
            "-o", f"mpi_option_for_processes={prefix[-1]}"]


def read_junit(path: str) -> dict:
    """Counts of a pytest JUnit XML report, with the names of the tests that did not pass. A test
    reported more than once (pytest-isolate-mpi reports a multi-rank test once per rank, "[rank=N]",
    and once for the launch as a whole) failed if any entry failed, else
    skipped if any entry skipped."""
    outcomes = {}
    for case in ElementTree.parse(path).getroot().iter("testcase"):
        test = re.sub(r"\[rank=[0-9]+\]$", "", case.get("name", ""))
        name = f"{case.get('classname', '')}::{test}"
        if case.find("failure") is not None or case.find("error") is not None:
            outcome = "failed"
        elif case.find("skipped") is not None:
            outcome = "skipped"
        else:
            outcome = "passed"
        rank = ("passed", "skipped", "failed").index
        if rank(outcome) >= rank(outcomes.get(name, "passed")):
            outcomes[name] = outcome
    return {"tests": len(outcomes), "failed": [n for n, o in outcomes.items() if o == "failed"],
            "skipped": [n for n, o in outcomes.items() if o == "skipped"]}


def judge_tests(counts: dict, dry_run: bool, exit_code: int):
    """On a GPU every selected CUDA test must pass: a skip is a failure there. In a dry run they
    are all expected to skip, and nothing may fail."""
    tests, failed, skipped = counts["tests"], counts["failed"], counts["skipped"]
    if tests == 0:
        return "failed", "pytest collected no CUDA tests"
    if failed:
        return "failed", f"{len(failed)} of {tests} failed: {', '.join(failed[:10])}"
    if dry_run:
        if len(skipped) != tests:
            return "failed", f"{tests - len(skipped)} CUDA tests ran without a GPU (they should skip)"
        return "skipped", f"no GPU: the {tests} CUDA tests were collected and skipped"
    if skipped:
        return "failed", f"{len(skipped)} of {tests} CUDA tests skipped on a GPU: {', '.join(skipped[:10])}"
    if exit_code != 0:
        return "failed", f"pytest exited {exit_code} although every test passed"
    return "passed", f"{tests} CUDA tests passed"


def merge_ranks(folder: str, ranks: int, exit_code: int) -> dict:
    """One launch's checks from its ranks' files: a check passes only where every rank passed it;
    a rank that wrote nothing, or a check some rank never reached, fails."""
    reports = {}
    for path in glob.glob(os.path.join(folder, "rank*.json")):
        with open(path) as f:
            data = json.load(f)
        reports[data["rank"]] = data
    checks, order = {}, []
    for rank in sorted(reports):
        for check in reports[rank]["checks"]:
            if check["name"] not in checks:
                checks[check["name"]] = {"name": check["name"], "ok": True, "detail": "", "ranks": []}
                order.append(check["name"])
            merged = checks[check["name"]]
            merged["ranks"].append(rank)
            if not check["ok"] and merged["ok"]:
                merged["ok"], merged["detail"] = False, f"rank {rank}: {check['detail']}"
    for merged in checks.values():
        absent = [r for r in range(ranks) if r not in merged["ranks"]]
        if absent and merged["ok"]:
            merged["ok"], merged["detail"] = False, f"ranks {absent} did not report it (the launch died: see gpu-check.log)"
    problem = ""
    if len(reports) != ranks:
        problem = f"{len(reports)} of {ranks} ranks wrote results"
    elif exit_code != 0:
        problem = f"the launch exited {exit_code}"
    any_rank = reports[min(reports)] if reports else {}
    return {"checks": [checks[name] for name in order], "problem": problem, "exit_code": exit_code,
            "mpi_library": any_rank.get("mpi_library"), "cuda_aware": any_rank.get("cuda_aware")}


def passed_on_every_rank(checks: list) -> str:
    """How many of a launch's checks passed on every rank, of all; a peer's failed checks (which
    do not fail the run) named, since they are not among the passed."""
    passed = [c for c in checks if c["ok"]]
    peers = [c["name"] for c in checks if not c["ok"] and is_peer(c)]
    return f"{len(passed)} of {len(checks)} checks passed on every rank" + (
        f"; {len(peers)} checks of a peer failed (not failing the run): {', '.join(peers)}" if peers else "")


def targets_met(targets: list) -> str:
    """Every speed target with its measured values, met or missed (the missed first, so that a
    cut detail keeps them), then those not measured."""
    measured = [t for t in targets if t["holds"] is not None]
    missed = [t for t in measured if not t["holds"]]
    unmeasured = [t["target"] for t in targets if t["holds"] is None]
    listed = [f"{'MISSED' if not t['holds'] else 'met'}: {t['target']} ({t['detail']})"
              for t in missed + [t for t in measured if t["holds"]]]
    return f"{len(measured) - len(missed)} of {len(measured)} measured targets met; " + "; ".join(listed) + (
        f"; not measured: {', '.join(unmeasured)}" if unmeasured else "")


def verdict(passed: bool, targets: list) -> str:
    """The run's one-line result: "FAILED", or "passed" with the speed targets it missed counted
    (a missed target fails the run only with --require-targets)."""
    if not passed:
        return "FAILED"
    missed = sum(target["holds"] is False for target in targets)
    return f"passed, {missed} target{'s' if missed > 1 else ''} missed" if missed else "passed"


def evaluate_targets(rows: list) -> list:
    """The speed targets, judged on benchmarks/kernels.py's rows of 64 MiB and more. holds is None
    where no row was measured."""
    big = [r for r in rows if r["bytes"] >= TARGET_FROM_BYTES]
    targets = []
    for dtype in ("float32", "bfloat16"):
        for kernel in ("reduce", "reduce_scale"):
            mine = sorted((r for r in big if r["kernel"] == kernel and r["dtype"] == dtype), key=lambda r: r["bytes"])
            ratios = [(r["bytes"], r["gbs"] / r["copy_gbs"]) for r in mine]
            targets.append({
                "target": f"{kernel} {dtype} >= {COPY_FRACTION} x device-to-device copy bandwidth from 64 MiB",
                "holds": all(ratio >= COPY_FRACTION for _, ratio in ratios) if ratios else None,
                "detail": ", ".join(f"{size // MIB} MiB: {ratio:.2f}" for size, ratio in ratios) or "not measured"})
    mine = sorted((r for r in big if r["kernel"] == "reduce" and r["dtype"] == "bfloat16"), key=lambda r: r["bytes"])
    targets.append({
        "target": "reduce bfloat16 >= torch add_ from 64 MiB (median paired ratio >= 1)",
        "holds": all(r["vs_library"] >= 1.0 for r in mine) if mine else None,
        "detail": ", ".join(f"{r['bytes'] // MIB} MiB: {r['vs_library']:.2f} [{r['vs_library_low']:.2f}, "
                            f"{r['vs_library_high']:.2f}]" for r in mine) or "not measured"})
    return targets


def is_peer(check: dict) -> bool:
    """A check of a peer (NCCL), not of mpidist: recorded, never failing the run."""
    return check["name"].startswith("peer ")


def nccl_outcome(checks) -> str:
    """Whether NCCL ran in a launch, from its "peer nccl: runs" check."""
    runs = [c for c in checks if c["name"] == "peer nccl: runs"]
    if not runs:
        return "not tried"
    return "ran" if runs[0]["ok"] else f"did not run: {' '.join(runs[0]['detail'][:300].split())}"


def allreduce_targets(rows: list, setting: str = "") -> list:
    """The device window's targets on `mpidist bench allreduce --device cuda` rows of one launch,
    64 MiB and more: >= STAGED_FACTOR x the staged route, >= BOUND_FRACTION of the bound, and at
    least NCCL's bus bandwidth where NCCL ran. holds is None where a row is missing."""
    big = [r for r in rows if r["bytes"] >= TARGET_FROM_BYTES]
    time_of = {(r["algorithm"], r["dtype"], r["bytes"]): r["time_us"] for r in big}
    ranks = rows[0]["ranks"] if rows else 0
    targets = []
    for dtype in sorted({r["dtype"] for r in big}):
        sizes = sorted({r["bytes"] for r in big if r["dtype"] == dtype})
        for peer, wanted, name in (("staged:hierarchical", STAGED_FACTOR, f">= {STAGED_FACTOR}x the staged route"),
                                   ("bound", BOUND_FRACTION, f">= {BOUND_FRACTION} of the bound"),
                                   ("nccl", 1.0, ">= NCCL's bus bandwidth")):
            ratios = [(size, time_of[(peer, dtype, size)] / time_of[("hierarchical", dtype, size)]) for size in sizes
                      if (peer, dtype, size) in time_of and ("hierarchical", dtype, size) in time_of]
            targets.append({
                "target": f"all-reduce {dtype}, {ranks} ranks on one GPU{' ' + setting if setting else ''}, "
                          f"device window {name} from 64 MiB",
                "holds": all(ratio >= wanted for _, ratio in ratios) if ratios else None,
                "detail": ", ".join(f"{size // MIB} MiB: {ratio:.2f}" for size, ratio in ratios) or "not measured"})
    return targets


def summary_markdown(results: dict) -> str:
    facts = results["facts"]
    gpu = facts.get("gpu") or {}
    info = facts.get("mpidist_info", {})
    result = verdict(results["passed"], results["targets"]) if results["finished"] else "unfinished (cut short?)"
    lines = [f"# mpidist GPU check{' (dry run, no GPU)' if results['dry_run'] else ''}", "",
             f"Result: **{result}** (started {results['started']})", "",
             "| | |", "| --- | --- |",
             f"| GPU | {gpu.get('name', 'none')} (compute capability {gpu.get('compute_cap', '-')}, "
             f"{gpu.get('memory', '-')}) |",
             f"| driver | {gpu.get('driver', '-')} (CUDA {gpu.get('driver_cuda', '-')}) |",
             f"| nvcc | {facts.get('nvcc', '-')} |",
             f"| torch | {facts.get('torch', '-')} (CUDA {facts.get('torch_cuda', '-')}) |",
             f"| CuPy | {facts.get('cupy', '-')} |",
             f"| NCCL | CuPy's {facts.get('nccl_cupy', '-')}, torch's {facts.get('nccl_torch', '-')}; ran: "
             f"{facts.get('nccl_runs', '-')} |",
             f"| Python | {facts.get('python', '-')} |",
             f"| MPI library | {facts.get('mpi_library', '-')} (mpi4py {facts.get('mpi4py', '-')}"
             f"{', from ' + facts['mpi_installed_from_wheel'] if facts.get('mpi_installed_from_wheel') else ''}"
             f"{', carried in ' + facts['mpi_carried'] if facts.get('mpi_carried') else ''}) |",
             f"| launcher | {facts.get('launcher', '-')} N |",
             f"| CUDA-aware MPI | {info.get('cuda_aware_mpi', '-')} ({info.get('cuda_aware_mpi_how', '-')}) |", "",
             "## Checks", "", "| step | result | seconds | detail |", "| --- | --- | --- | --- |"]
    for step in results["steps"]:
        detail = step["detail"].replace("|", "/").replace("\n", " ")
        lines.append(f"| {step['name']} | {step['status']} | {step['seconds']} | {detail[:1500]} |")
    for launch in results["launches"]:
        failed = [c for c in launch["checks"] if not c["ok"]]
        lines += ["", f"### {launch['ranks']} ranks, {launch['route']}: {len(launch['checks']) - len(failed)} of "
                      f"{len(launch['checks'])} checks passed{'; ' + launch['problem'] if launch['problem'] else ''}"]
        lines += [f"- {'FAILED (a peer: not counted)' if is_peer(c) else 'FAILED'} {c['name']}: "
                  f"{' '.join(c['detail'][:500].split())}" for c in failed]
    if results["targets"]:
        lines += ["", "## Speed targets", "", "| target | met | measured |", "| --- | --- | --- |"]
        for target in results["targets"]:
            holds = {True: "met", False: "**missed**", None: "not measured"}[target["holds"]]
            lines.append(f"| {target['target']} | {holds} | {target['detail']} |")
    if results.get("allreduce_benchmark"):
        lines += ["", "## All-reduce of CUDA buffers by route (mpidist bench allreduce --device cuda)", "",
                  "bound: the device window's reads and writes of device memory at the measured copy bandwidth.",
                  "", "| ranks | dtype | MiB | algorithm | time us | busbw GB/s | wrong |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        for row in results["allreduce_benchmark"]:
            ranks = f"{row['ranks']} {row['setting']}" if row.get("setting") else row["ranks"]
            lines.append(f"| {ranks} | {row['dtype']} | {row['bytes'] / MIB:g} | {row['algorithm']} | "
                         f"{row['time_us']:.1f} | {row['busbw_gbs']:.2f} | {row['wrong']} |")
    if results["benchmark"]:
        lines += ["", "## Kernel benchmark", "",
                  "GB/s count every byte read and written; torch: the same result by torch's own ops; copy: "
                  "a device-to-device copy of the buffer (read + write); vs torch: median of torch's time over "
                  "ours in the same round [95% CI].", "",
                  "| kernel | dtype | MiB | GB/s | torch GB/s | copy GB/s | / copy | vs torch |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for row in results["benchmark"]:
            lines.append(f"| {row['kernel']} | {row['dtype']} | {row['bytes'] / MIB:g} | {row['gbs']:.1f} | "
                         f"{row['library_gbs']:.1f} | {row['copy_gbs']:.1f} | {row['gbs'] / row['copy_gbs']:.2f} | "
                         f"{row['vs_library']:.2f} [{row['vs_library_low']:.2f}, {row['vs_library_high']:.2f}] |")
    return "\n".join(lines) + "\n"


def default_out(dry_run: bool) -> str:
    if os.environ.get("OUT"):
        return os.environ["OUT"]
    return os.path.join(REPO, "build", "gpu-check-dry-run") if dry_run else os.path.join(REPO, "benchmarks", "results",
                                                                                         "gpu-check")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="run what needs no GPU; report the rest skipped")
    parser.add_argument("--out", help="results folder (default: $OUT, else benchmarks/results/gpu-check, "
                                      "or build/gpu-check-dry-run for a dry run)")
    parser.add_argument("--wheels", default=os.path.join(REPO, "build", "gpu-wheels"),
                        help="folder of the wheels of benchmarks/gpu-wheels.txt (`make gpu-wheels`)")
    parser.add_argument("--require-targets", action="store_true", help="a missed speed target fails the run too")
    parser.add_argument("--cuda-mpi", default=CUDA_MPI,
                        help="the CUDA-aware Open MPI to use where the machine's is not (`make cuda-mpi`)")
    parser.add_argument("--budget", type=float, help="seconds the whole run may take: no step starts after "
                                                     "them, and a command still running then is stopped")
    args = parser.parse_args(argv)
    check = GpuCheck(os.path.abspath(args.out or default_out(args.dry_run)), os.path.abspath(args.wheels),
                     args.dry_run, args.require_targets, os.path.abspath(args.cuda_mpi), args.budget)
    return check.run()


if __name__ == "__main__":
    sys.exit(main())
