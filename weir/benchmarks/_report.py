"""Shared shape of every benchmark's output: figures with units and goals, summarised over
several runs as median and p99, printed as a table or as one JSON object."""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field


@dataclass(frozen=True, slots=True)
class Figure:
    name: str
    value: float
    unit: str
    p99: float | None = None
    goal: str = ""
    met: bool | None = None
    note: str = ""


@dataclass
class Report:
    benchmark: str
    figures: list[Figure] = field(default_factory=list)
    params: dict[str, object] = field(default_factory=dict)

    def add(self, figure: Figure) -> Figure:
        self.figures.append(figure)
        return figure

    def to_json(self) -> str:
        return json.dumps(
            {
                "benchmark": self.benchmark,
                "machine": {
                    "python": platform.python_version(),
                    "cpu": platform.processor() or platform.machine(),
                },
                "params": self.params,
                "figures": [asdict(f) for f in self.figures],
            },
            sort_keys=True,
        )

    def to_table(self) -> str:
        rows = [("figure", "median", "p99", "unit", "goal", "met")]
        for f in self.figures:
            met = "" if f.met is None else ("yes" if f.met else "NO")
            rows.append(
                (f.name, fmt(f.value), "" if f.p99 is None else fmt(f.p99), f.unit, f.goal, met)
            )
        lines = [heading(self.benchmark, self.params), *aligned(rows)]
        lines.extend(f"   note: {f.name}: {f.note}" for f in self.figures if f.note)
        return "\n".join(lines)

    def emit(self, as_json: bool) -> None:
        sys.stdout.write((self.to_json() if as_json else self.to_table()) + "\n")
        sys.stdout.flush()


def heading(benchmark: str, params: dict[str, object]) -> str:
    line = f"== weir bench {benchmark} =="
    return line + ("\n   " + " ".join(f"{k}={v}" for k, v in params.items()) if params else "")


def aligned(rows: Sequence[Sequence[str]]) -> list[str]:
    """Rows as left-aligned columns, the first a header underlined with dashes."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for i, row in enumerate(rows):
        lines.append("  ".join(cell.ljust(widths[j]) for j, cell in enumerate(row)).rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    return lines


def fmt(value: float) -> str:
    if value == 0 or math.isnan(value):
        return f"{value:g}"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    if abs(value) >= 1:
        return f"{value:.2f}"
    return f"{value:.3g}"


def median_p99(samples: Sequence[float]) -> tuple[float, float]:
    """Median and 99th percentile (nearest rank) of a non-empty sample."""
    if not samples:
        raise ValueError("no samples")
    ordered = sorted(samples)
    rank = max(0, math.ceil(0.99 * len(ordered)) - 1)
    return statistics.median(ordered), ordered[rank]


def add_output_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--json", action="store_true", help="print one JSON object instead of a table"
    )
    parser.add_argument(
        "--runs", type=int, default=5, help="repetitions summarised as median and p99"
    )
