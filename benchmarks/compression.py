"""Time to accuracy with gradient compression across emulated nodes: md.DataParallel with every
compressor and without, and torch DDP with its PowerSGD hook, over gloo and over the "mpidist"
torch.distributed backend, as the peers.

    sudo python benchmarks/compression.py [--layouts 2x2,4x1] [--rates 500mbit,10gbit] [--delay 25us]
        [--compressions none,fp16,bf16,int8,powersgd:4,topk:0.01,ddp-powersgd:4,ddp-mpidist-powersgd:4]
        [--hidden 2560]
        [--batch 32] [--lr 0.05] [--steps 60] [--deadline 150] [--target 0.95] [--output PATH]
    python benchmarks/compression.py --local ...   (no root: the layouts' ranks on this machine, no link)

For each rate and layout (nodes x ranks per node) tests/multinode/cluster.sh brings up the nodes
with their links shaped to that rate, and one mpirun inside them trains every configuration in
turn, from the same initial weights on the same batches: an MLP 64 -> hidden -> hidden -> 10
(ReLU; hidden 2560: 6.7M parameters, 27 MB of float32 gradients, so that the all-reduce of the
gradients dominates a step on a slow link) on the handwritten digits that mpidist ships
(mpidist.data.ensure_digits: scikit-learn's 1500 training and 297 test images), `--batch`
images per rank per step in a fresh permutation every epoch, SGD with momentum 0.9.

Every configuration runs `--steps` steps, or fewer when its training time passes `--deadline`
seconds. Rank 0 measures the test accuracy and the test loss (the mean cross entropy, in
float64, kept to full precision) every `--eval-every` steps while the other ranks wait; that
time is not training time. A row holds: step time (median of rank 0's steps after the first
`--start` ones: PowerSGD's plain all-reduce steps, the same count for every configuration),
bytes per step (the bytes every node's link sent during those steps, read from the node's
/proc/net/dev; not measured with --local), the training time and step at which the test
accuracy first reached `--target` (null if never), the final accuracy and test loss, and how
far the final weights are from those of `none` in the same run (the L2 norm of the difference
over none's, and the largest absolute difference, in float64; null without a `none` row). On
297 test images a compressor's rounding seldom flips a prediction, so the loss and the distance
are what tell the compressors apart.

`ddp-powersgd:<rank>` is torch.nn.parallel.DistributedDataParallel over a gloo process group
(MASTER_ADDR: node 1's address) with torch's powerSGD_hook and a PowerSGDState of that rank,
registered as users register it (`register_comm_hook(state, powerSGD_hook)`: the hook returns
its future and DDP waits for it only at the end of backward), in one bucket: over gloo the hook
of several buckets fails (its second and third all-reduces start from gloo's thread when the
first ends, in an order that differs between the ranks from that of the next bucket's first,
and gloo pairs them by that order). `ddp-mpidist-powersgd:<rank>` is the same over the
"mpidist" backend (`dist.init_process_group("mpidist")`) in DDP's own buckets, whose exchanges
overlap the rest of backward. A DDP row names the hook that DDP holds (`comm_hook`, module and
name). `powersgd:<rank>` is mpidist's, with the same start
(`--start`, torch's start_powerSGD_iter).
Writes PATH.json (the rows of every layout and rate, the command, the link settings, the
machine's CPU and the load average) and PATH.md (the tables).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
CLUSTER = os.path.join(REPO, "tests", "multinode", "cluster.sh")
COMPRESSIONS = "none,fp16,bf16,int8,powersgd:4,topk:0.01,ddp-powersgd:4,ddp-mpidist-powersgd:4"
DDP_PEERS = {"ddp-powersgd:": "gloo", "ddp-mpidist-powersgd:": "mpidist"}  # spelling -> DDP's backend
ROW_KEYS = ("configuration", "steps", "step_ms", "bytes_per_step", "time_to_target_s", "steps_to_target",
            "final_accuracy", "final_loss", "training_s", "history", "distance_from_none_relative",
            "distance_from_none_max_abs", "comm_hook")
HISTORY_KEYS = ("step", "training_s", "accuracy", "loss")


def ddp_peer(configuration: str) -> tuple[str, str] | None:
    """(backend, PowerSGD rank as written) of a DDP peer's spelling; None for mpidist's own."""
    for prefix, backend in DDP_PEERS.items():
        if configuration.startswith(prefix):
            return backend, configuration[len(prefix):]
    return None


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layouts", default="2x2,4x1", help="comma-separated NODESxRANKS_PER_NODE")
    parser.add_argument("--rates", default="500mbit,10gbit", help="link rates (tc units), one run each")
    parser.add_argument("--delay", default="25us", help="every node's one-way delay (netem)")
    parser.add_argument("--compressions", default=COMPRESSIONS,
                        help="configurations: md.DataParallel's compression spellings, or "
                        + ", ".join(f"{prefix}<rank>" for prefix in DDP_PEERS))
    parser.add_argument("--hidden", type=int, default=2560, help="width of the MLP's two hidden layers")
    parser.add_argument("--batch", type=int, default=32, help="images per rank per step")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--steps", type=int, default=60, help="steps per configuration, at most")
    parser.add_argument("--deadline", type=float, default=150.0,
                        help="training seconds per configuration, at most (checked at each evaluation)")
    parser.add_argument("--start", type=int, default=10,
                        help="PowerSGD's plain all-reduce steps (torch's start_powerSGD_iter); not timed")
    parser.add_argument("--eval-every", type=int, default=3, help="steps between test-accuracy measurements")
    parser.add_argument("--target", type=float, default=0.95, help="the test accuracy timed to")
    parser.add_argument("--local", action="store_true",
                        help="run each layout's ranks on this machine, without emulated nodes (no root, no link)")
    parser.add_argument("--output", default=os.path.join(HERE, "results", "compression-cpu"),
                        help="path of the .json and .md results, without the suffix")
    parser.add_argument("--worker", metavar="JSON", help=argparse.SUPPRESS)  # a rank's side: write the rows there
    args = parser.parse_args(argv)
    from mpidist.parallel.compressors import parse_compression
    for name in args.compressions.split(","):
        peer = ddp_peer(name)
        if peer is not None:
            rank = peer[1]
            if not rank.isdigit() or int(rank) < 1:
                parser.error(f"{name}: give {name[:len(name) - len(rank)]}<rank>, a whole number >= 1")
        else:
            try:
                parse_compression(name)
            except ValueError as exc:
                parser.error(str(exc))
    try:
        args.layout_list = [tuple(int(n) for n in layout.lower().split("x")) for layout in args.layouts.split(",")]
    except ValueError:
        parser.error(f"--layouts {args.layouts}: give NODESxRANKS_PER_NODE, comma-separated (2x2,4x1)")
    if any(len(layout) != 2 or min(layout) < 1 for layout in args.layout_list):
        parser.error(f"--layouts {args.layouts}: give NODESxRANKS_PER_NODE, comma-separated (2x2,4x1)")
    for name in ("hidden", "batch", "steps", "eval_every"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if not 0 <= args.start < args.steps:
        parser.error(f"--start {args.start}: give 0 <= start < --steps ({args.steps})")
    if not args.local and not args.worker and os.geteuid() != 0:
        parser.error("needs root, for the emulated nodes (tests/multinode/cluster.sh); --local runs without them")
    return args


# ---- a rank's side ------------------------------------------------------------------------------

def node_sent_bytes() -> int | None:
    """Bytes this node's link (eth0 in the node's network namespace) has sent; None outside the
    emulated nodes."""
    if not os.environ.get("MPIDIST_MN_NODE_ADDRS"):
        return None
    with open("/proc/net/dev") as devices:
        for line in devices:
            name, _, counters = line.partition(":")
            if name.strip() == "eth0":
                return int(counters.split()[8])
    return None


def load_digits(comm):
    import h5py
    import torch

    from mpidist.data import ensure_digits
    with h5py.File(ensure_digits(comm=comm), "r") as f:
        return [torch.from_numpy(f[f"{split}/{part}"][:]) for split in ("train", "test") for part in ("x", "y")]


def make_model(hidden: int):
    import torch
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, hidden),
                               torch.nn.ReLU(), torch.nn.Linear(hidden, 10))


def wrapped(model, configuration: str, args, groups: dict):
    """The model in md.DataParallel with the configuration's compression, or in DDP over the
    peer's process group (`groups`: backend -> group) with torch's PowerSGD hook."""
    import dataclasses

    import mpidist as md
    from mpidist.parallel.compressors import PowerSGD, parse_compression
    peer = ddp_peer(configuration)
    if peer is None:
        compression = parse_compression(configuration)
        if isinstance(compression, PowerSGD):
            compression = dataclasses.replace(compression, start_iter=args.start)
        return md.DataParallel(model, compression=compression)
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel
    backend, rank = peer
    # gloo runs the hook in one bucket only (the docstring says why); mpidist in DDP's own.
    model_mb = math.ceil(sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20)
    ddp = DistributedDataParallel(model, process_group=groups[backend],
                                  bucket_cap_mb=model_mb if backend == "gloo" else None)
    ddp.register_comm_hook(PowerSGDState(process_group=groups[backend], matrix_approximation_rank=int(rank),
                                         start_powerSGD_iter=args.start, random_seed=0), powerSGD_hook)
    return ddp


def comm_hook_name(net) -> str | None:
    """The module and name of the communication hook DDP holds; None for md.DataParallel."""
    hooks = getattr(net, "_comm_hooks", None)
    if not hooks:
        return None
    [(hook, _)] = hooks
    return f"{hook.__module__}.{hook.__qualname__}"


def train(configuration: str, data, args, comm, is_node_leader: bool, groups: dict):
    """One configuration's row and its final weights, flat (on rank 0; the other ranks' rows are
    not kept)."""
    import torch
    x_train, y_train, x_test, y_test = data
    rank, size = comm.Get_rank(), comm.Get_size()
    model = make_model(args.hidden)
    net = wrapped(model, configuration, args, groups)
    comm_hook = comm_hook_name(net)
    optimizer = torch.optim.SGD(net.parameters(), lr=args.lr, momentum=0.9)
    per_step = args.batch * size
    steps_per_epoch = max(1, len(x_train) // per_step)
    step_s, history, reached = [], [], None
    training_s, sent_before, step = 0.0, None, 0
    while step < args.steps:
        if step == args.start:
            comm.Barrier()
            sent_before = node_sent_bytes() if is_node_leader else 0
        epoch, position = divmod(step, steps_per_epoch)
        order = torch.randperm(len(x_train), generator=torch.Generator().manual_seed(epoch))
        rows = order[position * per_step + rank * args.batch:][:args.batch]
        started = time.perf_counter()
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(net(x_train[rows]), y_train[rows]).backward()
        optimizer.step()
        step_s.append(time.perf_counter() - started)
        training_s += step_s[-1]
        step += 1
        if step % args.eval_every and step != args.steps:
            continue
        accuracy = loss = None
        if rank == 0:
            with torch.no_grad():
                logits = model(x_test).double()
                accuracy = (logits.argmax(1) == y_test).double().mean().item()
                loss = torch.nn.functional.cross_entropy(logits, y_test).item()
        accuracy, loss, training_s = comm.bcast((accuracy, loss, training_s))  # rank 0's clock decides for all
        history.append([step, round(training_s, 3), accuracy, loss])
        if reached is None and accuracy >= args.target:
            reached = (step, training_s)
        if training_s >= args.deadline:
            break
    comm.Barrier()
    sent = None
    if step > args.start:
        sent = node_sent_bytes() if is_node_leader else 0
        sent = None if sent is None or sent_before is None else sent - sent_before
        sent = comm.allreduce(sent if sent is not None else -1)
    del net, optimizer
    weights = torch.cat([p.detach().flatten() for p in model.parameters()]).double() if rank == 0 else None
    return {"configuration": configuration, "steps": step,
            "step_ms": 1e3 * statistics.median(step_s[args.start:]) if step > args.start else None,
            "bytes_per_step": sent / (step - args.start) if sent is not None and sent >= 0 else None,
            "time_to_target_s": reached and round(reached[1], 3), "steps_to_target": reached and reached[0],
            "final_accuracy": history[-1][2], "final_loss": history[-1][3], "training_s": round(training_s, 3),
            "history": history, "comm_hook": comm_hook}, weights


def add_distances_from_none(rows: list[dict], weights: list) -> None:
    """Each row's final weights against none's: the L2 norm of the difference over none's, and
    the largest absolute difference (null without a `none` row)."""
    names = [row["configuration"] for row in rows]
    reference = weights[names.index("none")] if "none" in names else None
    for row, mine in zip(rows, weights):
        difference = None if reference is None else mine - reference
        row["distance_from_none_relative"] = None if difference is None else (
            difference.norm() / reference.norm()).item()
        row["distance_from_none_max_abs"] = None if difference is None else difference.abs().max().item()


def worker(args) -> None:
    import gc

    import torch.distributed as dist
    from mpi4py import MPI

    import mpidist as md
    md.init()
    comm = MPI.COMM_WORLD
    data = load_digits(comm)
    groups = {}
    configurations = args.compressions.split(",")
    if any(ddp_peer(c) for c in configurations):
        # gloo's store and connections between the nodes: node 1's address, its own interface.
        node_addresses = os.environ.get("MPIDIST_MN_NODE_ADDRS")
        os.environ["MASTER_ADDR"] = node_addresses.split(",")[0] if node_addresses else "127.0.0.1"
        if node_addresses:
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "eth0")
        dist.init_process_group("mpidist")
        groups = {"mpidist": dist.group.WORLD, "gloo": dist.new_group(backend="gloo")}
    rows, weights = [], []
    for configuration in configurations:
        row, final_weights = train(configuration, data, args, comm, md.local_rank() == 0, groups)
        rows.append(row)
        weights.append(final_weights)
        if comm.Get_rank() == 0:
            print(f"compression: {configuration}: {json.dumps({k: v for k, v in row.items() if k != 'history'})}",
                  file=sys.stderr, flush=True)
    gc.collect()  # DDP's reducer before the process groups that it holds
    if groups:
        dist.destroy_process_group(groups["gloo"])
        dist.destroy_process_group()
    if comm.Get_rank() == 0:
        add_distances_from_none(rows, weights)
        with open(args.worker, "w") as out:
            json.dump(rows, out)


# ---- the command's side -------------------------------------------------------------------------

def run_layout(nodes: int, per_node: int, rate: str | None, args, argv) -> tuple[list[dict], str]:
    """The rows of one layout at one rate, and the link as cluster.sh reports it."""
    with tempfile.TemporaryDirectory() as directory:
        rows_path = os.path.join(directory, "rows.json")
        ranks = ["-np", str(nodes * per_node), sys.executable, os.path.abspath(__file__), *argv, "--worker", rows_path]
        # The mpirun beside this interpreter (the virtual environment's, of mpi4py's MPI) first.
        env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
        if args.local:
            command = ["mpirun", "--oversubscribe", "--bind-to", "none", *ranks]
        else:
            command = ["bash", CLUSTER, "run", "mpirun", "--bind-to", "none", *ranks]
            env.update(MPIDIST_MN_NODES=str(nodes), MPIDIST_MN_SLOTS=str(per_node), MPIDIST_MN_RATE=rate,
                       MPIDIST_MN_DELAY=args.delay)
        link = "none: every rank on this machine (--local)"
        with subprocess.Popen(command, env=env, cwd=REPO, text=True, stderr=subprocess.PIPE) as run:
            for line in run.stderr:  # passed on as it comes: a configuration's row when it ends
                sys.stderr.write(line)
                if line.startswith("multinode: up:"):
                    link = line.split("link: ", 1)[1].strip()
        if run.returncode:
            raise SystemExit(f"compression: the {nodes} x {per_node} run failed (exit status {run.returncode})")
        with open(rows_path) as rows:
            return json.load(rows), link


def table(rows: list[dict]) -> str:
    baseline = next((r for r in rows if r["configuration"] == "none"), None)
    lines = ["| configuration | MB per step | step ms | vs none | time to target s | vs none | "
             "steps to target | final accuracy | final test loss | weights vs none: relative L2 | max abs | "
             "steps run |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def ratio(key, row):
        if baseline is None or not baseline[key] or not row[key]:
            return "-"
        return f"{baseline[key] / row[key]:.2f}x"

    for row in rows:
        megabytes = f"{row['bytes_per_step'] / 1e6:.2f}" if row["bytes_per_step"] is not None else "-"
        step = f"{row['step_ms']:.0f}" if row["step_ms"] is not None else "-"
        to_target = f"{row['time_to_target_s']:.1f}" if row["time_to_target_s"] is not None else "not reached"
        distances = [f"{row[key]:.3g}" if row[key] is not None else "-"
                     for key in ("distance_from_none_relative", "distance_from_none_max_abs")]
        lines.append(f"| {row['configuration']} | {megabytes} | {step} | {ratio('step_ms', row)} | {to_target} | "
                     f"{ratio('time_to_target_s', row)} | {row['steps_to_target'] or '-'} | "
                     f"{100 * row['final_accuracy']:.1f}% | {row['final_loss']:.6f} | {' | '.join(distances)} | "
                     f"{row['steps']} |")
    return "\n".join(lines)


def verdict(run: dict) -> str:
    """Where compression pays on this run: each configuration's time to the target against none's
    with its final accuracy, and mpidist's PowerSGD against DDP's hook of the same rank over each
    backend."""
    rows = {row["configuration"]: row for row in run["rows"]}
    baseline = rows.get("none")
    if baseline is None or baseline["time_to_target_s"] is None:
        return "Uncompressed training did not reach the target here, so there is no time to compare with."
    paying, not_paying = [], []
    for name, row in rows.items():
        if name == "none":
            continue
        if row["time_to_target_s"] is None:
            not_paying.append(f"{name} (target not reached)")
            continue
        speedup = baseline["time_to_target_s"] / row["time_to_target_s"]
        points = 100 * (row["final_accuracy"] - baseline["final_accuracy"])
        text = f"{name} {speedup:.2f}x, final accuracy {points:+.1f} points"
        (paying if speedup > 1 and points >= -0.5 else not_paying).append(text)
    lines = ["Time to the target against none's " + (f"(pays: {'; '.join(paying)}" if paying else "(pays: nothing")
             + (f"; does not pay: {'; '.join(not_paying)})." if not_paying else ").")]
    for name, peer in rows.items():
        backend, rank = ddp_peer(name) or (None, None)
        mine = rows.get(f"powersgd:{rank}")
        if backend and mine and mine["time_to_target_s"] and peer["time_to_target_s"]:
            lines.append(f"{mine['configuration']} against {name} (torch's hook over {backend}): "
                         f"{peer['time_to_target_s'] / mine['time_to_target_s']:.2f}x the speed to the target, "
                         f"step time {peer['step_ms'] / mine['step_ms']:.2f}x.")
    return " ".join(lines)


def where_it_pays(results: list[dict]) -> str:
    """One line per run: the compressor fastest to the target with a final accuracy within half a
    point of none's, and by how much; or that none of them is faster."""
    lines = []
    for run in results:
        rows = {row["configuration"]: row for row in run["rows"]}
        baseline = rows.get("none")
        where = f"{run['nodes']} x {run['ranks_per_node']} at {run['rate'] or 'no link'}"
        if baseline is None or baseline["time_to_target_s"] is None:
            lines.append(f"- {where}: no uncompressed time to the target to compare with.")
            continue
        speedups = {name: baseline["time_to_target_s"] / row["time_to_target_s"] for name, row in rows.items()
                    if name != "none" and row["time_to_target_s"]
                    and row["final_accuracy"] >= baseline["final_accuracy"] - 0.005}
        best = max(speedups, key=speedups.get, default=None)
        if best is not None and speedups[best] > 1:
            lines.append(f"- {where}: pays; fastest to the target {best}, {speedups[best]:.2f}x as fast as none.")
        else:
            lines.append(f"- {where}: does not pay; the best, {best}, takes {1 / speedups[best]:.2f}x none's time."
                         if best else f"- {where}: does not pay; no compressor reached the target.")
    return "\n".join(lines)


def cpu_description() -> str:
    """lscpu's model name, family and model, and whether the CPU has AVX-512."""
    fields = dict(line.split(":", 1) for line in subprocess.run(
        ["lscpu"], capture_output=True, text=True).stdout.splitlines() if ":" in line)
    fields = {name.strip(): value.strip() for name, value in fields.items()}
    avx512 = "AVX-512" if "avx512f" in fields.get("Flags", "").split() else "no AVX-512"
    return (f"{fields.get('Model name', 'unknown')} (family {fields.get('CPU family', '?')} "
            f"model {fields.get('Model', '?')}, {avx512})")


def write(args, argv, results: list[dict], uptimes: list[str]) -> None:
    """PATH.json and PATH.md of the runs so far."""
    cpu = cpu_description()
    command = "python benchmarks/compression.py " + " ".join(argv)
    with open(args.output + ".json", "w") as out:
        json.dump({"command": command, "cpu": cpu, "cores": os.cpu_count(), "uptime": uptimes,
                   "settings": {k: v for k, v in vars(args).items() if k not in ("worker", "layout_list")},
                   "runs": results}, out, indent=1)
    sections = [f"## {r['nodes']} nodes x {r['ranks_per_node']} ranks per node, {r['rate'] or 'no link'}\n\n"
                f"Link: {r['link']}.\n\n{table(r['rows'])}\n\n{verdict(r)}\n" for r in results]
    with open(args.output + ".md", "w") as out:
        out.write("# Gradient compression: time to accuracy across emulated nodes (benchmarks/compression.py)\n\n"
                  f"Command: `{command}`\n\n"
                  f"Machine: {cpu}, {os.cpu_count()} cores, shared with other work while this ran; `uptime` before "
                  "the first run and after each:\n\n" + "".join(f"- {u}\n" for u in uptimes)
                  + f"\nTarget test accuracy {100 * args.target:.0f}%; at most {args.steps} steps or "
                  f"{args.deadline:g} s of training per configuration. MB per step: what every node's link "
                  f"sent, all nodes together, per step after the first {args.start}; step ms: the median of "
                  "those steps (rank 0); time to target: training seconds (evaluations excluded) until the "
                  "test accuracy, measured every "
                  f"{args.eval_every} steps, first reached the target; vs none: none's time over the row's; "
                  "final test loss: the mean cross entropy on the test images after the last step (every "
                  "evaluation's, to full precision, in the JSON's `history`: step, training s, accuracy, loss); "
                  "weights vs none: the final weights' difference from none's in this run, its L2 norm over "
                  "none's and its largest absolute element.\n\n"
                  f"Where compression pays (time to the target, final accuracy within 0.5 point of none's):\n\n"
                  f"{where_it_pays(results)}\n\n" + "\n".join(sections))


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    results, uptimes = [], [subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()]
    for rate in [None] if args.local else args.rates.split(","):
        for nodes, per_node in args.layout_list:
            rows, link = run_layout(nodes, per_node, rate, args, argv)
            results.append({"nodes": nodes, "ranks_per_node": per_node, "rate": rate, "link": link, "rows": rows})
            uptimes.append(subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
            write(args, argv, results, uptimes)  # each run's rows kept as soon as it ends
    print(f"compression: wrote {args.output}.json and {args.output}.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
