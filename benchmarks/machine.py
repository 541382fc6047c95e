"""The measuring machine as the benchmarks' result files describe it."""
from __future__ import annotations

import platform


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo; where that file or the line is missing, what
    the platform module knows (the processor, else the machine type)."""
    try:
        with open("/proc/cpuinfo") as handle:
            return next(line.split(":", 1)[1].strip() for line in handle if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine() or "unknown"
