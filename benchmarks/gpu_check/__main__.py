"""`python benchmarks/gpu_check [options]`: the GPU check (steps.main)."""
import os
import sys

# Run as a folder, Python puts the package's own folder first on the path; its parent instead,
# so that the package imports as one.
sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from gpu_check.steps import main  # noqa: E402

sys.exit(main())
