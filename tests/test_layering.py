"""The package's floors: no import circle (counting imports inside functions), lower floors never
import upper ones, not even at run time (no module holds an object of a floor above it), the
runtime floor never loads MPI but through runtime/mpi.py, and the `mpidist` command (cli/) is
the top floor, which nothing outside it imports and which imports only the library's public API
(PUBLIC_MODULES and the names of their __all__)."""
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


def imported_from(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute name of the module a `from ... import` statement of `module` imports from."""
    if not node.level:
        return node.module
    base = module.split(".")
    base = base[:len(base) - node.level + (1 if is_package else 0)]
    return ".".join(base + ([node.module] if node.module else []))


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
            prefix = imported_from(module, is_package, node)
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


# The library's public API: the modules a program may import, each naming its public names in
# its __all__ (docs/architecture.md lists them). The command (cli/) is built on them alone.
PUBLIC_MODULES = ("mpidist", "mpidist.errors", "mpidist.launch", "mpidist.data", "mpidist.checkpoint",
                  "mpidist.collectives", "mpidist.runtime", "mpidist.parallel.compressors", "mpidist.kernels",
                  "mpidist.memory", "mpidist.torch")


def declared_names(path: str) -> set:
    """The names of the module's __all__, read from its source (none where it has no __all__)."""
    with open(path) as handle:
        tree = ast.parse(handle.read(), path)
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(target, "id", None) == "__all__" for target in node.targets):
            return set(ast.literal_eval(node.value))
    return set()


def private_imports(module: str, is_package: bool, source: str, public: dict) -> list:
    """"line N: ..." for each import, in the command's `module` (its `source`), of a module of mpidist
    that is not in `public` ({public module: the names of its __all__}) or of a name missing from
    its module's __all__. Imports inside functions count; the command's own modules are its own."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            wanted = [(alias.name, None) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            prefix = imported_from(module, is_package, node)
            wanted = [(prefix, alias.name) for alias in node.names]
        else:
            continue
        for target, name in wanted:
            if target != "mpidist" and not target.startswith("mpidist.") or in_the_command(target) \
                    or f"{target}.{name}" in public:  # `from package import module` of a public module
                continue
            if target not in public:
                found.append((node.lineno, f"{target} is not a public module"))
            elif name is not None and name not in public[target]:
                found.append((node.lineno, f"{name} is not in {target}.__all__"))
    return [f"line {line}: {problem}" for line, problem in sorted(found)]


def test_the_command_imports_only_the_public_api():
    # The command is the library's first user: what it needs of the inside (bench, tune and info
    # report the library's internals) is a public name of the package that owns it.
    modules = module_names()
    public = {module: declared_names(modules[module]) for module in PUBLIC_MODULES}
    found = []
    for module, path in sorted(modules.items()):
        if path and in_the_command(module):
            with open(path) as handle:
                source = handle.read()
            found += [f"{module}, {problem}" for problem in
                      private_imports(module, path.endswith("__init__.py"), source, public)]
    assert found == []


def test_the_public_api_check_finds_a_private_import():
    public = {"mpidist": {"__version__", "init"}, "mpidist.errors": {"MpidistError"},
              "mpidist.collectives": {"ALGORITHMS"}, "mpidist.kernels": {"reduce"}}
    source = ("import numpy as np\n"
              "import mpidist as md\n"
              "import mpidist._C as ext\n"
              "from .. import __version__, _launch, kernels\n"
              "from ..errors import MpidistError\n"
              "from ..runtime.wire import ITEMSIZE\n"
              "from . import bench\n"
              "def later():\n"
              "    from ..collectives import ALGORITHMS, select\n")
    assert private_imports("mpidist.cli.example", False, source, public) == [
        "line 3: mpidist._C is not a public module", "line 4: _launch is not in mpidist.__all__",
        "line 6: mpidist.runtime.wire is not a public module", "line 9: select is not in mpidist.collectives.__all__"]


# Imports every public module, notes whether that started MPI, then reads every name of each
# module's __all__ (the training modes of mpidist's __getattr__ import torch, and the parameter
# server mpi4py's MPI: they are used after md.init()); prints, for each module, the names it lists
# and lacks or that are private (None: no __all__).
PUBLIC_NAMES = """
import importlib, json, sys
modules = {name: importlib.import_module(name) for name in MODULES}
mpi_started = "mpi4py.MPI" in sys.modules
found = {}
for name, module in modules.items():
    names = getattr(module, "__all__", None)
    found[name] = None if names is None else [
        n for n in names if not hasattr(module, n) or n.startswith("_") and not n.startswith("__")]
print(json.dumps({"modules": found, "mpi_started": mpi_started}))
"""


@pytest.fixture(scope="module")
def public_names():
    result = run_python(f"MODULES = {list(PUBLIC_MODULES)!r}\n{PUBLIC_NAMES}", timeout=300)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_every_public_module_lists_its_names_in_all_and_defines_them(public_names):
    assert public_names["modules"] == {module: [] for module in PUBLIC_MODULES}


def test_importing_the_public_modules_does_not_start_mpi(public_names):
    assert public_names["mpi_started"] is False


def test_the_architecture_page_names_every_public_module():
    with open(os.path.join(REPO, "docs", "architecture.md")) as handle:
        section = handle.read().split("\n## The public API\n")[1].split("\n## ")[0]
    assert [module for module in PUBLIC_MODULES if f"`{module}`" not in section] == []


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
