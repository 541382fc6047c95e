"""examples/gpu_training.py, the script of docs/gpu-training.md, run as documented on a machine
without a GPU: it falls back to the CPU, learns (far above chance), and two ranks, each taking
half of every batch, train as one process does."""
import os
import re

from conftest import REPO, run_python

SCRIPT = os.path.join(REPO, "examples", "gpu_training.py")
CHANCE = 0.1  # ten classes


def run_example(ranks):
    """[(loss, accuracy)] per epoch printed by the script under `mpirun -np ranks` (0: one process)."""
    code = f"import runpy, sys; sys.argv = [{SCRIPT!r}, '--epochs', '3']; runpy.run_path({SCRIPT!r}, run_name='__main__')"
    # One kernel thread per rank: idle OpenMP threads spin, and the ranks share the test machine's cores.
    result = run_python(code, ranks=ranks, timeout=300, env={"OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stdout + result.stderr
    epochs = re.findall(r"^epoch \d+: loss ([\d.]+), test accuracy ([\d.]+) \((\d+) ranks on (\w+)\)$",
                        result.stdout, re.M)
    assert len(epochs) == 3 and all(e[2:] == (str(max(ranks, 1)), "cpu") for e in epochs), result.stdout
    return [(float(loss), float(accuracy)) for loss, accuracy, _, _ in epochs]


def test_gpu_example_learns_on_the_cpu_and_two_ranks_train_as_one_process():
    one = run_example(0)
    assert one[-1][0] < one[0][0] and one[-1][1] > 8 * CHANCE, one
    two = run_example(2)
    for (loss_one, accuracy_one), (loss_two, accuracy_two) in zip(one, two):
        assert abs(loss_two - loss_one) <= 2e-4, (one, two)   # float32 sums in another order
        assert abs(accuracy_two - accuracy_one) <= 2 / 1024, (one, two)
