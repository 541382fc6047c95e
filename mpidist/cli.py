"""The `mpidist` command: info (and the tools added beside it)."""
from __future__ import annotations

import argparse
import json
import sys


def cmd_info(args) -> int:
    import mpidist as md
    from .info import collect, format_report

    comm = md.init()
    facts = collect(comm)
    if comm.rank == 0:
        print(json.dumps(facts, indent=2) if args.json else format_report(facts), flush=True)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mpidist", description="MPI-based HPC training for PyTorch")
    sub = parser.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="versions, MPI library, CUDA support, ranks and nodes")
    info.add_argument("--json", action="store_true", help="print the facts as JSON")
    info.set_defaults(run=cmd_info)
    from .data import add_prepare_data_command
    from .train import add_train_command
    add_train_command(sub)
    add_prepare_data_command(sub)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except Exception as exc:
        from .errors import MpidistError
        if isinstance(exc, MpidistError):
            print(f"mpidist: error: {exc}", file=sys.stderr, flush=True)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
