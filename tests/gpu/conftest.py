"""The GPU check's rank tests: what every rank of one mpirun launch runs, pytest inside each rank.

    mpirun -np 4 python -m pytest tests/gpu --device cuda --expect-ranks 4 --junitxml=DIR/rank{rank}.xml

`make gpu-check` (benchmarks/gpu_check/, docs/gpu-check.md) launches them once per rank count and
route, on `--device cuda`; its dry run, on the CPU, runs them on `--device cpu`. It merges the
ranks' JUnit reports ("{rank}" in --junitxml becomes each rank's number): a test passes only where
every rank passed it.

They are not part of the suite `make test` runs (pyproject.toml's norecursedirs leaves tests/gpu
out): every test's collectives meet the other ranks' in the same test, so all the ranks run all
the tests, one after another, in one launch of their own, which pytest-isolate-mpi's launches of
the suite do not give. `pytest tests/gpu` runs them by hand, under mpirun (on one rank the
parameter server's test fails: it needs a server and a worker).

The options are the launch's:
  --device cuda|cpu          where the arrays and modules live: torch and CuPy on the rank's GPU,
                             or NumPy and torch on the CPU
  --expect-ranks N           the launch's size (a launcher of another MPI starts singletons)
  --expect-cuda-aware yes|no what mpidist must find the MPI library to be
  --device-window yes|no     whether GPU buffers must go through the node window in GPU memory
  --nccl                     also run algorithm="nccl", a peer (test_device_peer_nccl.py)
  --skip-training            only the collectives, not the training modes nor Horovod's behaviours
A test that a launch does not ask for (marked gpu_only, device_window, peer or training, or
`expectation` of an option not given) is deselected, never skipped: in these launches a skipped
test counts as a failure.

The modules run in MODULES' order, whatever their names; a failed test of a peer does not make
pytest's exit status non-zero (the GPU check reports it without counting it as mpidist's).
"""
import argparse

import pytest
from device_arrays import COUNTS, DTYPES, KINDS, Arrays, Inputs, StagingCounter

import mpidist as md
from mpidist import launch

# Collectives first, each route's checks before anything else touches the communicator; the
# asynchronous engine (which takes over the communicator's collectives) after the blocking ones;
# the peer last, so that a peer failing or hanging in its own setup cannot cost mpidist's checks.
MODULES = ("test_device_launch.py", "test_device_collectives.py", "test_device_backend.py",
           "test_device_horovod.py", "test_device_training.py", "test_device_peer_nccl.py")
MARKERS = {
    "gpu_only": "needs --device cuda",
    "device_window": "needs --device-window yes (and --device cuda)",
    "peer": "a peer's check (NCCL), needs --nccl; its failure does not fail the launch",
    "training": "a training mode or a Horovod behaviour, left out with --skip-training",
    "expectation(option)": "checks what `option` expects, and needs it given",
}
OURS_FAILED = []  # mpidist's tests (not a peer's) that failed in this session


def pytest_addoption(parser):
    group = parser.getgroup("mpidist GPU check", "the launch's settings (tests/gpu/conftest.py)")
    group.addoption("--device", choices=("cuda", "cpu"), default="cpu", help="where the arrays live")
    group.addoption("--expect-ranks", type=int, help="the launch's size")
    group.addoption("--expect-cuda-aware", choices=("yes", "no"), help="the route GPU buffers must take")
    group.addoption("--device-window", choices=("yes", "no"), default="no",
                    help="whether GPU buffers must go through the node window in GPU memory")
    group.addoption("--nccl", action="store_true", help='also run algorithm="nccl" as a peer')
    group.addoption("--skip-training", action="store_true", help="only the collectives")


@pytest.hookimpl(tryfirst=True)  # before the JUnit plugin opens its report
def pytest_configure(config):
    for name, meaning in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {meaning}")
    if config.option.xmlpath and "{rank}" in config.option.xmlpath:
        config.option.xmlpath = config.option.xmlpath.replace("{rank}", str(launch.detect().rank))


def settings_of(config) -> argparse.Namespace:
    option = config.getoption
    return argparse.Namespace(device=option("--device"), expect_ranks=option("--expect-ranks"),
                              expect_cuda_aware=option("--expect-cuda-aware"),
                              device_window=option("--device-window") == "yes" and option("--device") == "cuda",
                              nccl=option("--nccl"), skip_training=option("--skip-training"))


def asked_for(item, settings) -> bool:
    """Whether the launch asks for this test (see the module docstring)."""
    marked = item.get_closest_marker
    expectation = marked("expectation")
    return not ((marked("gpu_only") and settings.device != "cuda")
                or (marked("device_window") and not settings.device_window)
                or (marked("peer") and not settings.nccl)
                or (marked("training") and settings.skip_training)
                or (expectation and getattr(settings, expectation.args[0]) is None))


def pytest_collection_modifyitems(config, items):
    settings = settings_of(config)
    unknown = sorted({item.path.name for item in items} - set(MODULES))
    if unknown:
        raise pytest.UsageError(f"{', '.join(unknown)}: not in tests/gpu/conftest.py's MODULES (the order they run in)")
    deselected = [item for item in items if not asked_for(item, settings)]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
    items[:] = sorted((item for item in items if asked_for(item, settings)),
                      key=lambda item: MODULES.index(item.path.name))


def pytest_generate_tests(metafunc):
    """`kind` (and `dtype`) run over the device's kinds of array (and their dtypes), `count` over
    its sizes."""
    device = metafunc.config.getoption("--device")
    names = metafunc.fixturenames
    if "kind" in names and "dtype" in names:
        pairs = [(kind, dtype) for kind in KINDS[device] for dtype in DTYPES[kind]]
        metafunc.parametrize("kind,dtype", pairs, ids=[f"{kind}-{dtype}" for kind, dtype in pairs])
    elif "kind" in names:
        metafunc.parametrize("kind", KINDS[device])
    if "count" in names:
        metafunc.parametrize("count", COUNTS[device], ids=[f"n={count}" for count in COUNTS[device]])


def pytest_runtest_logreport(report):
    if report.failed and "peer" not in report.keywords:
        OURS_FAILED.append(report.nodeid)


def pytest_sessionfinish(session, exitstatus):
    if exitstatus == pytest.ExitCode.TESTS_FAILED and not OURS_FAILED:
        session.exitstatus = pytest.ExitCode.OK  # only a peer failed: reported, not mpidist's


@pytest.fixture(scope="session")
def settings(request) -> argparse.Namespace:
    return settings_of(request.config)


@pytest.fixture(scope="session")
def world():
    return md.init()


@pytest.fixture(scope="session", autouse=True)
def launch_properties(world, settings, record_testsuite_property):
    """What the GPU check records of each launch, in every rank's report."""
    from mpi4py import MPI
    record_testsuite_property("rank", world.rank)
    record_testsuite_property("size", world.size)
    record_testsuite_property("device", settings.device)
    record_testsuite_property("cuda_aware", world.is_cuda_aware())
    record_testsuite_property("mpi_library", MPI.Get_library_version().replace("\x00", "").strip().splitlines()[0])


@pytest.fixture(scope="session")
def comm(world, settings):
    """The world communicator, where the launch has the ranks it asked for: singletons of a
    launcher of another MPI library fail every test at once (test_device_launch.py says why)."""
    if settings.expect_ranks is not None and world.size != settings.expect_ranks:
        pytest.fail(f"this rank sees {world.size} ranks, the launch asked for {settings.expect_ranks}")
    return world


@pytest.fixture(scope="session")
def device(comm, settings) -> str:
    """"cpu", or this rank's GPU ("cuda:N"), made the current one."""
    if settings.device == "cpu":
        return "cpu"
    import torch
    if not torch.cuda.is_available():
        pytest.fail("torch sees no GPU (torch.cuda.is_available() is False)")
    gpu = f"cuda:{comm.local_rank % torch.cuda.device_count()}"
    torch.cuda.set_device(gpu)
    return gpu


@pytest.fixture
def arrays(kind, device) -> Arrays:
    return Arrays(kind, device)


@pytest.fixture(scope="session")
def inputs(comm) -> Inputs:
    return Inputs(comm.size)


@pytest.fixture(scope="session")
def staging(comm) -> StagingCounter:
    return StagingCounter(comm)

