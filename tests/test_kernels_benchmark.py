"""benchmarks/kernels.py, run as users run it on a tiny size list: the JSON rows are complete and
consistent (no timing assertions), and its paired-ratio statistic is right."""
import json
import os
import random
import sys

from conftest import REPO, run_python

sys.path.insert(0, os.path.join(REPO, "benchmarks"))
from kernels import paired_ratio  # noqa: E402

KEYS = {"kernel", "dtype", "isa", "bytes", "gbs", "library_gbs", "copy_gbs", "vs_library", "vs_library_low",
        "vs_library_high"}


def test_paired_ratio_takes_the_median_of_same_round_ratios():
    # Round by round ours is 2x faster although the rounds drift tenfold: the pairing removes it.
    ours = [1.0, 10.0, 3.0, 7.0, 5.0]
    theirs = [2 * t for t in ours]
    assert paired_ratio(theirs, ours) == (2.0, 2.0, 2.0)
    ratio, low, high = paired_ratio([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0], [1.0] * 7)
    assert ratio == 4.0 and low <= ratio <= high


def test_paired_ratio_interval_covers_the_true_median_about_95_percent_of_the_time():
    rng = random.Random(7)
    trials, covered = 1000, 0
    for _ in range(trials):
        theirs = [rng.lognormvariate(0.0, 0.2) for _ in range(40)]  # true median ratio: 1
        _, low, high = paired_ratio(theirs, [1.0] * 40)
        covered += low <= 1.0 <= high
    assert 0.92 <= covered / trials <= 0.99


def test_kernels_benchmark_rows(tmp_path):
    out, png = tmp_path / "k.json", tmp_path / "k.png"
    script = os.path.join(REPO, "benchmarks", "kernels.py")
    code = (f"import sys, runpy; sys.path.insert(0, {REPO!r}); sys.argv = [{script!r}, '--sizes', '4K', '64K', "
            f"'--dtypes', 'float32', 'bfloat16', 'int32', '--reps', '3', '--isa', 'baseline', '--json', {str(out)!r}, "
            f"'--plot', {str(png)!r}]; runpy.run_path({script!r}, run_name='__main__')")
    result = run_python(code, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = json.loads(out.read_text())
    assert png.stat().st_size > 0
    kernels = {(row["kernel"], row["dtype"], row["bytes"]) for row in rows}
    for nbytes in (4096, 65536):
        for dtype in ("float32", "bfloat16", "int32"):
            assert ("reduce", dtype, nbytes) in kernels and ("reduce_many4", dtype, nbytes) in kernels
        for name in ("reduce_scale", "scale", "reduce_many_to"):
            assert (name, "float32", nbytes) in kernels and (name, "int32", nbytes) not in kernels
        assert ("pack", "float32", nbytes) in kernels and ("cast", "float32->bfloat16", nbytes) in kernels
    for row in rows:
        assert set(row) == KEYS and row["isa"] == "baseline", row  # --isa ran the baseline loops
        assert row["gbs"] > 0 and row["library_gbs"] > 0 and row["copy_gbs"] > 0
        assert row["vs_library_low"] <= row["vs_library"] <= row["vs_library_high"]
