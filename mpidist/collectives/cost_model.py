"""The all-reduce cost model: each algorithm's time as latency, bandwidth and reduction terms per
step, in the alpha-beta-gamma model of Thakur, Rabenseifner and Gropp (2005), and the fitting of
its parameters to measured times.

Parameters (seconds per message, per byte, per barrier round):
  call                   one all-reduce call through mpidist, whatever it moves (argument check,
                         dispatch; the intercept)
  alpha_shm, beta_shm    one of our point-to-point messages between two ranks of one node
  alpha_net, beta_net    the same between ranks of different nodes
  rendezvous_shm, rendezvous_net
                         the extra cost of a message above the MPI library's eager limit
                         (EAGER_BYTES): the receiver must answer before the data moves, which
                         needs both ranks' progress loops
  gamma                  reducing one byte of one operand into another (the fused kernels)
  copy                   copying one byte in memory (the hierarchical algorithm's shared window)
  sync                   one round of a node barrier (the hierarchical algorithm's)
  crowd                  what every message, barrier round and MPI step costs more for each rank
                         beyond one per core (time-slicing, when ranks outnumber cores)
  mpi_alpha_shm, mpi_beta_shm, mpi_alpha_net, mpi_beta_net
                         the MPI library's own all-reduce, a black box: per step and per byte
                         (its own reduction included), inside one node and across nodes

Layout: p ranks, L ranks per node, placed by block (node k holds ranks kL .. kL+L-1), N = p/L
nodes; two ranks talk over shared memory when they are on one node, else over the node's link.
A step's time is that of its slowest pair, so a step with any pair across nodes costs the link's
terms; when c ranks of a node send across at once they share its link (c times beta_net).

Every message of ours costs one alpha per segment (MPIDIST_SEGMENT_BYTES, an argument here)
where the algorithm posts segments, and one rendezvous more when a segment is above the eager
limit: over TCP that is what makes the segmented algorithms fall behind with one rank per node
(benchmarks/results/multinode-cpu.md).

A time is a sum of coefficient x parameter, so terms() gives the coefficients, predict() their
sum with the parameters, and fit() finds the parameters by least squares on relative error.
"""
from __future__ import annotations

import math
from collections import Counter

import numpy as np

from .hierarchical import RING_ACROSS_NODES_BYTES
from .reduce_bcast import BLOCK_BYTES as REDUCE_BCAST_BLOCK

PARAMETERS = ("call", "alpha_shm", "beta_shm", "alpha_net", "beta_net", "rendezvous_shm", "rendezvous_net", "gamma",
              "copy", "sync", "crowd", "mpi_alpha_shm", "mpi_beta_shm", "mpi_alpha_net", "mpi_beta_net")
# Coefficients that count messages, rounds or steps: each waits once for the scheduler when crowded.
PER_MESSAGE = ("alpha_shm", "alpha_net", "rendezvous_shm", "rendezvous_net", "sync", "mpi_alpha_shm", "mpi_alpha_net")
MODELLED = ("ring", "tree", "recursive_halving", "recursive_doubling", "reduce_bcast", "hierarchical", "mpi")

# Open MPI's defaults (btl_sm_eager_limit, btl_tcp_eager_limit): larger messages go by rendezvous.
EAGER_BYTES = {"shm": 4 * 1024, "net": 64 * 1024}


class Layout:
    """p ranks, `per_node` of them on each node, by block; `ranks_per_core` of them share each core
    (more than 1 on an oversubscribed machine)."""

    def __init__(self, ranks: int, per_node: int, ranks_per_core: float = 1.0):
        if ranks < 1 or per_node < 1:
            raise ValueError(f"a layout needs at least one rank and one rank per node, got {ranks} x {per_node}")
        self.ranks = ranks
        self.per_node = min(per_node, ranks)
        self.nodes = math.ceil(ranks / self.per_node)
        self.ranks_per_core = ranks_per_core

    def link(self, distance: int) -> str:
        """The link between ranks `distance` apart in the partner patterns of the tree and the
        recursive algorithms (partners at distances below the node size share a node)."""
        return "shm" if self.nodes == 1 or distance < self.per_node else "net"

    def sharing(self, link: str) -> int:
        """How many ranks of a node send over its link at once when all pair across nodes."""
        return self.per_node if link == "net" else 1


class Terms(Counter):
    """Coefficients of the parameters: a time once multiplied by them."""

    def message(self, link: str, nbytes: float, messages: int = 1, sharing: int = 1) -> None:
        """`messages` messages of `nbytes` bytes in all."""
        if nbytes > 0:
            self[f"alpha_{link}"] += messages
            self[f"beta_{link}"] += nbytes * sharing
            if nbytes / messages > EAGER_BYTES[link]:
                self[f"rendezvous_{link}"] += messages

    def segmented(self, link: str, nbytes: float, segment: int, sharing: int = 1) -> None:
        self.message(link, nbytes, max(1, math.ceil(nbytes / segment)), sharing)


def terms(algorithm: str, nbytes: int, layout: Layout, segment: int) -> Terms:
    """The coefficients of one all-reduce of `nbytes` with `algorithm` on `layout`."""
    if algorithm not in MODELLED:
        raise ValueError(f"no cost model for algorithm {algorithm!r}; modelled: {', '.join(MODELLED)}")
    total = Terms(call=1)
    if layout.ranks > 1 and nbytes > 0:
        total.update(STEPS[algorithm](nbytes, layout, segment))
        if layout.ranks_per_core > 1:
            total["crowd"] = (layout.ranks_per_core - 1) * sum(total[name] for name in PER_MESSAGE)
    return total


def ring_steps(n, layout: Layout, segment: int) -> Terms:
    """2(p-1) steps of n/p bytes; the reduce-scatter's half also reduces them. With several
    nodes one pair of each step crosses each node boundary."""
    p = layout.ranks
    link = "net" if layout.nodes > 1 else "shm"
    chunk = n / p
    steps = Terms()
    for _ in range(2 * (p - 1)):
        steps.segmented(link, chunk, segment)
    steps["gamma"] += (p - 1) * chunk
    return steps


def tree_steps(n, layout: Layout, segment: int) -> Terms:
    """Binomial reduce to rank 0 and broadcast back, pipelined by segment: rank 0 takes every
    segment from each of its ceil(log2 p) children in turn (and sends each to each), after the
    pipeline fills through the subtree of its largest child."""
    segments = max(1, math.ceil(n / segment))
    piece = n / segments
    masks = [1 << level for level in range(math.ceil(math.log2(layout.ranks)))]
    steps = Terms()
    for mask in masks:
        link = layout.link(mask)
        rounds = 2 * (segments + (1 if mask != masks[-1] else 0))  # reduce and broadcast
        steps.message(link, piece * rounds, rounds)
        steps["gamma"] += piece * rounds / 2
    return steps


def fold_steps(n, layout: Layout) -> tuple[Terms, int]:
    """Rabenseifner's fold to the power of two p2 below p: whole-buffer messages in and out."""
    p2 = 1 << (layout.ranks.bit_length() - 1)
    steps = Terms()
    if p2 < layout.ranks:
        link = layout.link(1)
        steps.message(link, 2 * n, 2)
        steps["gamma"] += n
    return steps, p2


def recursive_doubling_steps(n, layout: Layout, segment: int) -> Terms:
    """log2(p2) exchanges of the whole buffer, each one message (not segmented)."""
    steps, p2 = fold_steps(n, layout)
    distance = 1
    while distance < p2:
        link = layout.link(distance)
        steps.message(link, n, 1, layout.sharing(link))
        steps["gamma"] += n
        distance <<= 1
    return steps


def recursive_halving_steps(n, layout: Layout, segment: int, segmented_allgather: bool = False) -> Terms:
    """log2(p2) halving exchanges (segmented, reduced) at distances p2/2 .. 1, then the same
    exchanges back as single messages (the allgather by recursive doubling), or in segments too
    (`segmented_allgather`: the hierarchical algorithm's exchanges across nodes)."""
    steps, p2 = fold_steps(n, layout)
    distance, part = p2 // 2, n / 2
    while distance >= 1:
        link = layout.link(distance)
        steps.segmented(link, part, segment, layout.sharing(link))
        steps.segmented(link, part, segment if segmented_allgather else part, layout.sharing(link))
        steps["gamma"] += part
        distance, part = distance // 2, part / 2
    return steps


def reduce_bcast_steps(n, layout: Layout, segment: int) -> Terms:
    """Rank 0 takes every other rank's buffer (blocks of REDUCE_BCAST_BLOCK, one message each;
    those from other nodes through its node's link), reduces them in one k-way pass, and
    broadcasts the result down the binomial tree."""
    p, local = layout.ranks, layout.per_node
    blocks = max(1, math.ceil(n / REDUCE_BCAST_BLOCK))
    steps = Terms()
    steps.message("shm", (local - 1) * n, (local - 1) * blocks)
    steps.message("net", (p - local) * n, (p - local) * blocks)
    steps["gamma"] += (p - 1) * n
    broadcast = tree_steps(n, layout, segment)
    steps.update({name: value / 2 for name, value in broadcast.items() if name != "gamma"})
    return steps


def barrier_rounds(ranks: int) -> int:
    return max(1, math.ceil(math.log2(ranks))) if ranks > 1 else 0


def across_nodes_steps(n, layout: Layout, segment: int) -> Terms:
    """hierarchical.py's lanes: each of the L ranks of a node all-reduces n/L bytes with its
    peers on the other nodes (between 2 nodes in one whole exchange, on more every transfer in
    segments), the L lanes sharing the node's link."""
    lanes, nodes = layout.per_node, layout.nodes
    part, peers = n / lanes, Layout(nodes, 1)
    if nodes == 2:
        steps = recursive_doubling_steps(part, peers, segment)
    elif nodes & (nodes - 1) and part >= RING_ACROSS_NODES_BYTES:
        steps = ring_steps(part, peers, segment)
    else:
        steps = recursive_halving_steps(part, peers, segment, segmented_allgather=True)
    steps["beta_net"] *= lanes
    return steps


def hierarchical_steps(n, layout: Layout, segment: int) -> Terms:
    """Through the node's shared window, then across nodes in lanes (hierarchical.py's two paths)."""
    local, nodes = layout.per_node, layout.nodes
    if local == 1:
        return across_nodes_steps(n, layout, segment)
    steps = Terms()
    steps["gamma"] += (local - 1) * n / local
    if nodes == 1:
        # copy in the others' slices, reduce one's own and publish it, copy the others' results out
        steps["copy"] += 2 * (local - 1) * n / local + n / local
        steps["sync"] += 2 * barrier_rounds(local)
        return steps
    steps["copy"] += 2 * n  # the whole buffer in, the whole result out
    steps["sync"] += 2 * barrier_rounds(local)
    steps.update(across_nodes_steps(n, layout, segment))
    return steps


def mpi_steps(n, layout: Layout, segment: int) -> Terms:
    """The MPI library's own all-reduce as a black box with the shape of a tuned one: ceil(log2 p)
    steps and 2(p-1)/p n bytes per rank."""
    link = "net" if layout.nodes > 1 else "shm"
    return Terms({f"mpi_alpha_{link}": math.ceil(math.log2(layout.ranks)),
                  f"mpi_beta_{link}": 2 * (layout.ranks - 1) / layout.ranks * n})


STEPS = {"ring": ring_steps, "tree": tree_steps, "recursive_halving": recursive_halving_steps,
         "recursive_doubling": recursive_doubling_steps, "reduce_bcast": reduce_bcast_steps,
         "hierarchical": hierarchical_steps, "mpi": mpi_steps}


def predict(parameters: dict, algorithm: str, nbytes: int, layout: Layout, segment: int) -> float | None:
    """Seconds, or None when a parameter it needs was never fitted (e.g. the link's, from
    measurements on one node only)."""
    total = 0.0
    for name, coefficient in terms(algorithm, nbytes, layout, segment).items():
        if coefficient:
            value = parameters.get(name)
            if value is None:
                return None
            total += coefficient * value
    return total


def fastest(parameters: dict, nbytes: int, layout: Layout, segment: int, algorithms=MODELLED) -> str | None:
    """The algorithm with the smallest predicted time (None when none can be predicted)."""
    times = {a: predict(parameters, a, nbytes, layout, segment) for a in algorithms}
    known = {a: t for a, t in times.items() if t is not None}
    return min(known, key=known.get) if known else None


def row_layout(row) -> Layout:
    return Layout(row["ranks"], row["ranks_per_node"], row.get("ranks_per_core", 1.0))


def fit(measurements, segment: int) -> dict:
    """Parameters from measured times: rows {"algorithm", "bytes", "ranks", "ranks_per_node",
    "time_us"} (mpidist bench's rows plus the layout; "ranks_per_core" where it exceeds 1).

    The error minimized is the relative one, so that 8-byte and 16-MiB rows weigh alike: each
    row is divided by a scale of its time, first the measured time, then (FIT_ROUNDS times) the
    geometric mean of measured and predicted, which approaches the error of log(predicted /
    measured) and so stops favouring predictions that are too small. Every parameter is kept
    non-negative by dropping the most negative one and solving again. Parameters no row depends
    on (the link's, from one node) are left out of the result."""
    rows = [row for row in measurements if row["algorithm"] in MODELLED and row["time_us"] > 0]
    if not rows:
        raise ValueError("no measurements of modelled algorithms to fit")
    matrix = np.array([[terms(row["algorithm"], row["bytes"], row_layout(row), segment).get(name, 0.0)
                        for name in PARAMETERS] for row in rows])
    seconds = np.array([row["time_us"] * 1e-6 for row in rows])
    identifiable = [index for index in range(len(PARAMETERS)) if matrix[:, index].any()]
    row_scale = seconds
    for _ in range(FIT_ROUNDS + 1):
        solution = nonnegative_least_squares(matrix[:, identifiable] / row_scale[:, None], seconds / row_scale)
        predicted = matrix[:, identifiable] @ solution
        row_scale = np.sqrt(seconds * np.maximum(predicted, seconds / 100))
    return {PARAMETERS[index]: float(value) for index, value in zip(identifiable, solution)}


FIT_ROUNDS = 10


def nonnegative_least_squares(matrix, target):
    """x >= 0 minimizing |matrix x - target|: least squares, the most negative unknown set to
    zero and the rest solved again until none is negative."""
    active = list(range(matrix.shape[1]))
    solution = np.zeros(matrix.shape[1])
    while active:
        columns = matrix[:, active]
        scale = np.linalg.norm(columns, axis=0)  # conditioning: bytes and messages differ by 1e9
        values = np.linalg.lstsq(columns / scale, target, rcond=None)[0]
        if values.min() >= 0:
            solution[active] = values / scale
            break
        del active[int(np.argmin(values))]
    return solution


def with_network(parameters: dict, alpha_s: float, gbit_per_s: float) -> dict:
    """`parameters` (fitted on one node) on a stated link between nodes: a message across costs
    what one inside the node costs (the software and memory side, measured) plus the link's
    latency `alpha_s` and its time per byte at `gbit_per_s`; the same for MPI's own, whose
    per-byte cost inside the node includes its reduction."""
    beta = 8 / (gbit_per_s * 1e9)
    return dict(parameters, alpha_net=alpha_s + parameters["alpha_shm"], beta_net=beta + parameters["beta_shm"],
                rendezvous_net=alpha_s + parameters.get("rendezvous_shm", 0.0),
                mpi_alpha_net=alpha_s + parameters["mpi_alpha_shm"], mpi_beta_net=beta + parameters["mpi_beta_shm"])
