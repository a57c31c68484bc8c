"""`weir router`: serve the OpenAI-compatible router for one pool.

In a cluster the router reads its pool's policy (`--policy-file`, the operator's
`<pool>-policy` ConfigMap mounted as a file): pool, model, context length, routing
settings and tenant quotas, which it publishes to the control plane and enforces. Flags
given explicitly override the policy.
"""

from __future__ import annotations

import argparse

from weir.commands._admin_token import add_admin_token_flag, admin_token
from weir.commands._observability_flags import add_logging_flags, configure_observability
from weir.commands._redis_url import ENV as REDIS_URL_ENV
from weir.commands._redis_url import add_redis_url_flags, redis_url
from weir.commands._server_flags import add_server_flags, server_limits

NAME = "router"
DEFAULT_MODEL = "meta-llama/Llama-3.1-8B-Instruct"
HELP = "Serve the router: OpenAI/SGLang-compatible gateway with KV-aware routing for one pool."

# The flags that alone give a router setting, by its dotted path (`SettingError.path`):
# a value the settings refuse is reported against its flag, as argparse reports its own.
SETTING_FLAGS = {
    "host": "--host",
    "port": "--port",
    "upstream.max_connections": "--max-upstream-connections",
}


def configure(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--host", default="127.0.0.1")
    add("--port", type=int, default=8080, help="0 picks a free port")
    add("--pool", help="the pool's name in the control plane (default: the policy's, else "
        "'default')")  # fmt: skip
    add("--model", help="the model this pool serves, also the default for /generate "
        f"(default: the policy's, else {DEFAULT_MODEL})")  # fmt: skip
    add("--policy-file", metavar="FILE",
        help="the PoolPolicy as JSON (the operator's <pool>-policy ConfigMap): routing settings "
             "and tenant quotas (enforced when it declares tenants; needs the control plane)")  # fmt: skip
    # The control plane (--redis-url, --redis-url-file or $WEIR_REDIS_URL) or fixed engines.
    source = parser.add_mutually_exclusive_group()
    add_redis_url_flags(source, "the control plane: endpoints, leases, owners")
    source.add_argument("--endpoint", action="append", metavar="URL",
                        help="a fixed engine URL instead of the control plane (repeatable)")  # fmt: skip
    add("--api-keys", metavar="FILE", help="YAML/JSON mapping API key -> tenant")
    add("--profile", metavar="FILE", help="routing profile (YAML/JSON; see controlplane.routing)")
    add("--context-length", type=int, help="default: the policy's, else 32768")
    add("--bytes-per-token", type=float, default=4.0,
        help="UTF-8 prompt bytes per token for the router's estimates of a prompt (context "
             "check, prefix blocks; output is counted from the engine's own counts): ~4 for "
             "real tokenizers, 1 for the reference engine, whose tokens are bytes")  # fmt: skip
    add("--staleness-s", type=float,
        help="route on the last snapshot this long while Redis is unreachable, then refuse "
             "(default: the policy's routing.snapshot_staleness_s, else 10)")  # fmt: skip
    add("--queue-max-wait-s", type=float,
        help="longest a request waits in the fair queue while every endpoint is saturated "
             "(default: the policy's routing.queue_max_wait_s, else 30)")  # fmt: skip
    add("--max-attempts", type=int,
        help="endpoints tried before the first byte (default: the policy's "
             "routing.max_attempts, else 3)")  # fmt: skip
    add("--max-upstream-connections", type=int, default=8192,
        help="connections open to one endpoint at once; past it a request waits for one to "
             "come free (up to the connect timeout), then tries another endpoint")  # fmt: skip
    add("--prefill-for", metavar="DECODE_POOL", default="",
        help="this pool does prefill only: admit with a handoff credit on DECODE_POOL")  # fmt: skip
    add("--quotas", action="store_true",
        help="enforce tenant quotas from the control plane (needs --redis-url)")  # fmt: skip
    add_admin_token_flag(parser, "the debug route GET /weir/v1/requests/{id}, also shown to "
                         "the sidecars to read theirs")  # fmt: skip
    add_logging_flags(parser)
    add_server_flags(parser, max_connections=8192)


def run(args: argparse.Namespace) -> int:
    import asyncio
    import signal
    import sys
    from pathlib import Path

    import msgspec
    import uvloop
    import yaml

    from controlplane.contract import PoolPolicy, Role, SchemaError, decode_json
    from controlplane.router import (
        QuotaSettings,
        RequestLimits,
        RouterConfig,
        SettingError,
        TenantKeys,
        UpstreamSettings,
        serve_router,
    )
    from controlplane.routing import ProfileError, profile_from_config
    from controlplane.store.connection import redact_url

    try:
        url = "" if args.endpoint else redis_url(args, NAME)
        if not (url or args.endpoint):
            raise ValueError(
                f"give the control plane (--redis-url, --redis-url-file or ${REDIS_URL_ENV}) "
                "or fixed engines (--endpoint)"
            )
        if not (0.5 <= args.bytes_per_token <= 16):
            raise ValueError("--bytes-per-token must be between 0.5 and 16")
        keys = TenantKeys.load(args.api_keys) if args.api_keys else TenantKeys()
        profile = yaml.safe_load(Path(args.profile).read_text()) if args.profile else None
        if profile is not None:
            profile_from_config(profile)  # refuse a bad profile before serving
        policy = (
            decode_json(Path(args.policy_file).read_bytes(), PoolPolicy)
            if args.policy_file
            else PoolPolicy(pool=args.pool or "default", model=args.model or DEFAULT_MODEL)
        )
        if args.pool and args.pool != policy.pool:
            raise ValueError(f"--pool {args.pool} but the policy is for pool {policy.pool}")
        flags = {
            "snapshot_staleness_s": args.staleness_s,
            "queue_max_wait_s": args.queue_max_wait_s,
            "max_attempts": args.max_attempts,
        }
        given = {name: value for name, value in flags.items() if value is not None}
        if given:
            policy = msgspec.structs.replace(
                policy, routing=msgspec.structs.replace(policy.routing, **given)
            )
        if args.prefill_for:
            policy = msgspec.structs.replace(
                policy, role=Role.PREFILL, decode_pool=args.prefill_for
            )
        overrides: dict[str, object] = {}
        if args.quotas:  # enforced even where the policy declares no tenants
            overrides["quotas"] = QuotaSettings(enforce=True, tenants=policy.tenants)
        config = RouterConfig.from_policy(
            policy,
            model=args.model or policy.model,
            host=args.host,
            port=args.port,
            limits=RequestLimits(
                args.context_length or policy.context_length, args.bytes_per_token
            ),
            profile=profile,
            upstream=UpstreamSettings(max_connections=args.max_upstream_connections),
            server=server_limits(args),
            admin_token=admin_token(args.admin_token_file),
            **overrides,
        )
        if (config.quotas.enforce or config.role is Role.PREFILL) and not url:
            raise ValueError(
                "quotas (--quotas, or tenants in the policy) and --prefill-for need "
                f"--redis-url (or --redis-url-file, or ${REDIS_URL_ENV}: the control plane)"
            )
    except SettingError as exc:
        flag = SETTING_FLAGS.get(exc.path)
        raise argparse.ArgumentError(
            None, f"argument {flag}: {exc}" if flag else str(exc)
        ) from None
    except (OSError, ValueError, ProfileError, SchemaError, yaml.YAMLError) as exc:
        print(f"weir router: {exc}", file=sys.stderr)
        return 2

    configure_observability(args, "weir-router")
    if not config.admin_token:
        import logging

        logging.getLogger("weir.router").warning(
            "no admin token: GET /weir/v1/requests/{id} is open to anyone who reaches the "
            "router (set --admin-token-file or WEIR_ADMIN_TOKEN)"
        )

    async def serve() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        try:
            running = await serve_router(
                config, redis_url=url, endpoints=args.endpoint or (), keys=keys
            )
        except ValueError as exc:  # e.g. the policy's quotas, refused by the control plane
            print(f"weir router: {exc}", file=sys.stderr)
            return 2
        source = ", ".join(redact_url(u) for u in ([url] if url else args.endpoint))
        print(f"weir router: {running.url} (pool {config.pool}, from {source})", flush=True)
        try:
            await stop.wait()
        finally:
            await running.close()
        return 0

    return uvloop.run(serve())
