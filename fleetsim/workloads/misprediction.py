"""Systematically wrong output-length hints, to test how admission survives bad predictions.

Growth-reserve admission and victim scoring lean on predicted output length. A workload can
hand every request a hint equal to its true length times `bias`: below 1 the fleet is told
outputs are shorter than they are (growth outruns the reserve: the dangerous side), above 1
longer (too little is admitted). A bias of 0 gives no hints at all, so predictors must learn
from completions alone.
"""

from __future__ import annotations

import math
from dataclasses import replace

from fleetsim.workloads.request import RequestSpec


def with_output_hints(specs: list[RequestSpec], bias: float) -> list[RequestSpec]:
    if not math.isfinite(bias) or bias < 0:
        raise ValueError(f"output-length bias must be a finite number >= 0, got {bias}")
    if bias == 0:
        return [replace(s, output_hint_tokens=0) for s in specs]
    return [replace(s, output_hint_tokens=max(1, round(s.output_tokens * bias))) for s in specs]
