"""The `dramaturg` console script.

    dramaturg checkpoint make --preset tiny OUT [--seed N]
    dramaturg checkpoint inspect DIR
    dramaturg up [--checkpoint DIR] [--device cpu|cuda] [--port P]
    dramaturg say TEXT -o out.wav [--voice V] [--format F] [--url U]

Each command group adds itself to the parser in its own `add_*_commands(subparsers)` function and
sets `func` (args -> exit code) on its leaf parsers; `main` only parses and dispatches. To add a
command group (`up`, `say`), write its `add_*_commands` and call it in `build_parser`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dramaturg", description="Drama 3 TTS serving system")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    add_checkpoint_commands(commands)
    # The local stack lives in services.launcher (process supervision, readiness, the tiny default).
    from services.launcher import add_say_parser, add_up_parser
    add_up_parser(commands)
    add_say_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


# --------------------------------------------------------------------------------------------
# dramaturg checkpoint make | inspect
# --------------------------------------------------------------------------------------------

def add_checkpoint_commands(commands) -> None:
    group = commands.add_parser("checkpoint", help="make or inspect a checkpoint directory")
    actions = group.add_subparsers(dest="action", metavar="ACTION", required=True)

    make = actions.add_parser("make", help="write a random-weight checkpoint (MODEL.md §10.2)")
    make.add_argument("out", metavar="OUT", help="output directory (created if needed)")
    make.add_argument("--preset", choices=("tiny", "full"), default="tiny",
                      help="tiny: CI-sized (MB); full: real geometry (~40 GB)")
    make.add_argument("--seed", type=int, default=0, help="same seed, same bytes (default 0)")
    make.add_argument("--dry-run", action="store_true",
                      help="write config.json and tokenizer.json, print the shard plan, no tensors")
    make.add_argument("--no-progress", action="store_true", help="no progress lines")
    make.add_argument("--workers", type=int, default=None,
                      help="processes writing shards at once (default: one per core above 256 MiB)")
    make.set_defaults(func=_checkpoint_make)

    inspect = actions.add_parser("inspect", help="validate a checkpoint and summarise it per stage")
    inspect.add_argument("directory", metavar="DIR")
    inspect.set_defaults(func=_checkpoint_inspect)


def _checkpoint_make(args: argparse.Namespace) -> int:
    from services.common.make_checkpoint import DiskSpaceError, make_checkpoint

    try:
        out = make_checkpoint(args.out, preset=args.preset, seed=args.seed, progress=not args.no_progress,
                              dry_run=args.dry_run, workers=args.workers)
    except DiskSpaceError as exc:
        print(f"not written: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {args.preset} checkpoint (seed {args.seed}) to {out}")
    return 0


def _checkpoint_inspect(args: argparse.Namespace) -> int:
    from services.common.checkpoint_report import format_report, inspect_checkpoint

    report = inspect_checkpoint(args.directory)
    print(format_report(report), file=sys.stdout if report.ok else sys.stderr)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
