"""`weir up`: a local fleet serving real requests — the quickest way to see Weir work.

Starts Redis (unless --redis-url), N engines each with a sidecar, and a router (or several
side by side on the same pool, `--routers`, as the chart's replicas); with `--pd`, a P/D
pair of pools instead: `--prefill-engines` prefill engines in the pool the routers serve
(each request a P/D pair) and `--engines` decode engines in `<pool>-decode`, with the
decode pool's router (it publishes the handoff credit budget); prints the URLs; streams a sample request through the router; then shows the fleet's status until
Ctrl-C, when every child is stopped. `--smoke` exits after the sample traffic (non-zero if
any request failed), which is how the end-to-end test drives it.
"""

from __future__ import annotations

import argparse
from typing import Any

from weir.local.sglang_flags import add_sglang_flags

NAME = "up"
HELP = "Start a local fleet (Redis, engines, sidecars, router) and serve requests."


def configure(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--engines", type=int, default=2,
        help="engines (each with a sidecar); with --pd, the decode engines")  # fmt: skip
    add("--pd", action="store_true",
        help="prefill/decode disaggregation: a prefill pool and a decode pool")  # fmt: skip
    add("--prefill-engines", type=int, default=1, help="with --pd, the prefill engines")
    add("--port", type=int, default=8080, help="the first router's port (0: a free one)")
    add("--routers", type=int, default=1, help="routers serving the pool side by side")
    add("--pool", default="local")
    add("--engine", choices=("reference", "sglang"), default="reference",
        help="reference engines, or real SGLang servers")  # fmt: skip
    add("--model", default="meta-llama/Llama-3.1-8B-Instruct",
        help="the served model name; with --engine sglang, the weights' path")  # fmt: skip
    add_sglang_flags(
        parser,
        startup_timeout_s=120.0,
        startup_help="how long each part may take to start (SGLang loads weights first)",
    )
    add("--redis-url", default="", help="use this Redis instead of starting one")
    add("--speed-factor", type=float, default=1.0, help="reference engines' simulated speed")
    add("--requests", type=int, default=1, help="sample streamed requests sent at start")
    add("--smoke", action="store_true", help="exit after the sample requests")
    add("--status-every", type=float, default=5.0, help="seconds between status tables")


def run(args: argparse.Namespace) -> int:
    import signal
    import sys
    import time

    from controlplane.store.connection import redact_url
    from weir.local.fleet import FleetConfig, FleetError, LocalFleet, format_status
    from weir.local.redis_server import RedisNotInstalledError

    if args.requests < 0 or not args.status_every > 0:
        print("weir up: --requests must be >= 0 and --status-every positive", file=sys.stderr)
        return 2
    try:
        config = FleetConfig(
            engines=args.engines,
            routers=args.routers,
            router_port=args.port,
            pool=args.pool,
            model=args.model,
            engine=args.engine,
            model_path=args.model if args.engine == "sglang" else "",
            redis_url=args.redis_url,
            speed_factor=args.speed_factor,
            sglang_python=args.sglang_python,
            engine_args=tuple(args.engine_args),
            startup_timeout_s=args.startup_timeout_s,
            prefill_engines=args.prefill_engines if args.pd else 0,
        )
    except (ValueError, FleetError) as exc:
        print(f"weir up: {exc}", file=sys.stderr)
        return 2

    def terminate(_signum: int, _frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, terminate)
    fleet = LocalFleet(config)
    try:
        count = config.prefill_engines + config.engines
        print(f"weir up: starting {count} {config.engine} engine(s); logs in "
              f"{fleet.workdir}", flush=True)  # fmt: skip
        fleet.start()
        print(f"  redis    {redact_url(fleet.redis_url)}")
        roles = ["prefill "] * config.prefill_engines + ["decode "] * config.engines
        for i, (engine, sidecar) in enumerate(
            zip(fleet.engine_urls, fleet.sidecar_urls, strict=True)
        ):
            label = f"{roles[i] if config.prefill_engines else ''}engine"
            print(f"  {label:<15}{engine}  sidecar {sidecar}")
        for url in fleet.router_urls:
            print(f"  router   {url}   (OpenAI base URL: {url}/v1)")
        if fleet.decode_router_url:
            print(f"  decode pool {fleet.decode_pool}: router {fleet.decode_router_url}")
        print(f"  metrics  {fleet.router_url}/metrics   status {fleet.router_url}/weir/v1/pool")
        tenants = ", ".join(t.name for t in config.tenants)
        print(f"  tenants  {tenants} (header x-weir-tenant; none: default)", flush=True)
        failures = sum(not _sample(fleet, i) for i in range(args.requests))
        if args.smoke:
            print(f"weir up: {args.requests - failures}/{args.requests} sample requests ok")
            return 1 if failures else 0
        print("weir up: serving; Ctrl-C stops the fleet", flush=True)
        while True:
            print(format_status(fleet.status()), flush=True)
            if failed := fleet.failed_children():
                print(f"weir up: {', '.join(failed)} exited; stopping", file=sys.stderr)
                return 1
            time.sleep(args.status_every)
    except (FleetError, RedisNotInstalledError) as exc:
        print(f"weir up: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nweir up: stopping", flush=True)
        return 0
    finally:
        fleet.close()


def _sample(fleet: object, i: int) -> bool:
    """Stream one chat completion through the router, printing tokens as they come."""
    import json
    import urllib.error
    import urllib.request

    from controlplane.contract.vocabulary import DONE_FRAME
    from weir.local.fleet import LocalFleet

    assert isinstance(fleet, LocalFleet)
    body = {
        "model": fleet.model,
        "messages": [{"role": "user", "content": f"Sample request {i}: what does a weir do?"}],
        "max_tokens": 48,
        "stream": True,
    }
    request = urllib.request.Request(
        fleet.router_url + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    print(f"sample {i} -> ", end="", flush=True)
    try:
        with _open(request) as reply:
            endpoint = reply.headers.get("x-weir-endpoint", "?")
            done = False
            for raw in reply:
                line = raw.strip()
                if line == DONE_FRAME.strip():
                    done = True
                elif line.startswith(b"data: "):
                    chunk = json.loads(line[6:])
                    for choice in chunk.get("choices", []):
                        print(choice.get("delta", {}).get("content") or "", end="", flush=True)
        print(f"  [{endpoint}{'' if done else ', INCOMPLETE'}]", flush=True)
        return done
    except (urllib.error.URLError, OSError, ValueError) as exc:
        print(f"  [failed: {exc}]", flush=True)
        return False


def _open(request: Any) -> Any:
    """As a patient client: an overloaded router's 429 is retried after its Retry-After,
    a few times (a P/D fleet's decode pool publishes its first handoff budget within a
    second of its endpoints showing)."""
    import time
    import urllib.error
    import urllib.request

    tries = 0
    while True:
        try:
            return urllib.request.urlopen(request, timeout=60)
        except urllib.error.HTTPError as exc:
            tries += 1
            if exc.code != 429 or tries == 5:
                raise
            time.sleep(float(exc.headers.get("Retry-After", "1")))
