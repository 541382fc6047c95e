"""Every example of README.md and docs/*.md runs as written.

Python examples run under mpirun -np 2 and as a single process, or under the rank count their
first line names ("# mpirun -np 3 ..."); shell examples run once with bash, in a scratch
directory. An example that cannot run on one test machine (a SLURM cluster, root, the test run
itself) says so to its reader on its first line, "# not run by the tests: <reason>", and is
left out here.
"""
import glob
import os
import re
import subprocess

import pytest
from conftest import REPO, run_python

DOCUMENTS = ["README.md"] + sorted(os.path.relpath(path, REPO) for path in glob.glob(os.path.join(REPO, "docs", "*.md")))
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```", re.S | re.M)
RUNNABLE_LANGUAGES = ("python", "bash")
# Output, trees and the like: shown, never run.
SHOWN_LANGUAGES = ("text",)
NOT_RUN = "# not run by the tests:"
EXAMPLE_TIMEOUT = 540


def code_blocks(document):
    """(language, code) of every fenced block of `document`, in order."""
    with open(os.path.join(REPO, document)) as file:
        return [(language.strip(), code) for language, code in FENCE.findall(file.read())]


def examples():
    """(document, index, language, code) of every Python and shell example meant to run."""
    found = []
    for document in DOCUMENTS:
        runnable = [(language, code) for language, code in code_blocks(document)
                    if language in RUNNABLE_LANGUAGES and not code.startswith(NOT_RUN)]
        found += [(document, index, language, code) for index, (language, code) in enumerate(runnable)]
    return found


def example_runs():
    """pytest params of (example, ranks): ranks 0 is a single process without mpirun."""
    runs = []
    for example in examples():
        document, index, language, code = example
        if language == "bash":
            ranks_list = [None]
        else:
            named = re.match(r"# mpirun -np (\d+) ", code)
            ranks_list = [int(named.group(1))] if named else [0, 2]
        runs += [pytest.param(example, ranks, id=f"{document}:{language}{index}"
                              + ("" if ranks is None else f"-{ranks}ranks")) for ranks in ranks_list]
    return runs


def test_readme_and_docs_have_examples():
    documents = {document for document, _, _, _ in examples()}
    assert "README.md" in documents and len(documents) >= 8, documents
    assert len([1 for document, _, language, _ in examples() if document == "README.md" and language == "python"]) >= 1


@pytest.mark.parametrize("document", DOCUMENTS)
def test_every_code_block_is_run_or_says_why_not(document):
    """A block in another language, or without one, would escape the runs unnoticed."""
    for language, code in code_blocks(document):
        assert language in RUNNABLE_LANGUAGES + SHOWN_LANGUAGES, (
            f"{document}: a code block marked {language!r} (use python or bash, which the tests run, "
            f"or text for output):\n{code}")
        if code.startswith(NOT_RUN):
            reason = code.splitlines()[0][len(NOT_RUN):].strip()
            assert language in RUNNABLE_LANGUAGES and len(reason) >= 20, (
                f"{document}: a block that is not run must say why on its first line:\n{code}")


@pytest.mark.timeout(EXAMPLE_TIMEOUT + 60)
@pytest.mark.parametrize("example, ranks", example_runs())
def test_example_runs(example, ranks, tmp_path):
    document, index, language, code = example
    if language == "python":
        result = run_python(code, ranks=ranks, timeout=EXAMPLE_TIMEOUT)
    else:
        env = dict(os.environ)
        for hint in ("OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", "PYTEST_ISOLATE_MPI_IS_FORKED"):
            env.pop(hint, None)
        # The commands name more ranks than a small machine has cores: let Open MPI place them
        # anyway, unbound, as the tests' own launches do (--oversubscribe --bind-to none).
        env.setdefault("PRTE_MCA_rmaps_default_mapping_policy", ":oversubscribe")
        env.setdefault("PRTE_MCA_hwloc_default_binding_policy", "none")
        # A scratch directory, so that files the commands write (checkpoints, JSON) go nowhere else.
        result = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", code], capture_output=True, text=True,
                                timeout=EXAMPLE_TIMEOUT, env=env, cwd=tmp_path)
    assert result.returncode == 0, f"{document}, {language} example {index}:\n{code}\n{result.stdout}{result.stderr}"
