"""The validation-matrix report: metrics per run, the matrix runner, goals, capacity at
SLO, markdown tables, one JSON document and PNG plots."""

from fleetsim.report.markdown import (
    capacity_curves,
    capacity_table,
    goals_table,
    json_safe,
    scenario_table,
    sweep_table,
)
from fleetsim.report.markdown import document as markdown_document
from fleetsim.report.matrix import (
    TRACE,
    Cell,
    CellSpec,
    goals,
    requests_per_cpu_s,
    run_cell,
    run_cells,
    trace_cell,
)
from fleetsim.report.metrics import (
    is_lost,
    is_rejected,
    meets_slo,
    quantiles,
    slo_verdict,
    summarize,
)
from fleetsim.report.plots import capacity_plot, kv_plot, sweep_plot, ttft_cdf_plot
from fleetsim.report.slo_capacity import (
    Capacity,
    CapacityJob,
    CapacitySearch,
    Probe,
    capacity_rows,
    run_capacities,
    search_capacity,
)

__all__ = [
    "TRACE",
    "Capacity",
    "CapacityJob",
    "CapacitySearch",
    "Cell",
    "CellSpec",
    "Probe",
    "capacity_curves",
    "capacity_plot",
    "capacity_rows",
    "capacity_table",
    "goals",
    "goals_table",
    "is_lost",
    "is_rejected",
    "json_safe",
    "kv_plot",
    "markdown_document",
    "meets_slo",
    "quantiles",
    "requests_per_cpu_s",
    "run_capacities",
    "run_cell",
    "run_cells",
    "scenario_table",
    "search_capacity",
    "slo_verdict",
    "summarize",
    "sweep_plot",
    "sweep_table",
    "trace_cell",
    "ttft_cdf_plot",
]
