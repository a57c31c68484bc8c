"""The command-line flags of a launch of SGLang's own server, shared by the commands that
start one (`weir up --engine sglang`, `weir bench sidecar --engine sglang`). Kept apart
from `weir.local.sglang`, which imports aiohttp, so that configuring a parser stays light."""

from __future__ import annotations

import argparse


def add_sglang_flags(
    parser: argparse.ArgumentParser, *, startup_timeout_s: float, startup_help: str
) -> None:
    """Add `--sglang-python`, `--engine-arg` (repeatable, into `engine_args`) and
    `--startup-timeout-s`, whose default and help are the command's: what it times differs
    (SGLang's server alone, or every part of a fleet)."""
    add = parser.add_argument
    add("--sglang-python", default="",
        help="with --engine sglang: the Python that has SGLang (default: this one)")  # fmt: skip
    add("--engine-arg", action="append", default=[], dest="engine_args", metavar="ARG",
        help="with --engine sglang: a launch flag added to Weir's (repeatable), e.g. "
             "--engine-arg=--device=cpu")  # fmt: skip
    add("--startup-timeout-s", type=float, default=startup_timeout_s, help=startup_help)
