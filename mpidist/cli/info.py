"""What `mpidist info` reports: versions, the MPI library, CUDA support and the rank layout."""
from __future__ import annotations

import importlib
import platform

from .. import __version__


def _version_of(module_name: str) -> str:
    try:
        module = importlib.import_module(module_name)
    except Exception:  # not installed, or broken: report rather than fail
        return "not installed"
    return getattr(module, "__version__", "installed")


def collect(comm) -> dict:
    """Facts about this installation and this launch, gathered to every rank."""
    # imported here, once init() has started MPI: importing mpi4py's MPI or the collectives
    # initializes it
    from mpi4py import MPI

    from .. import kernels
    from ..collectives import ALGORITHMS, describe_lane
    from ..launch import detect, gpu_for_local_rank
    from ..runtime import describe_nccl, mpi_cuda_support

    names = ("numpy", "mpi4py", "torch", "h5py", "cupy", "tqdm")
    launch = detect()
    cuda = mpi_cuda_support()
    hosts = comm.mpi.allgather(MPI.Get_processor_name())
    ranks_per_node = comm.mpi.allgather(comm.local_size)
    return {
        "mpidist": __version__,
        "python": platform.python_version(),
        **{name: _version_of(name) for name in names},
        "mpi_library": MPI.Get_library_version().replace("\x00", "").strip().splitlines()[0],
        "mpi_standard": "%d.%d" % MPI.Get_version(),
        "mpi_thread_level": {MPI.THREAD_SINGLE: "single", MPI.THREAD_FUNNELED: "funneled",
                             MPI.THREAD_SERIALIZED: "serialized",
                             MPI.THREAD_MULTIPLE: "multiple"}[MPI.Query_thread()],
        # what the library answers; the probe of a device-to-device send runs at the first GPU buffer
        "cuda_aware_mpi": cuda.aware,
        "cuda_aware_mpi_how": f"{cuda.how}; to change it, {cuda.turned_off}" if cuda.turned_off else cuda.how,
        "extension_built_with_cuda": kernels.built_with_cuda(),
        "cuda_devices_visible": kernels.cuda_device_count(),
        "nccl": describe_nccl(),  # its version and path, or why none (MPIDIST_NCCL_LIBRARY)
        "gpu_lane_between_nodes": describe_lane(comm, gpu_for_local_rank(launch) or 0),
        "launcher": launch.launcher,
        "gpu_per_rank": comm.mpi.allgather(gpu_for_local_rank(launch)),
        "ranks": comm.size,
        "nodes": comm.num_nodes,
        "ranks_per_node": sorted(set(ranks_per_node)),
        "hosts": sorted(set(hosts)),
        "algorithms": list(ALGORITHMS),
    }


def format_report(facts: dict) -> str:
    width = max(len(key) for key in facts)
    lines = []
    for key, value in facts.items():
        if isinstance(value, (list, tuple)):
            value = ", ".join(str(v) for v in value)
        elif isinstance(value, bool):
            value = "yes" if value else "no"
        lines.append(f"{key.replace('_', ' '):<{width}}  {value}")
    return "\n".join(lines)
