"""The README's Python examples run as written, under mpirun -np 2 (and as a single process)."""
import os
import re

import pytest

from conftest import REPO, run_python


def readme_examples():
    text = open(os.path.join(REPO, "README.md")).read()
    return re.findall(r"```python\n(.*?)```", text, re.S)


def test_readme_has_examples():
    assert len(readme_examples()) >= 2


@pytest.mark.parametrize("ranks", [0, 2])
@pytest.mark.parametrize("index", range(len(readme_examples())))
def test_readme_example_runs(index, ranks):
    result = run_python(readme_examples()[index], ranks=ranks, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
