"""`weir router`: serve the OpenAI-compatible router for one pool."""

from __future__ import annotations

import argparse

NAME = "router"
HELP = "Serve the router: OpenAI/SGLang-compatible gateway with KV-aware routing for one pool."


def configure(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--host", default="127.0.0.1")
    add("--port", type=int, default=8080, help="0 picks a free port")
    add("--pool", default="default", help="the pool's name in the control plane")
    add("--model", default="meta-llama/Llama-3.1-8B-Instruct",
        help="the model this pool serves (also the default for /generate)")  # fmt: skip
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--redis-url", help="the control plane: endpoints, leases, owners")
    source.add_argument("--endpoint", action="append", metavar="URL",
                        help="a fixed engine URL instead of the control plane (repeatable)")  # fmt: skip
    add("--api-keys", metavar="FILE", help="YAML/JSON mapping API key -> tenant")
    add("--profile", metavar="FILE", help="routing profile (YAML/JSON; see controlplane.routing)")
    add("--context-length", type=int, default=32768)
    add("--bytes-per-token", type=float, default=4.0,
        help="UTF-8 prompt bytes per token for the router's estimates (context check, "
             "prefix blocks, resume counts): ~4 for real tokenizers, 1 for the reference "
             "engine, whose tokens are bytes")  # fmt: skip
    add("--staleness-s", type=float, default=10.0,
        help="route on the last snapshot this long while Redis is unreachable, then refuse")  # fmt: skip
    add("--queue-max-wait-s", type=float, default=30.0)
    add("--max-attempts", type=int, default=3, help="endpoints tried before the first byte")
    add("--prefill-for", metavar="DECODE_POOL", default="",
        help="this pool does prefill only: admit with a handoff credit on DECODE_POOL")  # fmt: skip
    add("--quotas", action="store_true",
        help="enforce tenant quotas from the control plane (needs --redis-url)")  # fmt: skip


def run(args: argparse.Namespace) -> int:
    import asyncio
    import signal
    import sys
    from pathlib import Path

    import yaml

    from controlplane.contract import Role, RoutingPolicy
    from controlplane.gateway import GatewayConfig, Limits, TenantKeys, serve_gateway
    from controlplane.routing import ProfileError, profile_from_config

    try:
        if not (0.5 <= args.bytes_per_token <= 16):
            raise ValueError("--bytes-per-token must be between 0.5 and 16")
        keys = TenantKeys.load(args.api_keys) if args.api_keys else TenantKeys()
        profile = yaml.safe_load(Path(args.profile).read_text()) if args.profile else None
        if profile is not None:
            profile_from_config(profile)  # refuse a bad profile before serving
        config = GatewayConfig(
            pool=args.pool,
            model=args.model,
            host=args.host,
            port=args.port,
            limits=Limits(args.context_length, args.bytes_per_token),
            routing=RoutingPolicy(snapshot_staleness_s=args.staleness_s),
            profile=profile,
            max_attempts=args.max_attempts,
            queue_max_wait_s=args.queue_max_wait_s,
            enforce_quotas=args.quotas,
            role=Role.PREFILL if args.prefill_for else Role.MIXED,
            decode_pool=args.prefill_for,
        )
        if (args.quotas or args.prefill_for) and not args.redis_url:
            raise ValueError("--quotas and --prefill-for need --redis-url (the control plane)")
    except (OSError, ValueError, ProfileError, yaml.YAMLError) as exc:
        print(f"weir router: {exc}", file=sys.stderr)
        return 2

    async def serve() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        running = await serve_gateway(
            config, redis_url=args.redis_url or "", endpoints=args.endpoint or (), keys=keys
        )
        source = args.redis_url or ", ".join(args.endpoint)
        print(f"weir router: {running.url} (pool {config.pool}, from {source})", flush=True)
        try:
            await stop.wait()
        finally:
            await running.close()

    asyncio.run(serve())
    return 0
