"""The report as markdown: one table per scenario, the goals, the load sweep, and each
policy's capacity at SLO with the load-vs-attainment curve its search measured. Every row
that gives goodput gives the requests refused beside it."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from fleetsim.report.matrix import Cell, requests_per_cpu_s
from fleetsim.report.slo_capacity import LOWEST, TARGET, Capacity, capacity_rows

_COLUMNS = (
    ("policy", lambda s: s["policy"]),
    ("offered rps", lambda s: _f(s["offered_rps"])),
    ("goodput req/s", lambda s: _f(s["goodput_rps"])),
    ("refused", lambda s: _refused(s["rejected"], s["rejected_share"])),
    ("accepted", lambda s: str(s["accepted"])),
    ("lost", lambda s: str(s["lost"])),
    ("open at end", lambda s: str(s["open_at_end"])),
    ("goodput tok/s", lambda s: _f(s["goodput_tokens_per_s"])),
    ("weighted", lambda s: _f(s["goodput_weighted"])),
    ("SLO met", lambda s: _pct(s["slo_attainment"])),
    ("short TTFT p50/p99 s", lambda s: _q(s["short_ttft_s"], "p50", "p99")),
    ("TTFT mean/p90 s", lambda s: _q(s["ttft_s"], "mean", "p90")),
    ("TPOT p50/p99 ms", lambda s: _q(s["tpot_s"], "p50", "p99", 1000)),
    ("E2E p50/p99 s", lambda s: _q(s["e2e_s"], "p50", "p99")),
    ("queue p99 s", lambda s: _f(s["queue_s"]["p99"])),
    ("P/D handoff p50/p99 s", lambda s: _q(s["handoff_s"], "p50", "p99")),
    ("client retries", lambda s: str(s["client_retries"])),
    ("KV ≥ high", lambda s: _pct(s["kv_high_water_share"])),
    ("KV exhausted", lambda s: str(s["kv_exhaustion_events"])),
    ("preemptions", lambda s: _modes(s["preemptions"])),
    ("recomputed tok", lambda s: str(s["recomputed_tokens"])),
    ("cache hit", lambda s: _pct(s["cache_hit_share"])),
    ("low-pri done / in wait", lambda s: _low(s["starvation"])),
    ("max wait s", lambda s: _f(s["starvation"]["max_wait_s"])),
    ("TTFT p99 by input s", lambda s: _buckets(s["ttft_by_input"])),
    ("TPOT p99 by output ms", lambda s: _buckets(s["tpot_by_output"], 1000)),
    ("tenant share", lambda s: _shares(s["tenant_share"])),
    ("tenant SLO met", lambda s: _shares(s["tenant_slo_attainment"])),
    ("Jain's index (KV·s)", lambda s: _f(s["fairness_jain"])),
    ("latency MAPE TTFT/TPOT", lambda s: _mape(s["latency_mape"])),
)


def scenario_table(cells: Sequence[Cell]) -> str:
    header = "| " + " | ".join(name for name, _ in _COLUMNS) + " |"
    rule = "|" + "|".join("---" for _ in _COLUMNS) + "|"
    rows = ["| " + " | ".join(get(c.summary) for _, get in _COLUMNS) + " |" for c in cells]
    return "\n".join([header, rule, *rows])


def speed_table(cells: Sequence[Cell]) -> str:
    """Each cell's simulator speed: requests simulated per CPU-second of its worker."""
    lines = [
        "| scenario | policy | load | seed | requests | CPU s | requests / CPU-s |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in cells:
        spec = c.spec
        lines.append(
            f"| {spec.scenario} | {spec.policy} | {spec.load:.2f} | {spec.seed} "
            f"| {c.summary['offered']} | {c.cpu_s:.1f} | {requests_per_cpu_s(c):,.0f} |"
        )
    return "\n".join(lines)


def goals_table(rows: Sequence[dict[str, Any]]) -> str:
    lines = [
        "| scenario | load | goodput ×best (≥1.5) | refused (Weir / best) "
        "| short TTFT p99 ×best (≤0.5) "
        "| KV exhaustion (0) | low-pri in max wait (100%) | lost (0) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['scenario']} | {r['load']:.2f} "
            f"| {_f(r['goodput_ratio'])} vs {r['goodput_best_baseline']} {_ok(r['goodput_goal_met'])} "
            f"| {r['rejected']} / {r['best_baseline_rejected']} "
            f"| {_f(r['short_ttft_p99_ratio'])} vs {r['short_ttft_best_baseline']} "
            f"{_ok(r['short_ttft_goal_met'])} "
            f"| {r['kv_exhaustion_events']} {_ok(r['kv_exhaustion_events'] == 0)} "
            f"| {_pct(r['low_priority_within_max_wait'])} {_ok(r['low_priority_goal_met'])} "
            f"| {r['lost']} {_ok(r['lost'] == 0)} |"
        )
    return "\n".join(lines)


def sweep_table(cells: Sequence[Cell]) -> str:
    loads = sorted({c.spec.load for c in cells})
    policies = sorted({c.spec.policy for c in cells})
    by = {(c.spec.policy, c.spec.load): c.summary for c in cells}
    head = "| policy | " + " | ".join(f"{x:.0%} goodput req/s (SLO met, refused)" for x in loads)
    lines = [head + " |", "|---" * (len(loads) + 1) + "|"]
    for p in policies:
        cells_text = []
        for x in loads:
            s = by.get((p, x))
            cells_text.append(
                ""
                if s is None
                else f"{_f(s['goodput_rps'])} ({_pct(s['slo_attainment'])}, {s['rejected']})"
            )
        lines.append(f"| {p} | " + " | ".join(cells_text) + " |")
    return "\n".join(lines)


def capacity_table(capacities: Sequence[Capacity]) -> str:
    """Per scenario, each policy's capacity at SLO as a share of the nominal load and, in
    brackets, as a fraction of the oracle's; Weir against the best baseline."""
    policies = list(dict.fromkeys(c.policy for c in capacities))
    head = "| scenario | " + " | ".join(policies) + " | Weir ×best baseline (≥1.5) |"
    lines = [head, "|---" * (len(policies) + 2) + "|"]
    for row in capacity_rows(capacities):
        cells = []
        for p in policies:
            c = row["policies"].get(p)
            cells.append(
                ""
                if c is None
                else f"{_load(c['capacity'], c['limit'])} ({_f(c['oracle_fraction'])})"
            )
        versus = row["weir_vs_best"]
        best = (
            f"{_f(versus)} vs {row['best_baseline']} {_ok(versus >= 1.5)}"
            if row["best_baseline"]
            else "–"
        )
        lines.append(f"| {row['scenario']} | " + " | ".join(cells) + f" | {best} |")
    return "\n".join(lines)


def capacity_curves(capacities: Sequence[Capacity]) -> str:
    """Every load each search ran: SLO attainment, goodput and requests refused."""
    lines = [
        "| scenario | policy | capacity (req/s) | load: SLO met · goodput req/s · refused |",
        "|---|---|---|---|",
    ]
    for c in capacities:
        probes = "; ".join(
            f"{p.load:.0%}: {_pct(p.attainment)} · {_f(p.goodput_rps)} · {p.rejected}"
            for p in c.search.probes
        )
        found = f"{_load(c.search.capacity, c.search.limit)} ({_f(c.capacity_rps)})"
        lines.append(f"| {c.scenario} | {c.policy} | {found} | {probes} |")
    return "\n".join(lines)


def _f(value: float) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    if isinstance(value, float) and math.isinf(value):
        return "∞"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    return f"{value:.2f}" if abs(value) >= 1 else f"{value:.3f}"


def _load(load: float, limit: str) -> str:
    """A capacity as a share of nominal load; at the search's edges, the bound it is."""
    if limit == "below":
        return "<" + f"{LOWEST:.0%}"
    return ("≥" if limit == "above" else "") + f"{load:.0%}"


def _refused(count: int, share: float) -> str:
    return f"{count} ({_pct(share)})" if count else "0"


def _pct(value: float) -> str:
    return "–" if math.isnan(value) else f"{100 * value:.1f}%"


def _q(q: dict[str, float], a: str, b: str, scale: float = 1.0) -> str:
    return f"{_f(q[a] * scale)} / {_f(q[b] * scale)}"


def _modes(modes: dict[str, int]) -> str:
    return ", ".join(f"{m} {n}" for m, n in modes.items()) or "0"


def _low(starvation: dict[str, float]) -> str:
    if not starvation["requests"]:
        return "–"
    return f"{_pct(starvation['completed_share'])} / {_pct(starvation['within_max_wait_share'])}"


def _buckets(by: dict[str, dict[str, float]], scale: float = 1.0) -> str:
    return ", ".join(f"{bucket}: {_f(q['p99'] * scale)}" for bucket, q in by.items()) or "–"


def _shares(shares: dict[str, float]) -> str:
    return ", ".join(f"{t} {_pct(v)}" for t, v in shares.items()) or "–"


def _mape(mape: dict[str, float]) -> str:
    return f"{_pct(mape['ttft'])} / {_pct(mape['tpot'])}" if mape["n"] else "–"


def _ok(met: bool) -> str:
    return "✓" if met else "✗"


def document(
    cells: Sequence[Cell],
    goal_rows: Sequence[dict[str, Any]],
    sweep_cells: Sequence[Cell],
    capacities: Sequence[Capacity],
    params: dict[str, Any],
) -> str:
    """The whole report: parameters, goals, capacity at SLO, one table per scenario, the
    sweep."""
    lines = [
        "# Fleet simulation report",
        "",
        "Parameters: " + ", ".join(f"{k}={v}" for k, v in params.items()),
        "",
        "## Goals (Weir against the best baseline on the same traffic)",
        "",
        goals_table(goal_rows),
        "",
    ]
    if capacities:
        lines += [
            "## Capacity at SLO",
            "",
            "The highest offered load (share of the scenario's nominal capacity) at which "
            f"at least {params.get('capacity_target', TARGET):.0%} of requests met their "
            "SLOs, found by bisection; in brackets, as a fraction of the oracle's "
            "(Weir's orchestration knowing every answer's length and every engine's state).",
            "",
            capacity_table(capacities),
            "",
            "### Load-vs-attainment curves (every load the searches ran)",
            "",
            capacity_curves(capacities),
            "",
        ]
    for name in dict.fromkeys(c.spec.scenario for c in cells):
        chosen = [c for c in cells if c.spec.scenario == name]
        lines += [f"## {name}", "", scenario_table(chosen), ""]
    if sweep_cells:
        lines += [
            f"## Load sweep ({sweep_cells[0].spec.scenario})",
            "",
            sweep_table(sweep_cells),
            "",
        ]
    lines += [
        "## Simulator speed",
        "",
        "Requests simulated per CPU-second of the worker that ran the cell "
        "(`time.process_time`, not wall time).",
        "",
        speed_table(list({id(c): c for c in [*cells, *sweep_cells]}.values())),
        "",
    ]
    return "\n".join(lines)


def json_safe(value: Any) -> Any:
    """NaN and infinities become null: the JSON document stays strict JSON."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value
