"""The report as markdown: one table per scenario, the goals, the load sweep."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from fleetsim.report.matrix import Cell

_COLUMNS = (
    ("policy", lambda s: s["policy"]),
    ("offered rps", lambda s: _f(s["offered_rps"])),
    ("accepted", lambda s: str(s["accepted"])),
    ("rejected", lambda s: str(s["rejected"])),
    ("lost", lambda s: str(s["lost"])),
    ("open at end", lambda s: str(s["open_at_end"])),
    ("goodput req/s", lambda s: _f(s["goodput_rps"])),
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
)


def scenario_table(cells: Sequence[Cell]) -> str:
    header = "| " + " | ".join(name for name, _ in _COLUMNS) + " |"
    rule = "|" + "|".join("---" for _ in _COLUMNS) + "|"
    rows = ["| " + " | ".join(get(c.summary) for _, get in _COLUMNS) + " |" for c in cells]
    return "\n".join([header, rule, *rows])


def goals_table(rows: Sequence[dict[str, Any]]) -> str:
    lines = [
        "| scenario | load | goodput ×best (≥1.5) | short TTFT p99 ×best (≤0.5) "
        "| KV exhaustion (0) | low-pri in max wait (100%) | lost (0) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['scenario']} | {r['load']:.2f} "
            f"| {_f(r['goodput_ratio'])} vs {r['goodput_best_baseline']} {_ok(r['goodput_goal_met'])} "
            f"| {_f(r['short_ttft_p99_ratio'])} vs {r['short_ttft_best_baseline']} "
            f"{_ok(r['short_ttft_goal_met'])} "
            f"| {r['kv_exhaustion_events']} {_ok(r['kv_exhaustion_events'] == 0)} "
            f"| {_pct(r['low_priority_within_max_wait'])} {_ok(r['low_priority_goal_met'])} "
            f"| {r['lost']} {_ok(r['lost'] == 0)} |"
        )
    return "\n".join(lines)


def sweep_table(cells: Sequence[Cell], saturation: dict[str, float]) -> str:
    loads = sorted({c.spec.load for c in cells})
    policies = sorted({c.spec.policy for c in cells})
    by = {(c.spec.policy, c.spec.load): c.summary for c in cells}
    head = "| policy | " + " | ".join(f"{x:.0%} goodput req/s (SLO met)" for x in loads)
    lines = [head + " | saturation |", "|---" * (len(loads) + 2) + "|"]
    for p in policies:
        cells_text = []
        for x in loads:
            s = by.get((p, x))
            cells_text.append(
                "" if s is None else f"{_f(s['goodput_rps'])} ({_pct(s['slo_attainment'])})"
            )
        lines.append(f"| {p} | " + " | ".join(cells_text) + f" | {saturation.get(p, 0):.0%} |")
    return "\n".join(lines)


def _f(value: float) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    if isinstance(value, float) and math.isinf(value):
        return "∞"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    return f"{value:.2f}" if abs(value) >= 1 else f"{value:.3f}"


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


def _ok(met: bool) -> str:
    return "✓" if met else "✗"


def document(
    cells: Sequence[Cell],
    goal_rows: Sequence[dict[str, Any]],
    sweep_cells: Sequence[Cell],
    points: dict[str, float],
    params: dict[str, Any],
) -> str:
    """The whole report: parameters, goals, one table per scenario, the sweep."""
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
    for name in dict.fromkeys(c.spec.scenario for c in cells):
        chosen = [c for c in cells if c.spec.scenario == name]
        lines += [f"## {name}", "", scenario_table(chosen), ""]
    if sweep_cells:
        lines += [
            f"## Load sweep ({sweep_cells[0].spec.scenario})",
            "",
            "Saturation: the highest load at which at least 90% of requests met their SLOs.",
            "",
            sweep_table(sweep_cells, points),
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
