"""PNG plots with matplotlib's Agg backend (no display): goodput against offered load,
short-request TTFT CDFs, the fullest engine's KV over time, and SLO attainment against
offered load as the capacity searches measured it."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from fleetsim.report.matrix import Cell
from fleetsim.report.slo_capacity import Capacity


def sweep_plot(cells: Sequence[Cell], path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for policy in sorted({c.spec.policy for c in cells}):
        points = sorted(
            (c.spec.load, c.summary["goodput_rps"]) for c in cells if c.spec.policy == policy
        )
        ax.plot([100 * x for x, _ in points], [y for _, y in points], marker="o", label=policy)
    scenario = cells[0].spec.scenario if cells else ""
    ax.set(
        xlabel="offered load, % of nominal capacity",
        ylabel="goodput, requests/s",
        title=f"goodput vs load ({scenario})",
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)


def _grid(scenarios: list[str]) -> tuple[Any, list[Any]]:
    cols = min(5, max(1, len(scenarios)))
    rows = -(-len(scenarios) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3.2 * rows), squeeze=False)
    flat = [ax for row in axes for ax in row]
    for ax in flat[len(scenarios) :]:
        ax.set_visible(False)
    return fig, flat


def _scenarios(cells: Sequence[Cell]) -> list[str]:
    return list(dict.fromkeys(c.spec.scenario for c in cells))


def ttft_cdf_plot(cells: Sequence[Cell], path: Path) -> Path:
    scenarios = _scenarios(cells)
    fig, axes = _grid(scenarios)
    for name, ax in zip(scenarios, axes, strict=False):
        for cell in (c for c in cells if c.spec.scenario == name):
            values = cell.short_ttft
            if values:
                n = len(values)
                ax.plot(values, [(i + 1) / n for i in range(n)], label=cell.spec.policy)
        ax.set(title=name, xscale="log", xlabel="short-request TTFT, s", ylabel="CDF")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    return _save(fig, path)


def kv_plot(cells: Sequence[Cell], path: Path) -> Path:
    scenarios = _scenarios(cells)
    fig, axes = _grid(scenarios)
    for name, ax in zip(scenarios, axes, strict=False):
        for cell in (c for c in cells if c.spec.scenario == name):
            if cell.kv_max:
                ax.plot(
                    [t for t, _ in cell.kv_max],
                    [u for _, u in cell.kv_max],
                    label=cell.spec.policy,
                    lw=0.8,
                )
        ax.set(title=name, xlabel="time, s", ylabel="fullest engine's KV", ylim=(0, 1.02))
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    return _save(fig, path)


def capacity_plot(capacities: Sequence[Capacity], target: float, path: Path) -> Path:
    scenarios = list(dict.fromkeys(c.scenario for c in capacities))
    fig, axes = _grid(scenarios)
    for name, ax in zip(scenarios, axes, strict=False):
        for c in (c for c in capacities if c.scenario == name):
            probes = c.search.probes
            ax.plot(
                [100 * p.load for p in probes],
                [p.attainment for p in probes],
                marker="o",
                ms=3,
                lw=0.8,
                label=c.policy,
            )
        ax.axhline(target, color="grey", ls=":", lw=0.8)
        ax.set(title=name, xlabel="offered load, % of nominal", ylabel="SLO met", ylim=(0, 1.02))
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    return _save(fig, path)


def _save(fig: Any, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
