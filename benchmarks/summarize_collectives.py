"""Ratios of `mpidist bench allreduce` JSON rows: our algorithms against the peers measured in the same run.

    python benchmarks/summarize_collectives.py benchmarks/results/collectives-cpu-2ranks.json ...

Per rank count, dtype and size: our best algorithm (the fastest of mpidist's own, neither
`auto` nor the peers) against `mpi` and `gloo`, and `auto` against our best. Ratios are of
busbw (higher is better for us), i.e. the inverse ratio of times.
"""
import json
import sys

PEERS = ("mpi", "gloo")


def summarize(rows):
    cases = {}
    for row in rows:
        cases.setdefault((row["ranks"], row["dtype"], row["bytes"]), {})[row["algorithm"]] = row["time_us"]
    lines = ["| ranks | dtype | bytes | best (ours) | best/mpi | auto/best | best/gloo | auto time / mpi time |",
             "|---:|---|---:|---|---:|---:|---:|---:|"]
    for (ranks, dtype, nbytes), times in sorted(cases.items()):
        ours = {name: t for name, t in times.items() if name not in PEERS and name != "auto"}
        best_name = min(ours, key=ours.get)
        best = ours[best_name]
        mpi, gloo, auto = times.get("mpi"), times.get("gloo"), times.get("auto")
        lines.append("| {} | {} | {} | {} | {} | {} | {} | {} |".format(
            ranks, dtype, nbytes, best_name,
            f"{mpi / best:.2f}" if mpi else "-",
            f"{best / auto:.2f}" if auto else "-",
            f"{gloo / best:.2f}" if gloo else "-",
            f"{auto / mpi:.2f}" if auto and mpi else "-"))
    return "\n".join(lines)


if __name__ == "__main__":
    rows = [row for path in sys.argv[1:] for row in json.load(open(path))]
    print(summarize(rows))
