"""The plot of `mpidist bench --plot`: bus bandwidth against message size, a line per algorithm
(the peers dashed), a panel per collective, dtype and rank count of the rows (bench.py)."""
from __future__ import annotations

from .bench import PEERS


def plot(rows, path: str, title: str = "") -> None:
    """busbw against message size, one line per algorithm, one panel per (collective, dtype)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(row["collective"], row["dtype"], row["ranks"]) for row in rows})
    figure, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.8), squeeze=False)
    for axis, (collective, dtype, ranks) in zip(axes[0], panels):
        chosen = [row for row in rows if (row["collective"], row["dtype"], row["ranks"]) == (collective, dtype, ranks)]
        for algorithm in dict.fromkeys(row["algorithm"] for row in chosen):
            points = sorted((row["bytes"], row["busbw_gbs"]) for row in chosen if row["algorithm"] == algorithm)
            style = "--" if algorithm in PEERS else "-"
            axis.plot([x for x, _ in points], [y for _, y in points], style, marker="o", markersize=3,
                      label=algorithm)
        axis.set_xscale("log", base=2)
        axis.set_xlabel("message size (bytes)")
        axis.set_ylabel("busbw (GB/s)")
        axis.set_title(f"{collective} {dtype}, {ranks} ranks")
        axis.grid(True, which="both", alpha=0.3)
        axis.legend(fontsize=8)
    if title:
        figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
