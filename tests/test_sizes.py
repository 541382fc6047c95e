"""The size limits of the package and its benchmarks: no module of mpidist/, benchmarks/ or
tests/gpu/ over 500 lines, no function over 60 (a nested function counts in the function around
it too). The modules and functions that exceed them still are listed; the list may only shrink: a
listed one that complies fails the check until it is taken off."""
import ast
import os

from conftest import REPO

# The package, its benchmarks, and the GPU check's rank tests that came from them.
COVERED = ("mpidist", "benchmarks", "tests/gpu")
MODULE_LINES, FUNCTION_LINES = 500, 60
# Still over the limits (paths relative to the repository; functions as path:name).
EXCEEDING = set()


def modules(tops=COVERED):
    """The paths, relative to the repository, of the Python modules under the folders `tops`."""
    for top in tops:
        for directory, subdirectories, files in os.walk(os.path.join(REPO, top)):
            subdirectories.sort()
            for name in sorted(files):
                if name.endswith(".py"):
                    yield os.path.relpath(os.path.join(directory, name), REPO)


def oversized(tops=COVERED) -> dict:
    """{module or module:function: its lines} of everything under the folders `tops` (relative to
    the repository) over the limits."""
    found = {}
    for module in modules(tops):
        path = os.path.join(REPO, module)
        with open(path) as handle:
            source = handle.read()
        if len(source.splitlines()) > MODULE_LINES:
            found[module] = len(source.splitlines())
        for node in ast.walk(ast.parse(source, path)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > FUNCTION_LINES:
                    found[f"{module}:{node.name}"] = lines
    return found


def test_no_module_or_function_over_the_limits_but_those_listed():
    found = oversized()
    assert {name: lines for name, lines in found.items() if name not in EXCEEDING} == {}


def test_every_listed_module_or_function_still_exceeds_them():
    assert sorted(EXCEEDING - set(oversized())) == []
