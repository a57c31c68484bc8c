"""Workloads for the fleet simulator: the validation-matrix scenarios, trace replay, and
output-length misprediction. Everything is deterministic for a seed."""

from fleetsim.workloads.misprediction import with_output_hints
from fleetsim.workloads.request import (
    BLOCK_TOKENS,
    LENGTH_BUCKETS,
    RequestSpec,
    length_bucket,
    prompt_token_bytes,
    prompt_token_bytes_each,
)
from fleetsim.workloads.scenarios import SCENARIOS, MixStats, Scenario, mix_stats, scenario
from fleetsim.workloads.traces import TraceError, read_trace, write_trace

__all__ = [
    "BLOCK_TOKENS",
    "LENGTH_BUCKETS",
    "SCENARIOS",
    "MixStats",
    "RequestSpec",
    "Scenario",
    "TraceError",
    "length_bucket",
    "mix_stats",
    "prompt_token_bytes",
    "prompt_token_bytes_each",
    "read_trace",
    "scenario",
    "with_output_hints",
    "write_trace",
]
