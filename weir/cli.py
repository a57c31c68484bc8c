"""The `weir` command line.

Each subcommand lives in its own module under `weir.commands` (and each benchmark under
`weir.benchmarks`), found by discovery. A command module defines:

    NAME: str                     the subcommand's name
    HELP: str                     one line for `weir --help`
    def configure(parser) -> None add its arguments
    def run(args) -> int          do the work; heavy imports go here, not at module level

`run` may raise `argparse.ArgumentError` for a value that parses but is refused later (a
setting out of range): it is reported as argparse reports a bad flag, usage and exit 2.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import cast

import weir.benchmarks
import weir.commands

Runner = Callable[[argparse.Namespace], int]


def _modules(package: ModuleType) -> list[ModuleType]:
    found = []
    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        if hasattr(module, "NAME") and hasattr(module, "run"):
            found.append(module)
    return found


def _add(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser], module: ModuleType
) -> None:
    parser = subparsers.add_parser(module.NAME, help=module.HELP, description=module.HELP)
    module.configure(parser)
    parser.set_defaults(_run=module.run, _parser=parser)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="weir", description="Weir: a control plane for LLM inference fleets."
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in _modules(weir.commands):
        _add(subparsers, module)
    bench = subparsers.add_parser("bench", help="Run a benchmark and print its figures.")
    bench_sub = bench.add_subparsers(dest="benchmark", required=True, metavar="BENCHMARK")
    for module in _modules(weir.benchmarks):
        _add(bench_sub, module)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # for a command that re-runs itself
    runner = cast(Runner, args._run)
    try:
        return runner(args)
    except argparse.ArgumentError as exc:
        cast(argparse.ArgumentParser, args._parser).error(str(exc))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
