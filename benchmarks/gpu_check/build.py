"""The GPU check's wheels and build: the modules of benchmarks/gpu-wheels.txt this Python lacks,
installed from the wheels folder (`make gpu-wheels`) into build/gpu-site without touching the
Python's own packages, and mpidist._C built with CUDA for this GPU's architecture only."""
from __future__ import annotations

import glob
import json
import os
import re
import sys
import tempfile

from .check import REPO, SITE, tail

WHEEL_LIST = os.path.join(REPO, "benchmarks", "gpu-wheels.txt")


def install_wheels(check):
    wanted = read_wheel_list(WHEEL_LIST)
    missing = [w for w in wanted if w["import"] and not importable(check, w["import"])]
    if check.dry_run:
        return rehearse_install(check, wanted, missing)
    if not missing:
        return "passed", "every module of benchmarks/gpu-wheels.txt is already installed"
    check.site = pip_install(check, [w["requirement"] for w in missing], SITE)
    still = [w["import"] for w in missing if not importable(check, w["import"])]
    if still:
        return "failed", f"installed {', '.join(w['name'] for w in missing)}, but {', '.join(still)} still cannot be imported"
    return "passed", f"installed from {check.wheels} into {check.site}: {', '.join(w['requirement'] for w in missing)}"


def rehearse_install(check, wanted, missing):
    """Dry run: install the listed wheels that suit this Python into a scratch folder, so the
    install command itself runs, and say what it left out."""
    if missing:
        return "failed", f"this Python lacks {', '.join(w['name'] for w in missing)}: the later steps cannot run"
    if not os.path.isdir(check.wheels):
        return "skipped", f"no wheels folder {check.wheels} (`make gpu-wheels` makes it); this Python has every module"
    files = wheel_files(check.wheels)
    suitable = [w for w in wanted if any(f["name"] == w["name"] and f["version"] == w["version"] and f["suits"]
                                         for f in files)]
    others = [w["requirement"] for w in wanted if w not in suitable]
    if suitable:
        with tempfile.TemporaryDirectory() as scratch:
            site = pip_install(check, [w["requirement"] for w in suitable], scratch)
            if not site:
                return "failed", f"pip installed nothing importable from {check.wheels}"
    detail = f"this Python has every module; installing {len(suitable)} wheels of {check.wheels} into a scratch folder worked"
    if others:
        detail += f"; skipped (no wheel for this Python in the folder): {', '.join(others)}"
    return "passed", detail


def pip_install(check, requirements, prefix: str):
    """Install `requirements` from the wheels folder only, with no dependencies (the list names
    them all), under `prefix`. Returns its site-packages folder."""
    if not os.path.isdir(check.wheels):
        raise RuntimeError(f"the wheels folder {check.wheels} is missing: run `make gpu-wheels` where PyPI can be "
                           f"reached and bring {os.path.relpath(check.wheels, REPO)} along")
    result = check.command([sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--no-compile",
                            "--ignore-installed", "--disable-pip-version-check", "--find-links", check.wheels,
                            "--prefix", prefix, *requirements], timeout=300)
    if result.returncode != 0:
        raise RuntimeError(f"pip install from {check.wheels} failed: {tail(result)}")
    sites = sorted(glob.glob(os.path.join(prefix, "**", "*-packages"), recursive=True), key=len)
    return sites[0] if sites else None


def importable(check, module: str) -> bool:
    return check.python(f"import {module}", timeout=60).returncode == 0


def build(check):
    if check.dry_run:
        # Rebuilt CPU-only when the sources are newer than the module; an existing build
        # (with or without CUDA) is used as it is.
        env = check.env(MPIDIST_CUDA="0")
        args = [sys.executable, "setup.py", "build_ext", "--inplace"]
    else:
        arch = check.facts["gpu"]["compute_cap"].replace(".", "")
        env = check.env(MPIDIST_CUDA="1", MPIDIST_CUDA_ARCHS=arch)
        args = [sys.executable, "setup.py", "build_ext", "--inplace", "--force"]
    result = check.command(args, timeout=420, env=env)
    if result.returncode != 0:
        return "failed", f"setup.py build_ext failed: {tail(result)}"
    probe = check.python("import json, mpidist._C as c; print(json.dumps([bool(c.built_with_cuda), "
                         "c.cuda_device_count() if c.built_with_cuda else 0]))")
    if probe.returncode != 0:
        return "failed", f"the built mpidist._C does not import: {tail(probe)}"
    with_cuda, devices = json.loads(probe.stdout)
    check.facts["extension_built_with_cuda"] = with_cuda
    if check.dry_run:
        return "passed", (f"dry run: mpidist._C up to date ({'with' if with_cuda else 'without'} CUDA), "
                          "not built for a GPU's architecture")
    if not with_cuda or devices < 1:
        return "failed", f"mpidist._C built_with_cuda={with_cuda}, sees {devices} CUDA devices"
    return "passed", f"mpidist._C with CUDA for sm_{env['MPIDIST_CUDA_ARCHS']}, sees {devices} CUDA device(s)"


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
