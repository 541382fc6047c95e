"""The package's floors: no import circle (counting imports inside functions), lower floors never
import upper ones, not even at run time (no module holds an object of a floor above it), the
runtime floor never loads MPI but through runtime/mpi.py, and the `mpidist` command (cli/) is
the top floor, which nothing outside it imports."""
import ast
import json
import os

import pytest
from conftest import REPO, run_python

PACKAGE = os.path.join(REPO, "mpidist")
# Floors, lowest first: a module imports only from its own floor or below. The package root
# (mpidist/__init__.py, the public face) may import from any floor of the library: it stands on
# the library's tools floor, below the command (and never imports it: see below).
FLOORS = (
    ("errors",),
    ("runtime",),
    ("_C", "buffers", "kernels", "memory", "launch"),
    ("channel",),
    ("collectives",),
    ("comm",),
    ("parallel",),
    ("torch", "distributed"),
    ("data", "checkpoint"),  # the library's tools; a module named on no floor is one of them
    ("cli",),  # the `mpidist` command, on the library
)
TOOLS = len(FLOORS) - 2
TOP = len(FLOORS) - 1


def module_names():
    """{dotted name: path} of every module of the package (the extension mpidist._C: no path)."""
    modules = {"mpidist._C": None}
    for directory, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(directory, name)
                parts = os.path.relpath(path, REPO)[:-3].split(os.sep)
                if parts[-1] == "__init__":
                    parts = parts[:-1]
                modules[".".join(parts)] = path
    return modules


def imports_of(module: str, path: str, modules: dict) -> dict:
    """{imported module of the package: line} for every import statement of the module, at
    module level and inside functions alike."""
    is_package = path.endswith("__init__.py")
    with open(path) as handle:
        tree = ast.parse(handle.read(), path)
    found = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base[:len(base) - node.level + (1 if is_package else 0)]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module
            submodules = [f"{prefix}.{alias.name}" for alias in node.names if f"{prefix}.{alias.name}" in modules]
            # `from package import module` imports the module; `from module import name`, the module.
            targets = submodules or [prefix]
        else:
            continue
        for target in targets:
            if target in modules and target != module:
                found.setdefault(target, node.lineno)
                # Importing a module of another package runs that package's __init__ first.
                parent = target.rpartition(".")[0]
                if parent not in ("", "mpidist") and not module.startswith(parent + ".") and parent != module:
                    found.setdefault(parent, node.lineno)
    return found


def graph():
    modules = module_names()
    return modules, {name: imports_of(name, path, modules) for name, path in modules.items() if path}


def floor_of(module: str) -> int:
    if module == "mpidist":  # the package root: the public face, above every floor of the library
        return TOOLS
    part = module.split(".")[1]
    for level, names in enumerate(FLOORS):
        if part in names:
            return level
    return TOOLS


def in_the_command(module: str) -> bool:
    return module == "mpidist.cli" or module.startswith("mpidist.cli.")


def imports_of_the_command(edges: dict) -> list:
    """"module -> target (line N)" for each import of the command (mpidist.cli or a module of it)
    by a module outside it, the package root included."""
    return [f"{module} -> {target} (line {line})" for module, targets in sorted(edges.items())
            if not in_the_command(module) for target, line in targets.items() if in_the_command(target)]


def find_cycle(edges: dict):
    """One import circle as a list of modules, or None (depth-first search)."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for target in edges.get(node, ()):
            if state.get(target) == "open":
                return stack[stack.index(target):] + [target]
            if target not in state:
                cycle = visit(target)
                if cycle:
                    return cycle
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(edges):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_there_is_no_import_circle():
    _, edges = graph()
    assert find_cycle(edges) is None


def test_lower_floors_never_import_upper_ones():
    _, edges = graph()
    upward = [f"{module} -> {target} (line {line})" for module, targets in sorted(edges.items()) if module != "mpidist"
              for target, line in targets.items() if target != "mpidist" and floor_of(target) > floor_of(module)]
    assert upward == []


def test_nothing_outside_the_command_imports_it():
    # The library is usable without its command: the package root, the library's modules and
    # anything they import leave cli/ alone, so the command's modules may change freely.
    _, edges = graph()
    assert any(in_the_command(module) for module in edges), "no module of mpidist/cli/ was found"
    assert imports_of_the_command(edges) == []


def test_the_command_check_finds_an_import_of_it():
    edges = {"mpidist": {"mpidist.comm": 3}, "mpidist.data": {"mpidist.cli": 7},
             "mpidist.parallel.zero": {"mpidist.cli.bench": 9}, "mpidist.cli.train": {"mpidist.cli.training": 2},
             "mpidist.client": {"mpidist.comm": 1}}
    assert imports_of_the_command(edges) == ["mpidist.data -> mpidist.cli (line 7)",
                                             "mpidist.parallel.zero -> mpidist.cli.bench (line 9)"]


def test_import_mpidist_loads_no_module_of_the_command():
    # What the import graph cannot see (an import by a computed name): a job that imports the
    # library's faces and runs a collective has not loaded the command.
    code = ("import json, sys, numpy as np, mpidist as md, mpidist.torch, mpidist.distributed, mpidist.data, "
            "mpidist.checkpoint\nmd.init(); md.allreduce(np.ones(4))\n"
            "print(json.dumps(sorted(name for name in sys.modules if name.startswith('mpidist.'))))")
    result = run_python(code)
    assert result.returncode == 0, result.stderr
    loaded = json.loads(result.stdout.strip().splitlines()[-1])
    assert "mpidist.comm" in loaded and "mpidist.torch" in loaded, loaded
    assert [name for name in loaded if in_the_command(name)] == []


def test_only_runtime_mpi_loads_mpi_up_to_the_communicator():
    # Up to comm.py, importing a module must not start MPI: only runtime/mpi.py imports mpi4py's
    # MPI module (the collectives read its names through runtime/mpi.py's MPI, which imports it at
    # the first use; buffers.py uses mpi4py's buffer helpers only once MPI runs, inside functions).
    modules, _ = graph()
    offenders = []
    for module, path in modules.items():
        if path is None or module == "mpidist" or floor_of(module) > floor_of("mpidist.comm"):
            continue
        with open(path) as handle:
            tree = ast.parse(handle.read(), path)
        for node in tree.body:  # module level only: what runs at import
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("mpi4py") \
                    or isinstance(node, ast.Import) and any(a.name.startswith("mpi4py") for a in node.names):
                offenders.append(f"{module}:{node.lineno}")
    assert offenders == []


def test_importing_the_collectives_and_the_communicator_does_not_start_mpi():
    # Module-level code that reads one of MPI's names (a table of MPI datatypes, say) would start
    # MPI at import although no module imports mpi4py there.
    result = run_python("import sys, mpidist.collectives, mpidist.comm\n"
                        "print('mpi4py.MPI' in sys.modules, 'mpidist.collectives' in sys.modules)")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "True"], result.stdout + result.stderr


# Run in a job of 2 ranks: every collective once (the general path and the fast path, the
# asynchronous engine, the node window), the Horovod and DataParallel faces loaded; then rank 0
# lists, for every module of the package, each object it holds (its globals, the attributes of
# its classes, the items of the containers among them) that was defined in another module of
# the package.
HELD_OBJECTS = """
import json, sys, types
import numpy as np
import mpidist as md
import mpidist.parallel.data_parallel, mpidist.torch
md.init()
big, small = np.ones(1 << 17, dtype=np.float32), np.ones(4, dtype=np.float32)
md.allreduce(big); md.allreduce(small); md.allreduce(big, algorithm="hierarchical")
md.allreduce_async(big).wait(); md.world().broadcast_async(big).wait()
md.broadcast(big); md.allgather(big); md.reduce_scatter(big); md.barrier(); md.world().alltoall(big)

def owner(value):
    if isinstance(value, types.ModuleType):
        return value.__name__
    module = getattr(value, "__module__", None)
    return module if isinstance(module, str) else type(value).__module__

def held(value):
    yield value
    if isinstance(value, dict):
        yield from value.values()
    elif isinstance(value, (list, tuple, set, frozenset)):
        yield from value

found = []
for name, module in sorted(sys.modules.items()):
    if not name.startswith("mpidist.") or module is None:
        continue
    values = list(vars(module).items())
    for attribute, value in list(values):
        if isinstance(value, type) and value.__module__ == name:
            values += [(f"{attribute}.{key}", item) for key, item in vars(value).items()]
    for attribute, value in values:
        for item in held(value):
            target = owner(item)
            if target and (target == "mpidist" or target.startswith("mpidist.")) and target != name:
                found.append([name, attribute, target])
if md.rank() == 0:
    print(json.dumps(found))
"""


def test_no_module_holds_an_object_of_a_floor_above_it():
    # An import graph says nothing of what a module is handed at run time: a lower floor that
    # is given a loader, a hook or a module of an upper floor calls upward all the same.
    result = run_python(HELD_OBJECTS, ranks=2, timeout=300)
    assert result.returncode == 0, result.stderr
    held = json.loads(result.stdout.strip().splitlines()[-1])
    assert held, "the job found no object held across modules: the check would miss every one"
    upward = sorted(f"{module}.{attribute} -> {target}" for module, attribute, target in held
                    if floor_of(target) > floor_of(module))
    assert upward == []


def test_the_checker_finds_a_circle():
    assert find_cycle({"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b": 1}, "b": {}}) is None


@pytest.mark.parametrize("module, expected", [("mpidist.runtime.wire", 1), ("mpidist.channel", 3),
                                              ("mpidist.collectives.api", 4), ("mpidist.comm", 5),
                                              ("mpidist.parallel.ps", 6), ("mpidist.distributed", 7),
                                              ("mpidist.data", 8), ("mpidist", 8), ("mpidist.cli", 9),
                                              ("mpidist.cli.train", 9)])
def test_floors_are_read_from_the_module_path(module, expected):
    assert floor_of(module) == expected
