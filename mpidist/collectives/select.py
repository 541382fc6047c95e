"""How algorithm="auto" picks an all-reduce algorithm.

The built-in tables of one node come from the fast path's times and `mpidist bench
allreduce` on one host with 2 to 5 ranks (benchmarks/results/node-protocol-cpu-fastpath.md):
- The smallest messages go to the MPI library's own MPI_Allreduce: one flag round through shared
  memory costs about what MPI's own exchange does there, and MPI's has less Python in front.
- From there (1 KiB, 4 KiB with 2 ranks) the hierarchical algorithm reduces through node-shared
  memory, no MPI messages inside a node: one call into the extension, one-shot for small
  messages, and across nodes recursive halving between node leaders.
- MPI cannot reduce float16/bfloat16. On one node they go to the node protocol at every size,
  which reduces them as they are. Across nodes, below 8 KiB, they take the MPI route (upcast to
  float32 with our cast kernel, MPI_Allreduce, round back once): one MPI call beats several
  Python-driven steps; larger ones go to our algorithms, which move half the bytes.
MPIDIST_ALLREDUCE_ALGORITHM forces one algorithm, like Open MPI's coll_tuned forced algorithms; a
Communicator reads it when it is created.

`mpidist tune` measures the algorithms (the MPI library's included) on the machine at hand and
writes a decision table per rank count (JSON: {"<ranks>": [{"max_bytes": b, "algorithm": a},
..., {"max_bytes": null, ...}]}) to MPIDIST_TUNING_FILE, default ~/.cache/mpidist/tuning.json.
Each Communicator's rank 0 reads the file once and broadcasts the entry, so every rank
chooses alike even when the ranks' home directories differ. Without an entry for the rank count
the built-in table applies: on one node the rank count's; across nodes, with one rank per
node, MPI's own up to 2 MiB and from there recursive doubling between 2 nodes, the ring on more,
and with several ranks per node
MPI's own up to 256 KiB and the hierarchical algorithm from there (layout_table).

`mpidist tune` also keeps its measured times in the file (under "model", with the layout they
were taken on) and fits the cost model's parameters to all of them (cost_model.py). A
communicator then uses the measured table for the sizes it covers, when it was measured at this
rank count and ranks per node, and the model everywhere else: at sizes outside the measured
range, at rank counts never measured, and on another layout (a table from one node says nothing
about the same rank count across nodes). A measurement beats a prediction where there is one:
the model's few parameters average over every configuration and miss effects it has no term for.
The model's decisions are turned into a table when the communicator is made, because evaluating
it on every call would cost more than the smallest all-reduces take.
"""
from __future__ import annotations

import json
import os
import warnings

import numpy as np

from ..runtime import config
from ..runtime.mpi import fault_tolerant
from ..runtime.wire import HALF_DTYPES
from . import cost_model
from .common import SEGMENT_BYTES
from .node_window import ONE_SHOT_BYTES
from .registry import ALLREDUCE

# (upper bound in bytes, algorithm); the first row whose bound exceeds the message size wins.
BUILTIN_TABLE = (
    (1024, "mpi"),
    (float("inf"), "hierarchical"),
)
HALF_TABLE = (
    (8 * 1024, "mpi"),
    (float("inf"), "hierarchical"),
)
TWO_RANK_TABLE = (
    (4 * 1024, "mpi"),
    (float("inf"), "hierarchical"),
)
# One rank per node, across nodes: nothing to share in a node, so the hierarchical algorithm is
# only the all-reduce between the nodes. MPI's own was ahead of recursive doubling (our fastest
# there) for small messages, and as fast as any of ours up to about 1 MiB. Between 2 nodes, from
# a few MiB, recursive doubling (one whole message each way) sends what MPI's own does in fewer
# messages and pulls ahead, more so on a slow link. On more nodes recursive doubling sends
# log2(N)·n bytes per node against 2(N-1)/N·n, and from a few MiB our ring takes over: MPI's own
# and recursive halving (ours, or inside the hierarchical algorithm) send as many bytes, but
# took about twice the link's time on a slow link, where the ring, which sends to one neighbour
# while it receives from the other, ran close to the link's rate (recursive halving's exchanges
# go to and from the same peer at once). Below 2 MiB MPI's own stays: on a fast link it was
# ahead of the ring at 1 MiB. The measurements behind these bounds:
# benchmarks/results/multinode-cpu.md, multinode-cpu-500mbit.md,
# multinode-cpu-one-per-node-small.md and multinode-cpu-4x1-500mbit.md.
TWO_NODES_ONE_PER_NODE_TABLE = (
    (2 * 1024 * 1024, "mpi"),
    (float("inf"), "recursive_doubling"),
)
MANY_NODES_ONE_PER_NODE_TABLE = (
    (2 * 1024 * 1024, "mpi"),
    (float("inf"), "ring"),
)
# Several ranks per node, across nodes: the hierarchical algorithm's node barriers and copies
# cost more than they save until messages are a few hundred KiB: on 2 x 2 MPI's own was ahead
# for small messages, level around the bound below, and behind from 1 MiB
# (benchmarks/results/multinode-cpu.md).
SEVERAL_PER_NODE_TABLE = (
    (256 * 1024, "mpi"),
    (float("inf"), "hierarchical"),
)


def forced_algorithm() -> str | None:
    """MPIDIST_ALLREDUCE_ALGORITHM, read by each Communicator when it is created (as MPI libraries
    read their tuning parameters at initialization): looking it up on every call would cost more
    than a small MPI_Allreduce."""
    return config.value("MPIDIST_ALLREDUCE_ALGORITHM")


def auto_choice(mpi, nodes: int) -> tuple:
    """(tuning table or None, forced algorithm or None, fast_path_bounds, one-shot bound) of a new
    communicator over `nodes` nodes: what algorithm="auto" decides with, and the largest
    all-reduce the node window's one-shot takes (collective over `mpi`: rank 0 reads the file)."""
    tuned, one_shot_bytes = load_tuning_table(mpi, nodes)
    table = tuned or layout_table(mpi.Get_size(), nodes)
    forced = forced_algorithm()
    if fault_tolerant():  # no shared-memory windows (runtime/mpi.py): point-to-point rings instead
        table = tuple((bound, "ring" if algorithm == "hierarchical" else algorithm)
                      for bound, algorithm in table_for(mpi.Get_size(), table))
    return table, forced, fast_path_bounds(mpi.Get_size(), nodes, table, forced), one_shot_bytes


def choose_allreduce(nbytes: int, ranks: int, table=None, dtype: str = "float32", forced: str | None = None,
                     nodes: int = 1) -> str:
    if forced:
        return forced
    if ranks == 1:
        return "ring"  # nothing to exchange; any algorithm returns at once
    chosen = _lookup(table_for(ranks, table), nbytes)
    if chosen == "mpi" and dtype in HALF_DTYPES:
        # MPI cannot reduce float16/bfloat16: its route upcasts to float32 and back, which our
        # algorithms beat once messages are a few KiB (benchmarks/results/collectives-cpu.md),
        # and on one node the node protocol, which reduces them as they are, at every size
        # (node-protocol-cpu-fastpath.md): the one the table takes for the next larger messages.
        larger = [algorithm for bound, algorithm in table_for(ranks, table) if bound > nbytes and algorithm != "mpi"]
        on_node = nodes == 1 and larger[:1] == ["hierarchical"]
        if on_node or _lookup(HALF_TABLE, nbytes) != "mpi":
            chosen = larger[0] if larger else _lookup(HALF_TABLE, nbytes)
    return chosen


def table_choice(channel, info) -> str:
    """auto's choice for buffer `info` (a BufferInfo) on `channel`: its forced algorithm, else its
    table's for the message's size and dtype."""
    return choose_allreduce(info.nbytes, channel.size, channel.tuning_table, info.dtype, channel.forced_algorithm,
                            channel.num_nodes)


def fast_path_bounds(ranks: int, nodes: int, table=None, forced: str | None = None) -> tuple:
    """((mpi, node) for other dtypes, (mpi, node) for float16/bfloat16): the small-message fast
    path (fastpath.py) gives messages below `mpi` to MPI, as choose_allreduce does from its first
    table rows, and those from `mpi` up to below `node` to the node protocol, which
    choose_allreduce gives them on one node (0, or `mpi`: none are)."""
    return tuple(_bounds(ranks, nodes, table, forced, dtype) for dtype in ("float32", "float16"))


def _bounds(ranks: int, nodes: int, table, forced, dtype: str) -> tuple:
    edges = sorted({bound for bound, _ in table_for(ranks, table) + HALF_TABLE} | {float("inf")})
    start = 0
    bounds = []
    for route in ("mpi", "hierarchical" if nodes == 1 else None):
        # choose_allreduce is constant between two edges: go on while it gives the route.
        while start < float("inf") and choose_allreduce(start, ranks, table, dtype, forced, nodes) == route:
            start = next(edge for edge in edges if edge > start)
        bounds.append(start)
    return tuple(bounds)


def layout_table(ranks: int, nodes: int):
    """The built-in table for a layout across nodes (one rank per node, or several), else None:
    on one node the rank count's built-in table applies."""
    if nodes <= 1:
        return None
    if ranks <= nodes:
        return TWO_NODES_ONE_PER_NODE_TABLE if nodes == 2 else MANY_NODES_ONE_PER_NODE_TABLE
    return SEVERAL_PER_NODE_TABLE


def table_for(ranks: int, table=None) -> tuple:
    """The tuned table when there is one, else the built-in one for this rank count."""
    return table or (TWO_RANK_TABLE if ranks == 2 else BUILTIN_TABLE)


def _lookup(table, nbytes: int) -> str:
    for bound, algorithm in table:
        if nbytes < bound:
            return algorithm
    return table[-1][1]


# ---- tuned tables -------------------------------------------------------------------------------

def tuning_path(path: str | None = None) -> str:
    return path or config.value("MPIDIST_TUNING_FILE")


def table_from_rows(rows) -> tuple:
    """[{"max_bytes": b, "algorithm": a}, ...] (max_bytes inclusive, None = no bound) as the
    (exclusive bound, algorithm) pairs choose_allreduce reads. Anything else is a ValueError
    naming the row: an unknown algorithm, a bound that is not a whole number of bytes (0 or
    more), bounds out of increasing order, a last row with a bound (sizes beyond it would have no
    algorithm) or an earlier row without."""
    if not isinstance(rows, list) or not rows:
        raise ValueError(f"a table is a non-empty list of rows, not {json.dumps(rows)[:40]}")
    table = []
    for i, row in enumerate(rows):
        if not isinstance(row, dict) or not {"max_bytes", "algorithm"} <= set(row):
            raise ValueError(f"row {i} is not an object with max_bytes and algorithm")
        algorithm, bound = row["algorithm"], row["max_bytes"]
        if algorithm not in ALLREDUCE:
            raise ValueError(f"row {i}: unknown algorithm {algorithm!r}")
        last = i == len(rows) - 1
        if (bound is None) != last:
            raise ValueError(f"row {i}: max_bytes {bound}: the last row, and only the last, has max_bytes null")
        if bound is None:
            table.append((float("inf"), algorithm))
            continue
        if isinstance(bound, bool) or not isinstance(bound, int) or bound < 0:
            raise ValueError(f"row {i}: max_bytes {bound!r} is not a whole number of bytes")
        if table and bound + 1 <= table[-1][0]:
            raise ValueError(f"row {i}: max_bytes {bound} is not above the previous row's {table[-1][0] - 1}: "
                             "rows go by increasing size")
        table.append((bound + 1, algorithm))
    return tuple(table)


def read_tuning_file(path: str | None = None) -> dict:
    """The tuning file's tables by rank count (and its "model"), {} when there is no file. A
    file that is not that (not JSON, a key that is not a rank count, a malformed table: see
    table_from_rows) is a ValueError naming the problem."""
    path = tuning_path(path)
    if not os.path.exists(path):
        return {}
    with open(path) as handle:
        tables = json.load(handle)
    if not isinstance(tables, dict):
        raise ValueError("not a JSON object of tables")
    for key, rows in tables.items():
        if key == "model":
            if not isinstance(rows, dict):
                raise ValueError("its model is not a JSON object")
            continue
        if key == "one_shot_bytes":
            if not isinstance(rows, dict) or not all(
                    ranks.isdigit() and type(bound) is int and bound >= 0 for ranks, bound in rows.items()):
                raise ValueError(f"its one_shot_bytes is not an object of byte counts by rank count: {rows!r}")
            continue
        if not key.isdigit() or int(key) < 1:
            raise ValueError(f"{key!r} is not a rank count")
        try:
            table_from_rows(rows)
        except ValueError as exc:
            raise ValueError(f"the table for {key} ranks: {exc}") from exc
    return tables


def ranks_per_core(per_node: int) -> float:
    """Ranks per core of a node with `per_node` ranks, this machine's cores taken for every
    node's: the model's time-slicing term counts from it."""
    return max(1.0, per_node / (os.cpu_count() or 1))


# The model's decisions cover sizes up to 2**(MODEL_SIZES_LOG2 - 1) bytes; the last holds beyond.
MODEL_SIZES_LOG2 = 41


def auto_rows(tables: dict, ranks: int, nodes: int):
    """The rows algorithm="auto" uses for `ranks` ranks on `nodes` nodes, from the tuning file's
    contents: the measured table where it applies and the cost model elsewhere (the module's
    docstring says why); None for the built-in table."""
    rows = tables.get(str(ranks))
    if rows is not None:
        table_from_rows(rows)  # refuse a malformed entry here, on the reading rank
    model = tables.get("model") or {}
    measured = model.get("measured", {}).get(str(ranks))
    per_node = -(-ranks // nodes)
    layout = cost_model.Layout(ranks, per_node, ranks_per_core(per_node))
    parameters = model.get("parameters") or {}
    segment = int(model.get("segment_bytes", SEGMENT_BYTES))
    if rows is not None and measured is None:
        return rows  # written before the model, with no record of its range: it covers every size
    if not parameters or cost_model.fastest(parameters, 1 << 20, layout, segment) is None:
        # No model for this layout (its link was never measured): the table where it was measured
        # on this layout; one from another says nothing about this one, so the built-in one.
        return rows if rows is not None and measured["ranks_per_node"] == layout.per_node else None
    starts = {1 << k for k in range(MODEL_SIZES_LOG2)}  # the model decides per power of two
    measured_table = None
    if rows is not None and measured["ranks_per_node"] == layout.per_node:
        measured_table = table_from_rows(rows)
        smallest, largest = measured["smallest"], measured["largest"]
        # The measured table keeps its own bounds exactly.
        starts |= {smallest, largest + 1} | {bound for bound, _ in measured_table[:-1]}

    def choice(nbytes: int) -> str:
        if measured_table is not None and smallest <= nbytes <= largest:
            return _lookup(measured_table, nbytes)
        return cost_model.fastest(parameters, nbytes, layout, segment)

    starts = sorted(starts)
    merged = []
    for start, following in zip(starts, starts[1:] + [None]):
        algorithm = choice(start)
        if merged and merged[-1]["algorithm"] == algorithm:
            merged[-1]["max_bytes"] = None if following is None else following - 1
        else:
            merged.append({"max_bytes": None if following is None else following - 1, "algorithm": algorithm})
    return merged


def load_tuning_table(mpi, nodes: int) -> tuple:
    """(table or None, one-shot bound) for this communicator's rank count and node count,
    identical on every rank (rank 0 reads the file, makes the rows and broadcasts them as bytes):
    None for the built-in table, and the bound measured on one node at this rank count
    (one_shot_bound), else ONE_SHOT_BYTES. A malformed file is reported once and ignored."""
    payload = b""
    if mpi.Get_rank() == 0:
        try:
            tables = read_tuning_file()
            choice = {"rows": auto_rows(tables, mpi.Get_size(), nodes),
                      "one_shot_bytes": one_shot_bound(tables, mpi.Get_size(), nodes)}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            warnings.warn(f"mpidist: ignoring the tuning file {tuning_path()}: {exc}", stacklevel=2)
            choice = {"rows": None, "one_shot_bytes": ONE_SHOT_BYTES}
        payload = json.dumps(choice).encode()
    length = np.array([len(payload)], dtype=np.int64)
    mpi.Bcast(length, root=0)
    message = np.frombuffer(payload, dtype=np.uint8).copy() if mpi.Get_rank() == 0 \
        else np.empty(int(length[0]), dtype=np.uint8)
    mpi.Bcast(message, root=0)
    choice = json.loads(message.tobytes().decode())
    rows = choice["rows"]
    return (None if rows is None else table_from_rows(rows)), choice["one_shot_bytes"]


def one_shot_bound(tables: dict, ranks: int, nodes: int) -> int:
    """The one-shot bound of the tuning file's contents for `ranks` ranks on one node (its
    "one_shot_bytes", which `mpidist tune` measures there), else ONE_SHOT_BYTES: across nodes the
    one-shot does not run."""
    measured = tables.get("one_shot_bytes", {}).get(str(ranks))
    return measured if nodes == 1 and measured is not None else ONE_SHOT_BYTES


def save_tuning_table(rows, ranks: int, path: str | None = None, measurements=None,
                      ranks_per_node: int | None = None, one_shot_bytes: int | None = None) -> str:
    """Write `rows` as the table for `ranks`, keeping the other rank counts already in the file.
    With `measurements` (mpidist bench's rows, taken at `ranks_per_node`), also keep them in
    place of earlier ones of the same layout and fit the cost model to every layout's; with
    `one_shot_bytes` (measured on one node), keep it as the one-shot bound for `ranks`."""
    path = tuning_path(path)
    try:
        tables = read_tuning_file(path)
    except (OSError, ValueError):
        tables = {}
    tables[str(ranks)] = rows
    if one_shot_bytes is not None:
        tables.setdefault("one_shot_bytes", {})[str(ranks)] = int(one_shot_bytes)
    if measurements is not None:
        tables["model"] = refit(tables.get("model") or {}, measurements, ranks, ranks_per_node)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as handle:
        json.dump(tables, handle, indent=1, sort_keys=True)
        handle.write("\n")
    return path


def refit(model: dict, measurements, ranks: int, ranks_per_node: int) -> dict:
    """The model section with this layout's measurements in place of earlier ones of the same
    layout, and the parameters fitted again to all of them."""
    kept = [m for m in model.get("measurements", []) if (m["ranks"], m["ranks_per_node"]) != (ranks, ranks_per_node)]
    new = [{"algorithm": row["algorithm"], "bytes": row["bytes"], "ranks": ranks, "ranks_per_node": ranks_per_node,
            "ranks_per_core": ranks_per_core(ranks_per_node), "time_us": row["time_us"]}
           for row in measurements if not row["wrong"]]
    sizes = [row["bytes"] for row in new]
    measured = dict(model.get("measured", {}))
    if sizes:
        measured[str(ranks)] = {"ranks_per_node": ranks_per_node, "smallest": min(sizes), "largest": max(sizes)}
    everything = kept + new
    return {"segment_bytes": SEGMENT_BYTES, "parameters": cost_model.fit(everything, SEGMENT_BYTES),
            "measured": measured, "measurements": everything}
