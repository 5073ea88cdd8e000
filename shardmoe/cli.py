"""The `shardmoe` command line: `shardmoe train | sample | check | bench | trace | simulate`.

Each subcommand lives in the module that owns its concept; that module exposes
`add_arguments(parser)` and `run(args) -> int` (the exit code), and imports its
heavy dependencies (matplotlib, transformers) inside `run`, so building the parser
stays cheap. A module may also expose `check_arguments(args)`, run before `run`: it raises
ValueError naming the option, the expected and the actual value, which is printed as one line
`shardmoe COMMAND: message` with exit code 2, before any work (argparse's own refusals exit 2 too;
an option the command does not know gets that command's usage, not the top level's).
"""
from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help)
COMMANDS = {
    "train": ("shardmoe.train.command", "train the sharded MoE transformer (the main job)"),
    "sample": ("shardmoe.train.sample_command", "continue prompts with a trained run's model"),
    "check": ("shardmoe.check.command", "check the MoE layer's gradients against float64 references"),
    "bench": ("shardmoe.tools.bench", "benchmark the MoE layer against its anchors"),
    "trace": ("shardmoe.tasks.command", "run the tile-task schedule and export its trace"),
    "simulate": ("shardmoe.simulate.command", "simulate the tile schedule vs bulk-synchronous EP from 8 to 1024 GPUs"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shardmoe", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module_name, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module_name, _parser=p)
        importlib.import_module(module_name).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    args, unknown = build_parser().parse_known_args(argv)
    if unknown:  # argparse would report them with the top-level usage, which lists no command's options
        args._parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    module = importlib.import_module(args._module)
    check = getattr(module, "check_arguments", None)
    if check is not None:
        try:
            check(args)
        except ValueError as err:
            print(f"shardmoe {args.command}: {err}", file=sys.stderr)
            return 2
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
