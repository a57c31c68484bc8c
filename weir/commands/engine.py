"""`weir engine`: serve the reference engine with SGLang-like launch flags."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fleetsim.engine import EngineConfig

NAME = "engine"
HELP = "Serve the SGLang-compatible reference engine (SGLang's HTTP protocol, simulated GPU)."


def configure(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--host", default="127.0.0.1")
    add("--port", type=int, default=30000)
    add("--model", "--model-path", "--served-model-name", dest="model",
        default="meta-llama/Llama-3.1-8B-Instruct", help="the model name the server reports")  # fmt: skip
    add("--api-version", choices=("0.5.5", "0.5.23"), default="0.5.23",
        help="which SGLang HTTP surface to speak")  # fmt: skip
    add("--context-length", type=int, default=None)
    add("--max-total-tokens", type=int, default=None,
        help="KV pool size in tokens (default: from the timing profile's memory)")  # fmt: skip
    add("--page-size", type=int, default=1)
    add("--chunked-prefill-size", type=int, default=8192, help="-1 disables chunking")
    add("--max-running-requests", type=int, default=None)
    add("--max-queued-requests", type=int, default=None, help="a full queue answers 503")
    add("--enable-priority-scheduling", action="store_true")
    add("--schedule-low-priority-values-first", action="store_true")
    add("--schedule-policy", choices=("fcfs", "lpm"), default="fcfs")
    add("--disable-radix-cache", action="store_true")
    add("--enable-hierarchical-cache", "--enable-hicache", action="store_true",
        help="a host-memory KV tier: evicted prefix pages are kept there and loaded back")  # fmt: skip
    add("--hicache-ratio", type=float, default=2.0, help="host pool size over device pool size")
    add("--hicache-size", type=int, default=0, help="host pool GB (overrides the ratio)")
    add("--hicache-write-policy", choices=("write_back", "write_through"), default="write_back",
        help="copy pages to host memory on eviction or as they are cached (SGLang's default "
        "is write_through; write_through_selective is not modelled)")  # fmt: skip
    add("--enable-mixed-chunk", action="store_true")
    add(
        "--enable-metrics",
        action="store_true",
        help="serve /metrics (off by default, as in SGLang)",
    )
    add("--decode-log-interval", type=int, default=40)
    add("--incremental-streaming-output", action="store_true",
        help="/generate stream chunks carry only new text and ids")  # fmt: skip
    add("--prefill-yield", action="store_true",
        help="long prefills yield to shorter ones at chunk boundaries, with aging")  # fmt: skip
    add("--prefill-time-budget-s", type=float, default=None)
    add("--priority-aging-s", type=float, default=None)
    add("--speed-factor", type=float, default=1.0,
        help="simulated GPU speed relative to the timing profile")  # fmt: skip
    add("--startup-s", type=float, default=0.0,
        help="seconds /health answers 503 after start, as while loading weights")  # fmt: skip
    add("--disaggregation-mode", choices=("null", "prefill", "decode"), default="null",
        help="half of a P/D pair: prefill computes prompts and ships their KV, decode "
        "receives it and generates")  # fmt: skip
    add("--disaggregation-bootstrap-port", type=int, default=8998,
        help="a prefill engine's bootstrap server, where decode engines fetch KV (0: a free port)")  # fmt: skip
    add("--disaggregation-transfer-backend", default="mooncake",
        choices=("mooncake", "mooncake_tcp", "nixl", "ascend", "fake", "mori"),
        help="reported as SGLang's; KV always moves over loopback HTTP here")  # fmt: skip
    add("--num-reserved-decode-tokens", type=int, default=512,
        help="decode room a decode engine keeps per request before it takes a handoff")  # fmt: skip
    add("--kv-link-bytes-per-s", type=float, default=None,
        help="P/D KV transfer bandwidth (default: the hardware profile's, 50 GB/s)")  # fmt: skip
    add("--token-backend", choices=("hash", "torch"), default="hash")
    add("--eos-per-mille", type=float, default=None)


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    from fleetsim.engine import EngineConfig

    extra = {} if args.eos_per_mille is None else {"eos_per_mille": args.eos_per_mille}
    return EngineConfig(
        model=args.model,
        context_length=args.context_length,
        max_total_tokens=args.max_total_tokens,
        page_size=args.page_size,
        chunked_prefill_size=args.chunked_prefill_size,
        max_running_requests=args.max_running_requests,
        max_queued_requests=args.max_queued_requests,
        enable_priority_scheduling=args.enable_priority_scheduling,
        schedule_low_priority_values_first=args.schedule_low_priority_values_first,
        schedule_policy=args.schedule_policy,
        disable_radix_cache=args.disable_radix_cache,
        enable_hierarchical_cache=args.enable_hierarchical_cache,
        hicache_ratio=args.hicache_ratio,
        hicache_size=args.hicache_size,
        hicache_write_policy=args.hicache_write_policy,
        enable_mixed_chunk=args.enable_mixed_chunk,
        enable_metrics=args.enable_metrics,
        decode_log_interval=args.decode_log_interval,
        incremental_streaming_output=args.incremental_streaming_output,
        prefill_yield=args.prefill_yield,
        prefill_time_budget_s=args.prefill_time_budget_s,
        priority_aging_s=args.priority_aging_s,
        speed_factor=args.speed_factor,
        startup_s=args.startup_s,
        token_backend=args.token_backend,
        disaggregation_mode=args.disaggregation_mode,
        disaggregation_bootstrap_port=args.disaggregation_bootstrap_port,
        disaggregation_transfer_backend=args.disaggregation_transfer_backend,
        num_reserved_decode_tokens=args.num_reserved_decode_tokens,
        kv_link_bytes_per_s=args.kv_link_bytes_per_s,
        **extra,
    )


def run(args: argparse.Namespace) -> int:
    import asyncio
    import signal
    import sys

    import uvloop

    from fleetsim.server import serve_engine

    try:
        config = config_from_args(args)
    except ValueError as exc:
        print(f"weir engine: {exc}", file=sys.stderr)
        return 2

    async def serve() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        async with serve_engine(
            config, host=args.host, port=args.port, api_version=args.api_version
        ) as engine:
            print(
                f"weir engine: SGLang {args.api_version} surface on {engine.url} "
                f"(model {config.model}, {engine.engine.total_tokens} KV tokens)",
                flush=True,
            )
            await stop.wait()

    uvloop.run(serve())
    return 0
