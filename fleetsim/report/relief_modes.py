"""Relief's cost-based choice (recompute, offload, migrate) against each fixed mode, on
the simulated fleet: `python -m fleetsim.report.relief_modes`.

The traffic forces relief: long requests (8K-token prompts) whose outputs run 15 times
past the length hint the sidecar admits them by (200 tokens predicted, 3,000 generated),
so growth outruns the reserve and relief must take KV from running requests, while short
chats with prompts of their own keep the device prefix cache churning, so a victim's
pages do not stay on the device while it waits. Two cases, the same requests: the host
tier at PCIe speed (50 GB/s), where offload should win, and behind a 1.5 GB/s link (a
disk-backed tier), where a host round trip of a token's KV costs more than recomputing
it on the 70B model (the crossover is about 2.7 GB/s) and it should not.

Each case runs Weir four times, differing only in relief's modes: Weir's choice (all
three, by cost, engines with a host tier), always recompute (engines without one: Weir
before offload), always migrate and always offload (engines with one). Figures are
`fleetsim.report.metrics.summarize`'s; recomputed tokens count each relief victim's
history less what a prefix cache (device or host) gave back when it resumed, plus what
engine retractions recomputed.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass, replace

import msgspec

from controlplane.contract import PoolPolicy, PreemptionMode
from fleetsim.engine import EngineConfig
from fleetsim.report.metrics import summarize
from fleetsim.sim import FleetConfig, Simulation, engine_config_for
from fleetsim.sim.weir import WeirPolicy
from fleetsim.workloads import BLOCK_TOKENS, RequestSpec

_M = PreemptionMode


def workload(long_requests: int, chats: int, chat_gap_s: float = 1.5) -> list[RequestSpec]:
    """`long_requests` arriving every 0.5 s, then `chats` every `chat_gap_s` from 5 s on."""
    long = [
        RequestSpec(
            f"long{i}",
            0.5 * i,
            "batch",
            0,
            16 * BLOCK_TOKENS,
            3000,
            4000,
            tuple(range(1000 * i, 1000 * i + 16)),
            output_hint_tokens=200,
        )
        for i in range(long_requests)
    ]
    short = [
        RequestSpec(
            f"chat{j}",
            5.0 + chat_gap_s * j,
            "chat",
            2,
            4 * BLOCK_TOKENS,
            40,
            100,
            tuple(range(1_000_000 + 10 * j, 1_000_000 + 10 * j + 4)),
        )
        for j in range(chats)
    ]
    return sorted(long + short, key=lambda s: s.arrival_s)


@dataclass(frozen=True, slots=True)
class Case:
    name: str
    host_bytes_per_s: float


CASES = (
    Case("offload should win: host tier at PCIe speed (50 GB/s)", 50e9),
    Case("offload should not: host tier behind 1.5 GB/s", 1.5e9),
)
# (label, host tier on the engines, relief's modes)
VARIANTS = (
    ("Weir's choice", True, (_M.RECOMPUTE, _M.OFFLOAD, _M.MIGRATE)),
    ("always recompute", False, (_M.RECOMPUTE,)),
    ("always migrate", True, (_M.MIGRATE,)),
    ("always offload", True, (_M.OFFLOAD,)),
)


def _engines(fleet: FleetConfig, host_tier: bool, host_bytes_per_s: float) -> EngineConfig:
    base = engine_config_for(fleet)
    if not host_tier:
        return base
    hardware = replace(base.timing.hardware, host_bytes_per_s=host_bytes_per_s)
    return base.replace(
        enable_hierarchical_cache=True, timing=replace(base.timing, hardware=hardware)
    )


def _policy(fleet: FleetConfig, modes: tuple[PreemptionMode, ...]) -> PoolPolicy:
    scheduling = msgspec.structs.replace(fleet.policy.scheduling, preemption_modes=modes)
    return msgspec.structs.replace(fleet.policy, scheduling=scheduling)


def run_case(case: Case, fleet: FleetConfig, specs: list[RequestSpec]) -> list[dict[str, object]]:
    """One row per variant, `summarize`'s figures plus the last request's finish."""
    timing = fleet.timing
    per_token_s = (
        2 * timing.model.params / (timing.hardware.flops * timing.hardware.compute_efficiency)
    )
    rows = []
    for label, host_tier, modes in VARIANTS:
        engines = _engines(fleet, host_tier, case.host_bytes_per_s)
        result = Simulation(
            specs, WeirPolicy(_policy(fleet, modes)), fleet, engine_config=engines
        ).run()
        last = max(f.finished_at for f in result.flights)
        rows.append(
            {"variant": label, "last_finish_s": last, **summarize(result, fleet.slo, per_token_s)}
        )
    return rows


def table(rows: Sequence[dict[str, object]]) -> str:
    lines = [
        "| relief | goodput (req/s) | completed | preemptions | recomputed tokens | e2e p50 / p90 | last finish |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        modes, e2e = row["preemptions"], row["e2e_s"]
        assert isinstance(modes, dict)
        assert isinstance(e2e, dict)
        shown = ", ".join(f"{k} {v}" for k, v in modes.items()) or "none"
        lines.append(
            f"| {row['variant']} | {row['goodput_rps']:.3f} | {row['completed']}/{row['offered']} "
            f"| {shown} | {row['recomputed_tokens']:,} | {e2e['p50']:.1f} s / {e2e['p90']:.1f} s "
            f"| {row['last_finish_s']:.0f} s |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--kv-tokens", type=int, default=50_000, help="each engine's KV pool")
    parser.add_argument("--long", type=int, default=10, help="long requests")
    parser.add_argument("--chats", type=int, default=40, help="short chats")
    args = parser.parse_args(argv)
    fleet = FleetConfig(engines=args.engines, kv_tokens=args.kv_tokens, drain_s=600.0)
    specs = workload(args.long, args.chats)
    for case in CASES:
        print(f"### {case.name}\n")
        print(table(run_case(case, fleet, specs)) + "\n")


if __name__ == "__main__":
    main()
