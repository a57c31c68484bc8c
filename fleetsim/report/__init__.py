"""The validation-matrix report: metrics per run, the matrix runner, goals, markdown
tables, one JSON document and PNG plots."""

from fleetsim.report.markdown import document as markdown_document
from fleetsim.report.markdown import goals_table, json_safe, scenario_table, sweep_table
from fleetsim.report.matrix import (
    TRACE,
    Cell,
    CellSpec,
    goals,
    run_cell,
    run_cells,
    saturation,
    trace_cell,
)
from fleetsim.report.metrics import is_lost, is_rejected, meets_slo, quantiles, summarize
from fleetsim.report.plots import kv_plot, sweep_plot, ttft_cdf_plot

__all__ = [
    "TRACE",
    "Cell",
    "CellSpec",
    "goals",
    "goals_table",
    "is_lost",
    "is_rejected",
    "json_safe",
    "kv_plot",
    "markdown_document",
    "meets_slo",
    "quantiles",
    "run_cell",
    "run_cells",
    "saturation",
    "scenario_table",
    "summarize",
    "sweep_plot",
    "sweep_table",
    "trace_cell",
    "ttft_cdf_plot",
]
