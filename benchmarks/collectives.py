"""Collective micro-benchmarks: `mpirun -np P python benchmarks/collectives.py allreduce [options]`.

The same as `mpidist bench ...`; see `mpidist bench --help` and benchmarks/README.md.
"""
import sys

from mpidist.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench"] + sys.argv[1:]))
