"""The README's Python examples run as written, under mpirun -np 2 and as a single process, or
under the rank count an example's first line names ("# mpirun -np 3 ...")."""
import os
import re

import pytest

from conftest import REPO, run_python


def readme_examples():
    text = open(os.path.join(REPO, "README.md")).read()
    return re.findall(r"```python\n(.*?)```", text, re.S)


def test_readme_has_examples():
    assert len(readme_examples()) >= 2


def example_runs():
    """(example index, ranks) pairs: ranks 0 is a single process without mpirun."""
    runs = []
    for index, example in enumerate(readme_examples()):
        named = re.match(r"# mpirun -np (\d+) ", example)
        runs += [(index, int(named.group(1)))] if named else [(index, 0), (index, 2)]
    return runs


@pytest.mark.parametrize("index, ranks", example_runs())
def test_readme_example_runs(index, ranks):
    result = run_python(readme_examples()[index], ranks=ranks, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
