"""Top-k convergence without the network: benchmarks/compression.py's model, data and optimizer,
its ranks simulated in one process, top-k with error feedback done by a float64 NumPy reference.

    python benchmarks/topk_convergence.py [--variants none,topk:0.01,topk:0.05,topk:0.1,dgc:0.01]
        [--ranks 4] [--hidden 2560] [--batch 32] [--lr 0.05] [--steps 500] [--eval-every 3]
        [--target 0.95] [--report 60,200,500] [--output PATH]

The training is benchmarks/compression.py's: an MLP 64 -> hidden -> hidden -> 10 (ReLU; the same
initial weights, torch.manual_seed(0)), in float32 as there, on the digits mpidist ships
(mpidist.data.ensure_digits), each simulated rank `--batch` images per step from the same fresh
permutation per epoch, SGD with momentum 0.9 on the averaged update. The learning rate is
constant, so a run of `--steps` steps holds the runs of every shorter length as its prefixes:
the accuracy at each of `--report` steps is that of a run that long.

Each step, every simulated rank computes its gradient (torch autograd, float32, taken to
float64); then, per
gradient bucket (the buckets md.DataParallel makes for this model with its default 25 MB), a
variant turns the ranks' gradients into the update:

- `none`: the average of the gradients.
- `topk:<fraction>`: each rank adds its residual to its gradient, keeps the ceil(fraction * n)
  elements largest in magnitude (np.argpartition) and sends them; its residual is the rest; the
  update is the sum of what the ranks sent over the rank count, applied in float32 (what md.DataParallel's
  `compression="topk:<fraction>"` computes, in float64 NumPy).
- `dgc:<fraction>`: Deep Gradient Compression's (Lin et al., 2018) momentum correction and
  momentum factor masking with a warm-up of the density (ranks accumulate momentum locally,
  u = 0.9 u + g, v = v + u; send the top k of v; zero u and v where sent; plain SGD on the
  average; the density 25%, 6.25%, 1.5625% in the first three epochs, then `fraction`). Not one
  of mpidist's compressors: shown for what it changes.

Prints a Markdown table and writes PATH.json (every evaluation) when --output is given: per
variant, the test accuracy at each `--report` step, the first step (evaluated every
`--eval-every` steps) at which it reached `--target` and the last at which it was below, the
best accuracy, and how many of the elements had been sent at least once (by any rank) by each
`--report` step.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time

import numpy as np
import torch

MOMENTUM = 0.9
DGC_WARMUP_DENSITIES = (0.25, 0.0625, 0.015625)  # per epoch, as in the DGC paper's warm-up


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", default="none,topk:0.01,topk:0.05,topk:0.1,dgc:0.01")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=2560)
    parser.add_argument("--batch", type=int, default=32, help="images per rank per step")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--eval-every", type=int, default=3)
    parser.add_argument("--target", type=float, default=0.95)
    parser.add_argument("--report", default="60,200,500", help="steps at which to report the accuracy")
    parser.add_argument("--output", default=None, help="path of the .json results, without the suffix")
    args = parser.parse_args(argv)
    args.report_steps = [int(s) for s in args.report.split(",")]
    for variant in args.variants.split(","):
        name, _, fraction = variant.partition(":")
        if name == "none" and not fraction:
            continue
        if name not in ("topk", "dgc") or not _fraction_ok(fraction):
            parser.error(f"variant {variant!r}: give none, topk:<fraction> or dgc:<fraction>, fraction in (0, 1]")
    if min(args.ranks, args.hidden, args.batch, args.steps, args.eval_every) < 1:
        parser.error("--ranks, --hidden, --batch, --steps and --eval-every must be >= 1")
    return args


def _fraction_ok(text):
    try:
        return 0 < float(text) <= 1
    except ValueError:
        return False


def load_digits():
    import h5py

    from mpidist.data import ensure_digits
    with h5py.File(ensure_digits(), "r") as f:
        return [torch.from_numpy(f[f"{split}/{part}"][:]) for split in ("train", "test") for part in ("x", "y")]


def make_model(hidden):
    torch.manual_seed(0)  # benchmarks/compression.py's initial weights
    return torch.nn.Sequential(torch.nn.Linear(64, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, hidden),
                               torch.nn.ReLU(), torch.nn.Linear(hidden, 10))


def bucket_layout(params):
    """The parameters of each gradient bucket md.DataParallel makes (bucket_mb=25), which the
    compression runs on one at a time."""
    from mpidist.parallel.reducer import GradientBuckets
    return [bucket.params for bucket in GradientBuckets._automatic_buckets(params, 25 * 1024 * 1024, None)]


def top_k(values, k):
    """Indices of the k elements of `values` largest in magnitude."""
    return np.argpartition(np.abs(values), values.size - k)[values.size - k:]


class TopKReference:
    """Top-k with error feedback for one bucket over every rank, in float64 NumPy."""

    def __init__(self, ranks, numel, fraction):
        self.k = max(1, math.ceil(fraction * numel))
        self.residual = np.zeros((ranks, numel))

    def update(self, grads, step_in_epoch, epoch):
        total = np.zeros(grads.shape[1])
        sent = np.zeros(grads.shape[1], dtype=bool)
        for rank, grad in enumerate(grads):
            accumulated = grad + self.residual[rank]
            indices = top_k(accumulated, self.k)
            total[indices] += accumulated[indices]
            self.residual[rank] = accumulated
            self.residual[rank, indices] = 0
            sent[indices] = True
        return total / len(grads), sent


class DGCReference:
    """DGC's momentum correction, momentum factor masking and density warm-up for one bucket."""

    def __init__(self, ranks, numel, fraction):
        self.numel, self.fraction = numel, fraction
        self.momentum = np.zeros((ranks, numel))
        self.accumulated = np.zeros((ranks, numel))

    def update(self, grads, step_in_epoch, epoch):
        density = max(self.fraction, DGC_WARMUP_DENSITIES[epoch]) if epoch < len(DGC_WARMUP_DENSITIES) \
            else self.fraction
        k = max(1, math.ceil(density * self.numel))
        total = np.zeros(grads.shape[1])
        sent = np.zeros(grads.shape[1], dtype=bool)
        for rank, grad in enumerate(grads):
            self.momentum[rank] = MOMENTUM * self.momentum[rank] + grad
            self.accumulated[rank] += self.momentum[rank]
            indices = top_k(self.accumulated[rank], k)
            total[indices] += self.accumulated[rank, indices]
            self.accumulated[rank, indices] = 0
            self.momentum[rank, indices] = 0
            sent[indices] = True
        return total / len(grads), sent


def run(variant, data, args) -> dict:
    x_train, y_train, x_test, y_test = data
    model = make_model(args.hidden)
    params = list(model.parameters())
    buckets = bucket_layout(params)
    name, _, fraction = variant.partition(":")
    sizes = [sum(p.numel() for p in bucket) for bucket in buckets]
    references = [None if name == "none" else (TopKReference if name == "topk" else DGCReference)(
        args.ranks, numel, float(fraction)) for numel in sizes]
    # DGC's momentum is in its accumulation: plain SGD on the average.
    optimizer = torch.optim.SGD(params, lr=args.lr, momentum=0.0 if name == "dgc" else MOMENTUM)
    ever_sent = [np.zeros(numel, dtype=bool) for numel in sizes]
    per_step = args.batch * args.ranks
    steps_per_epoch = max(1, len(x_train) // per_step)
    history, reached, sent_by = [], None, {}
    started = time.perf_counter()
    for step in range(args.steps):
        epoch, position = divmod(step, steps_per_epoch)
        order = torch.randperm(len(x_train), generator=torch.Generator().manual_seed(epoch))
        grads = [np.empty((args.ranks, numel)) for numel in sizes]
        for rank in range(args.ranks):
            rows = order[position * per_step + rank * args.batch:][:args.batch]
            model.zero_grad()
            torch.nn.functional.cross_entropy(model(x_train[rows]), y_train[rows]).backward()
            for index, bucket in enumerate(buckets):
                grads[index][rank] = torch.cat([p.grad.reshape(-1) for p in bucket]).double().numpy()
        for index, bucket in enumerate(buckets):
            if references[index] is None:
                update, sent = grads[index].mean(0), None
            else:
                update, sent = references[index].update(grads[index], position, epoch)
                ever_sent[index] |= sent
            at = 0
            for p in bucket:
                p.grad = torch.from_numpy(update[at:at + p.numel()]).float().view_as(p)
                at += p.numel()
        optimizer.step()
        done = step + 1
        if name != "none" and done in args.report_steps:
            sent_by[done] = sum(int(s.sum()) for s in ever_sent) / sum(sizes)
        if done % args.eval_every and done != args.steps and done not in args.report_steps:
            continue
        with torch.no_grad():
            accuracy = (model(x_test).argmax(1) == y_test).double().mean().item()
        history.append([done, accuracy])
        if reached is None and accuracy >= args.target:
            reached = done
        print(f"topk_convergence: {variant} step {done} accuracy {accuracy:.4f} "
              f"({time.perf_counter() - started:.0f} s)", file=sys.stderr, flush=True)
    accuracy_at = {s: a for s, a in history}
    below = [s for s, a in history if a < args.target]
    return {"variant": variant, "bucket_sizes": sizes, "steps_to_target": reached,
            "last_step_below_target": below[-1] if below else None,
            "accuracy_at": {s: accuracy_at.get(s) for s in args.report_steps},
            "best_accuracy": max(a for _, a in history), "sent_at_least_once": sent_by, "history": history}


def table(rows, args) -> str:
    head = ("| variant | " + " | ".join(f"accuracy at {s}" for s in args.report_steps)
            + f" | first step at >= {100 * args.target:.0f}% | last step below | best | "
            + " | ".join(f"elements ever sent by {s}" for s in args.report_steps) + " |")
    lines = [head, "|---|" + "---:|" * (2 * len(args.report_steps) + 3)]
    for row in rows:
        accuracies = " | ".join("-" if row["accuracy_at"][s] is None else f"{100 * row['accuracy_at'][s]:.1f}%"
                                for s in args.report_steps)
        sent = " | ".join(f"{100 * row['sent_at_least_once'][s]:.1f}%" if s in row["sent_at_least_once"] else "-"
                          for s in args.report_steps)
        lines.append(f"| {row['variant']} | {accuracies} | {row['steps_to_target'] or 'not reached'} | "
                     f"{row['last_step_below_target'] or '-'} | {100 * row['best_accuracy']:.1f}% | {sent} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    data = load_digits()
    rows = []
    for variant in args.variants.split(","):
        rows.append(run(variant, data, args))
        if args.output:
            with open(args.output + ".json", "w") as out:
                json.dump({"command": "python benchmarks/topk_convergence.py " + " ".join(argv or sys.argv[1:]),
                           "rows": rows}, out, indent=1)
    print(table(rows, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
