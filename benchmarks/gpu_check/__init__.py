"""Do mpidist's CUDA paths work on this NVIDIA GPU, and are its kernels as fast as they should be?

    make gpu-check                   # a machine with an NVIDIA GPU; no network needed
    make gpu-check GPU_DRY_RUN=1     # anywhere: the steps that need no GPU, the rest reported skipped

Both run `python benchmarks/gpu_check` (docs/gpu-check.md; `--help` lists its steps). One module per
family of steps, their order in one list, steps.STEPS:
  machine.py   the machine's facts
  build.py     the wheels this Python lacks, and mpidist._C built for this GPU
  mpi.py       the MPI library and its launcher, the carried CUDA-aware Open MPI, the probe
  launches.py  the rank tests of tests/gpu/ in mpirun launches, and the CUDA tests of tests/
  junit.py     what those pytest runs found, from their JUnit reports
  speed.py     the benchmarks and their speed targets
  report.py    results.json and summary.md
  check.py     one run: its settings, facts, environment, commands and steps
"""
