"""Where a call of dist.all_reduce over "mpidist" spends its time: the CPU cost per call of each
layer, from MPI_Allreduce up to torch's wrapper, with torch's own floor beside it.

    python benchmarks/distributed_backend_layers.py [--calls 20000] [--repeat 7] [--json FILE]

A world of one process (no peer to wait for: what is left is each layer's own work), a tensor of
one float32, MPIDIST_CHECK=0 and MPIDIST_ALLREDUCE_ALGORITHM=mpi (so the small-message path runs,
as it does for small messages at 2 ranks). Each layer is timed in process CPU time (all threads
of the process: the engine's too), the best of `--repeat` runs of `--calls` calls, so other jobs
on the machine inflate it little. Layers, each including the ones below it:

- MPI_Allreduce through mpi4py;
- mpidist's Communicator.allreduce (the API the backend's cost is counted from);
- the process group's allreduce method, called directly with ready options;
- dist.all_reduce;
- dist.all_reduce on a Python process group that does nothing, and on torch's C++ "fake" one
  (torch.testing's): the floors of a backend written in Python or in C++.

Twice: before any async_op, and after one (the group then has its background engine), plus the
asynchronous forms waited at once. A world of one is one node, where asynchronous CPU collectives
run at once by default (MPIDIST_EAGER_ON_NODE): the default group here is made with that off, so
that its layers are the background route's, and the asynchronous call is measured again on a group
that runs it at once.
"""
from __future__ import annotations

import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MPIDIST_CHECK", "0")
os.environ.setdefault("MPIDIST_ALLREDUCE_ALGORITHM", "mpi")
os.environ["MPIDIST_EAGER_ON_NODE"] = "0"  # the default group's route: the background thread

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
import timeit  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from mpi4py import MPI  # noqa: E402

import mpidist  # noqa: E402,F401  (registers the backend)


class NothingGroup(dist.ProcessGroup):
    """A process group whose all_reduce does nothing: torch's own cost of dist.all_reduce."""

    def allreduce(self, tensors, opts=None):
        return None


def cpu_us(call, calls: int, repeat: int) -> float:
    return min(timeit.repeat(call, number=calls, repeat=repeat, timer=time.process_time)) / calls * 1e6


def layers(group, floors, tensor) -> list[tuple[str, object]]:
    opts = dist.AllreduceOptions()
    opts.asyncOp = False
    array = tensor.numpy()
    rows = [("MPI_Allreduce (mpi4py)", lambda: group.comm.mpi.Allreduce(MPI.IN_PLACE, array)),
            ("mpidist Communicator.allreduce", lambda: group.comm.allreduce(tensor)),
            ("process group allreduce (no torch wrapper)", lambda: group.allreduce([tensor], opts)),
            ("dist.all_reduce", lambda: dist.all_reduce(tensor))]
    return rows + [(f"dist.all_reduce, {name}", lambda floor=floor: dist.all_reduce(tensor, group=floor))
                   for name, floor in floors]


def asynchronous(group, at_once, tensor) -> list[tuple[str, object]]:
    return [("dist.all_reduce(async_op=True).wait()", lambda: dist.all_reduce(tensor, async_op=True).wait()),
            ("dist.all_reduce(async_op=True).get_future().wait()",
             lambda: dist.all_reduce(tensor, async_op=True).get_future().wait()),
            ("mpidist Communicator.allreduce_async().wait()", lambda: group.comm.allreduce_async(tensor).wait()),
            ("dist.all_reduce(async_op=True).wait(), run at once (one node)",
             lambda: dist.all_reduce(tensor, group=at_once, async_op=True).wait())]


def group_at_once():
    """A group that runs asynchronous CPU collectives at once (the default on one node)."""
    os.environ["MPIDIST_EAGER_ON_NODE"] = "1"
    try:
        return dist.new_group(backend="mpidist")
    finally:
        os.environ["MPIDIST_EAGER_ON_NODE"] = "0"


def fake_group():
    """torch's C++ process group that does nothing (None where this torch lacks it)."""
    try:
        from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: F401  (registers "fake")
    except ImportError:
        return None
    return dist.new_group(backend="fake")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    torch.set_num_threads(1)
    dist.init_process_group("mpidist")
    if dist.get_world_size() != 1:
        raise SystemExit("run it as one process (python, not mpirun): it measures each layer's own cost")
    group = dist.distributed_c10d._get_default_group()
    floors = [("a Python group that does nothing", NothingGroup(0, 1))]
    fake = fake_group()
    if fake is not None:
        floors.append(("torch's C++ fake group (does nothing)", fake))
    tensor = torch.zeros(1)
    rows = []
    for phase in ("before any async_op", "after an async_op"):
        if phase == "after an async_op":
            dist.all_reduce(tensor, async_op=True).wait()  # starts the group's engine
        for name, call in layers(group, floors, tensor):
            rows.append({"phase": phase, "layer": name, "cpu_us_per_call": cpu_us(call, args.calls, args.repeat)})
    for name, call in asynchronous(group, group_at_once(), tensor):
        rows.append({"phase": "after an async_op", "layer": name,
                     "cpu_us_per_call": cpu_us(call, max(1, args.calls // 10), args.repeat)})
    print("| when | layer | CPU us per call |\n|---|---|---|")
    for row in rows:
        print(f"| {row['phase']} | {row['layer']} | {row['cpu_us_per_call']:.2f} |")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(rows, handle, indent=1)
            handle.write("\n")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
