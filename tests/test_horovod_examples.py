"""The Horovod example scripts (examples/horovod/) run to completion under a real mpirun, with
small settings, and their output shows they trained: the training examples, run as documented,
learn on one process (accuracy far above chance) and on several ranks about as well as on one;
the benchmark reports every iteration; after hvd.join() every rank holds the same parameters."""
import os
import re

import pytest
from conftest import REPO, run_python

EXAMPLES = os.path.join(REPO, "examples", "horovod")
ONE_PROCESS_FLOOR = 0.6  # a training example's accuracy on one process, as documented (chance: 0.1)
RANKS_SHORTFALL = 0.15  # how far below the one-process accuracy a multi-rank run may end


def run_example(script, ranks, *options, timeout=300):
    """Run examples/horovod/`script` as its __main__ under `mpirun -np ranks`, or as a plain
    process where ranks is 0; returns its stdout."""
    path = os.path.join(EXAMPLES, script)
    code = (f"import runpy, sys; sys.argv = {[path, *options]!r}; "
            f"runpy.run_path({path!r}, run_name='__main__')")
    result = run_python(code, ranks=ranks, timeout=timeout)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """Where the examples write the digits file (the first run makes it, the others read it)."""
    return str(tmp_path_factory.mktemp("digits"))


def mnist_tests(ranks, data_dir):
    """(test loss, accuracy) after each epoch of pytorch_mnist.py run as docs/horovod.md has it."""
    output = run_example("pytorch_mnist.py", ranks, "--epochs", "3", "--data-dir", data_dir)
    tests = [(float(loss), float(accuracy) / 100) for loss, accuracy in
             re.findall(r"Test set: Average loss: ([\d.]+), Accuracy: ([\d.]+)%", output)]
    assert len(tests) == 3, output  # one evaluation per epoch, printed by rank 0 only
    return tests, output


@pytest.fixture(scope="module")
def mnist_one_process(data_dir):
    return mnist_tests(0, data_dir)[0]


def test_mnist_example_learns_on_one_process(mnist_one_process):
    assert mnist_one_process[-1][0] < mnist_one_process[0][0], mnist_one_process
    assert mnist_one_process[-1][1] > ONE_PROCESS_FLOOR, mnist_one_process


def test_mnist_example_learns_on_two_ranks_as_on_one(data_dir, mnist_one_process):
    tests, output = mnist_tests(2, data_dir)
    assert tests[-1][0] < tests[0][0], tests
    assert tests[-1][1] > mnist_one_process[-1][1] - RANKS_SHORTFALL, (tests, mnist_one_process)
    # Both ranks train (each logs its own batches) on half of the 1500 training digits each.
    assert len(re.findall(r"Train Epoch: 1 \[0/750 ", output)) == 2, output


def test_synthetic_benchmark_example_reports_every_iteration():
    output = run_example("pytorch_synthetic_benchmark.py", 2, "--model", "convnet", "--no-cuda", "--fp16-allreduce",
                         "--batch-size", "4", "--image-size", "32", "--num-classes", "10",
                         "--num-warmup-batches", "2", "--num-batches-per-iter", "2", "--num-iters", "3")
    assert "Number of CPUs: 2" in output, output
    rates = [float(rate) for rate in re.findall(r"Iter #\d+: ([\d.]+) img/sec per CPU", output)]
    assert len(rates) == 3 and all(rate > 0 for rate in rates), output
    mean = float(re.search(r"Img/sec per CPU: ([\d.]+) \+-", output).group(1))
    total = float(re.search(r"Total img/sec on 2 CPU\(s\): ([\d.]+) \+-", output).group(1))
    assert mean == pytest.approx(sum(rates) / 3, abs=0.1) and total == pytest.approx(2 * mean, abs=0.2), output


def test_synthetic_benchmark_example_with_mpidist_data_parallel():
    """--data-parallel trains the deeper convnet (--blocks 5) with md.DataParallel instead."""
    output = run_example("pytorch_synthetic_benchmark.py", 2, "--model", "convnet", "--no-cuda", "--data-parallel",
                         "--blocks", "5", "--batch-size", "4", "--image-size", "32", "--num-classes", "10",
                         "--num-warmup-batches", "1", "--num-batches-per-iter", "2", "--num-iters", "2")
    rates = [float(rate) for rate in re.findall(r"Iter #\d+: ([\d.]+) img/sec per CPU", output)]
    assert len(rates) == 2 and all(rate > 0 for rate in rates), output


def join_accuracy(output):
    return float(re.findall(r"Epoch 2: .* accuracy ([\d.]+)%", output)[0]) / 100


@pytest.fixture(scope="module")
def join_one_process(data_dir):
    output = run_example("pytorch_join.py", 0, "--epochs", "2", "--log-interval", "100", "--data-dir", data_dir)
    return join_accuracy(output)


def test_join_example_learns_on_one_process(join_one_process):
    assert join_one_process > ONE_PROCESS_FLOOR


@pytest.mark.parametrize("ranks", [2, 3])
def test_join_example_ends_with_the_same_parameters_on_every_rank(data_dir, join_one_process, ranks):
    output = run_example("pytorch_join.py", ranks, "--epochs", "2", "--log-interval", "100", "--data-dir", data_dir)
    finals = re.findall(r"Rank (\d+): (\d+) batches, last to join: rank (\d+), parameters checksum (\S+)", output)
    assert sorted(int(rank) for rank, _, _, _ in finals) == list(range(ranks)), output
    by_rank = {int(rank): (int(batches), int(last), checksum) for rank, batches, last, checksum in finals}
    batches = [by_rank[rank][0] for rank in range(ranks)]
    assert batches == sorted(set(batches)), batches  # uneven: each rank fewer batches than the next
    assert {last for _, last, _ in by_rank.values()} == {ranks - 1}  # the rank with the most data joins last
    assert len({checksum for _, _, checksum in by_rank.values()}) == 1, finals
    assert join_accuracy(output) > join_one_process - RANKS_SHORTFALL, (output, join_one_process)
