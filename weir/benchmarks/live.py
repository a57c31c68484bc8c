"""`weir bench live`: the local fleet under load generators nobody on this team wrote.

Starts a fleet as `weir up` does (Redis, engines each with a sidecar, a router) and drives
it with a client from elsewhere: kubernetes-sigs' `inference-perf` (default; its own
Python 3.12 venv, built once into the user's cache) or SGLang's `bench_serving`
(from the SGLang venv `scripts/sglang_env.py` installs). Every scenario runs twice in the
same fleet, one after the other: through the router (router → sidecar → engine, Weir's
whole request path) and straight to the first engine. With the default single engine both
have the same capacity, so the difference is what Weir's path costs; with `--engines N`
the router spreads the load over N engines and the direct column still sees one. Both
paths get the same prompts (the tools' seeds are fixed), so every engine's prefix cache is
flushed before each run.

Scenarios: a short/long mix (lognormal prompts, mostly short, some long), long outputs,
and shared prefixes (groups of prompts behind one long system prompt). Reported per
scenario and path, from the tool's own report: requests and errors, goodput (the share of
requests within the SLO, `--slo-ttft-ms` and `--slo-tpot-ms`), TTFT and ITL p50/p99,
output and total token throughput, and whether the tool's own count of the output tokens
agrees with the engine's `usage`.

The engines are reference engines (default) or, with `--engine sglang-0.5.23`, SGLang's
own server on this machine's CPU serving the tiny model, launched as the SGLang test tier
launches it (`weir.local.sglang_cpu`; `scripts/sglang_env.py` installs both). The CPU
server is slow and its KV pool small (4,096 tokens), so that engine gets its own smaller
defaults (requests, rate, and every prompt and answer half as long), and the clients count
tokens with the model's own tokenizer rather than the ASCII one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from weir.benchmarks._live_clients import (
    BenchServing,
    Client,
    ClientError,
    InferencePerf,
    Result,
    Scenario,
    Slo,
    jobs,
    write_ascii_tokenizer,
)
from weir.benchmarks._report import aligned, fmt, heading
from weir.benchmarks._tool_venv import ToolVenvError
from weir.local import sglang_cpu

if TYPE_CHECKING:
    from weir.local.fleet import FleetConfig

NAME = "live"
HELP = "The local fleet under inference-perf or bench_serving: router vs engine, same run."

_MODEL = "bench-live"
_CLIENTS = ("inference-perf", "bench-serving")
_SCENARIOS = ("mix", "long-output", "shared-prefix")
# SGLang 0.5.5 is left out: in its one try here its sidecar asked for the server info
# 2 s after the server came up and had no answer in 300 s (docs/benchmarks.md).
_ENGINES = ("reference", "sglang-0.5.23")


@dataclass(frozen=True, slots=True)
class Sizing:
    """An engine's defaults: requests per scenario and path, their rate, and the divisor of
    every prompt and answer length."""

    requests: int
    rate: float
    shrink: int


# SGLang on the CPU: 16 requests at 1 per second, lengths halved, keep a run of the three
# scenarios to minutes; on two cores shared with other jobs it took about 7 with the
# server's start (docs/benchmarks.md).
_SIZING = {"reference": Sizing(40, 4.0, 1), "sglang": Sizing(16, 1.0, 2)}


def configure(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--client", choices=_CLIENTS, default="inference-perf",
        help="the load generator (bench-serving: SGLang's, from its venv)")  # fmt: skip
    add("--scenario", action="append", choices=_SCENARIOS, dest="scenarios",
        help="run only this scenario (repeatable; default: all)")  # fmt: skip
    add("--engine", choices=_ENGINES, default="reference",
        help="the engines: reference engines, or SGLang's own server (that version, from "
             "scripts/sglang_env.py) on the CPU with the tiny model; slow: with its own "
             "defaults a run of the three scenarios takes minutes (about 7 on two busy "
             "cores)")  # fmt: skip
    add("--engines", type=int, default=1, help="engines behind the router")
    add("--requests", type=int,
        help="requests per scenario and path (default: 40; SGLang on the CPU: 16)")  # fmt: skip
    add("--rate", type=float,
        help="requests per second (default: 4; SGLang on the CPU: 1)")  # fmt: skip
    add("--speed-factor", type=float,
        help="reference engines' simulated speed (default: 1, an H200's)")  # fmt: skip
    add("--slo-ttft-ms", type=float, default=500.0, help="goodput's TTFT bound")
    add("--slo-tpot-ms", type=float, default=50.0, help="goodput's time-per-output-token bound")
    add("--json", action="store_true", help="print one JSON object instead of a table")
    add("--runs", type=int, default=1, help="repetitions, each figure their median")


def run(args: argparse.Namespace) -> int:
    from weir.local.fleet import FleetError, LocalFleet
    from weir.local.sglang import SGLangStartError

    sglang = args.engine != "reference"
    sizing = _SIZING["sglang" if sglang else "reference"]
    requests = sizing.requests if args.requests is None else args.requests
    rate = sizing.rate if args.rate is None else args.rate
    if min(args.engines, requests, args.runs) < 1 or not (
        rate > 0 and args.slo_ttft_ms > 0 and args.slo_tpot_ms > 0
        and (args.speed_factor is None or args.speed_factor > 0)
    ):  # fmt: skip
        raise SystemExit(
            "bad arguments: --engines, --requests and --runs must be at least 1, --rate, "
            "--speed-factor and the SLOs positive"
        )
    if sglang and args.speed_factor is not None:
        raise SystemExit("bad arguments: --speed-factor sets reference engines' speed only")
    client: Client = InferencePerf() if args.client == "inference-perf" else BenchServing()
    names = list(dict.fromkeys(args.scenarios or _SCENARIOS))  # each once, in order
    scenarios = [scenario(name, requests, rate, sizing.shrink) for name in names]
    slo = Slo(args.slo_ttft_ms, args.slo_tpot_ms)
    try:
        what = client.prepare()
        fleet_config, engine, tokenizer = _engines(args)
    except ToolVenvError as exc:
        print(f"weir bench live: {exc}", file=sys.stderr)
        return 1
    runs = []
    try:
        with LocalFleet(fleet_config) as fleet, tempfile.TemporaryDirectory() as scratch:
            tokens = tokenizer or write_ascii_tokenizer(Path(scratch) / "tokenizer")
            targets = {"router": fleet.router_url, "direct": fleet.engine_urls[0]}
            for i in range(args.runs):
                todo = jobs(scenarios, targets, fleet.engine_urls, Path(scratch) / f"run-{i}")
                runs.append(client.run(todo, fleet.model, slo, tokens))
    except (ClientError, FleetError, SGLangStartError) as exc:
        print(f"weir bench live: {exc}", file=sys.stderr)
        return 1
    params = {"client": what, "engine": engine, "engines": args.engines,
              "requests": requests, "rate": rate,
              "slo": f"TTFT {args.slo_ttft_ms:g} ms, TPOT {args.slo_tpot_ms:g} ms",
              "runs": args.runs}  # fmt: skip
    rows = _rows(names, runs)
    if args.json:
        rows_json = [asdict(row) for row in rows]
        print(json.dumps({"benchmark": NAME, "params": params, "rows": rows_json}, sort_keys=True))
    else:
        print(_table(params, rows))
    return 0


def _engines(args: argparse.Namespace) -> tuple[FleetConfig, str, Path | None]:
    """The fleet to start, a line saying what its engines are, and the tokenizer the
    clients count with (None: the ASCII one, written per run). Raises ToolVenvError where
    the SGLang version or the tiny model is not installed."""
    from weir.local.fleet import FleetConfig

    if args.engine == "reference":
        speed = 1.0 if args.speed_factor is None else args.speed_factor
        config = FleetConfig(
            engines=args.engines, pool="live", model=_MODEL, router_port=0,
            speed_factor=speed, tenants=(),
        )  # fmt: skip
        return config, f"reference (speed factor {speed:g})", None
    version = args.engine.removeprefix("sglang-")
    reason = sglang_cpu.unavailable_reason(version)
    if reason is not None:
        raise ToolVenvError(reason)
    model = sglang_cpu.model_dir()
    config = FleetConfig(
        engines=args.engines, pool="live", router_port=0, engine="sglang",
        model_path=str(model), sglang_python=str(sglang_cpu.venv_python(version)),
        engine_args=tuple(sglang_cpu.cpu_flags(version)),
        engine_env=tuple(sglang_cpu.cpu_environment().items()),
        startup_timeout_s=300.0, tenants=(),
    )  # fmt: skip
    return config, f"SGLang {version} on the CPU ({model.name})", model


def scenario(name: str, requests: int, rate: float, shrink: int) -> Scenario:
    """A named workload at this size, every length divided by `shrink`. Prompt and answer
    lengths are in tokens (one a byte to the reference engine); a shared-prefix run splits
    its requests over 4 groups."""

    def tokens(*lengths: int) -> tuple[int, int, int]:
        low, mean, high = (length // shrink for length in lengths)
        return low, mean, high

    if name == "mix":
        return Scenario(name, requests, rate, tokens(32, 256, 2048), tokens(8, 32, 64))
    if name == "long-output":
        return Scenario(name, requests, rate, tokens(64, 96, 128), tokens(256, 384, 512))
    return Scenario(name, requests, rate, tokens(32, 32, 32), tokens(32, 32, 32),
                    prefix_groups=4, prefix_tokens=1024 // shrink)  # fmt: skip


# (figure, unit, how to read it from a Result)
_FIGURES: tuple[tuple[str, str, Callable[[Result], float]], ...] = (
    ("requests", "", lambda r: r.requests),
    ("errors", "", lambda r: r.errors),
    ("goodput (within SLO)", "%", lambda r: r.goodput_pct),
    ("TTFT p50", "ms", lambda r: r.ttft_ms[0]),
    ("TTFT p99", "ms", lambda r: r.ttft_ms[1]),
    ("ITL p50", "ms", lambda r: r.itl_ms[0]),
    ("ITL p99", "ms", lambda r: r.itl_ms[1]),
    ("output throughput", "tok/s", lambda r: r.output_tok_s),
    ("total throughput", "tok/s", lambda r: r.total_tok_s),
    ("tool's output count vs usage (gap)", "", lambda r: r.count_gap),
)


@dataclass(frozen=True, slots=True)
class Row:
    scenario: str
    figure: str
    unit: str
    router: float
    direct: float


def _rows(names: list[str], runs: list[dict[tuple[str, str], Result]]) -> list[Row]:
    """One row per scenario and figure, each path's value the median over the runs."""
    return [
        Row(name, figure, unit,
            statistics.median(read(run[name, "router"]) for run in runs),
            statistics.median(read(run[name, "direct"]) for run in runs))
        for name in names
        for figure, unit, read in _FIGURES
    ]  # fmt: skip


def _table(params: dict[str, object], rows: list[Row]) -> str:
    cells = [("scenario", "figure", "router", "direct", "unit")]
    cells += [(r.scenario, r.figure, fmt(r.router), fmt(r.direct), r.unit) for r in rows]
    return "\n".join([heading(NAME, params), *aligned(cells)])
