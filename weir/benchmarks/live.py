"""`weir bench live`: the local fleet under load generators nobody on this team wrote.

Starts a fleet as `weir up` does (Redis, reference engines each with a sidecar, a router)
and drives it with a client from elsewhere: kubernetes-sigs' `inference-perf` (default;
its own Python 3.12 venv, built once into the user's cache) or SGLang's `bench_serving`
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

NAME = "live"
HELP = "The local fleet under inference-perf or bench_serving: router vs engine, same run."

_MODEL = "bench-live"
_CLIENTS = ("inference-perf", "bench-serving")
_SCENARIOS = ("mix", "long-output", "shared-prefix")


def configure(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--client", choices=_CLIENTS, default="inference-perf",
        help="the load generator (bench-serving: SGLang's, from its venv)")  # fmt: skip
    add("--scenario", action="append", choices=_SCENARIOS, dest="scenarios",
        help="run only this scenario (repeatable; default: all)")  # fmt: skip
    add("--engines", type=int, default=1, help="reference engines behind the router")
    add("--requests", type=int, default=40, help="requests per scenario and path")
    add("--rate", type=float, default=4.0, help="requests per second")
    add("--speed-factor", type=float, default=1.0, help="reference engines' simulated speed")
    add("--slo-ttft-ms", type=float, default=500.0, help="goodput's TTFT bound")
    add("--slo-tpot-ms", type=float, default=50.0, help="goodput's time-per-output-token bound")
    add("--json", action="store_true", help="print one JSON object instead of a table")
    add("--runs", type=int, default=1, help="repetitions, each figure their median")


def run(args: argparse.Namespace) -> int:
    from weir.local.fleet import FleetConfig, FleetError, LocalFleet

    if min(args.engines, args.requests, args.runs) < 1 or not (
        args.rate > 0 and args.speed_factor > 0 and args.slo_ttft_ms > 0 and args.slo_tpot_ms > 0
    ):
        raise SystemExit(
            "bad arguments: --engines, --requests and --runs must be at least 1, --rate, "
            "--speed-factor and the SLOs positive"
        )
    client: Client = InferencePerf() if args.client == "inference-perf" else BenchServing()
    names = list(dict.fromkeys(args.scenarios or _SCENARIOS))  # each once, in order
    scenarios = [scenario(name, args.requests, args.rate) for name in names]
    slo = Slo(args.slo_ttft_ms, args.slo_tpot_ms)
    try:
        what = client.prepare()
    except ToolVenvError as exc:
        print(f"weir bench live: {exc}", file=sys.stderr)
        return 1
    config = FleetConfig(
        engines=args.engines, pool="live", model=_MODEL, router_port=0,
        speed_factor=args.speed_factor, tenants=(),
    )  # fmt: skip
    runs = []
    try:
        with LocalFleet(config) as fleet, tempfile.TemporaryDirectory() as scratch:
            tokenizer = write_ascii_tokenizer(Path(scratch) / "tokenizer")
            targets = {"router": fleet.router_url, "direct": fleet.engine_urls[0]}
            for i in range(args.runs):
                todo = jobs(scenarios, targets, fleet.engine_urls, Path(scratch) / f"run-{i}")
                runs.append(client.run(todo, _MODEL, slo, tokenizer))
    except (ClientError, FleetError) as exc:
        print(f"weir bench live: {exc}", file=sys.stderr)
        return 1
    params = {"client": what, "engines": args.engines, "requests": args.requests,
              "rate": args.rate, "speed_factor": args.speed_factor,
              "slo": f"TTFT {args.slo_ttft_ms:g} ms, TPOT {args.slo_tpot_ms:g} ms",
              "runs": args.runs}  # fmt: skip
    rows = _rows(names, runs)
    if args.json:
        rows_json = [asdict(row) for row in rows]
        print(json.dumps({"benchmark": NAME, "params": params, "rows": rows_json}, sort_keys=True))
    else:
        print(_table(params, rows))
    return 0


def scenario(name: str, requests: int, rate: float) -> Scenario:
    """A named workload at this size. Prompt and answer lengths are in tokens (one a
    byte to the reference engine); a shared-prefix run splits its requests over 4 groups."""
    if name == "mix":
        return Scenario(name, requests, rate, (32, 256, 2048), (8, 32, 64))
    if name == "long-output":
        return Scenario(name, requests, rate, (64, 96, 128), (256, 384, 512))
    return Scenario(name, requests, rate, (32, 32, 32), (32, 32, 32),
                    prefix_groups=4, prefix_tokens=1024)  # fmt: skip


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
