"""The `mpidist` command (`mpidist ...`, `python -m mpidist.cli ...`): info, bench, tune, train and
prepare-data, built on the library's public API alone (the public modules and the names of their
__all__: docs/architecture.md). The library never imports it (tests/test_layering.py checks both).

    command.py       the argument parser and the dispatch to each subcommand
    info.py          mpidist info's facts
    bench.py         mpidist bench: collective micro-benchmarks (bench_bound.py: the one-node bound;
                     bench_device.py: the --device cuda routes; bench_plot.py: --plot)
    tune.py          mpidist tune: auto's decision table from bench's measurements
    train.py         mpidist train: its one loop and the data and ddp modes (training.py: what a mode
                     plugs into the loop; train_ps.py, train_pipeline.py: those modes' parts;
                     sparse_workload.py: the click model; stopping.py: the stop on a signal)
"""
from .command import build_parser, main

__all__ = ["build_parser", "main"]
