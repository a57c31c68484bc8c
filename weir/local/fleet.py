"""A local fleet as plain processes: Redis, N engines each with a sidecar, and routers.

With `prefill_engines` it is a P/D pair of pools, as a cluster runs one: prefill engines
(`--disaggregation-mode prefill`, each with a bootstrap port of its own) in the pool the
routers serve, whose requests are P/D pairs, and the `engines` decode engines in the pool
`<pool>-decode`, whose own router publishes the decode handoff credit budget.

`weir up` runs one. Every part is the real component started the way a cluster starts it
(`weir engine` or SGLang's `launch_server`, `weir sidecar`, `weir router --policy-file`),
each child's output goes to a log file in the fleet's work directory, and `close()` ends
every child, newest first, terminating politely and killing what does not exit in time.

The router reads a pool policy written to the work directory, as it reads the operator's
ConfigMap in a cluster. Several routers (`routers`) serve the same pool side by side, as the
chart's replicas do: each follows the pool in Redis and charges the same tenant quotas. It declares demo tenants with quotas (`DEMO_TENANTS`), so tenant
admission and the tenants dashboard work out of the box: the router is open (no API
keys), a request names its tenant with `x-weir-tenant: interactive` (or `batch`), and
one that names none is tenant `default`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from controlplane.contract import PoolPolicy, Role, TenantQuota, encode_json
from weir.local.ports import free_port, port_in_use, wait_for_port
from weir.local.process import LocalService, log_tail
from weir.local.redis_server import RedisServer
from weir.local.sglang import check_launch, launch_command

WEIR = (sys.executable, "-m", "weir.cli")


# Generous for a laptop: they bound a runaway client, not the demo.
DEMO_TENANTS = (
    TenantQuota(name="default", max_concurrency=64, output_tokens_per_min=2_000_000),
    TenantQuota(
        name="interactive", max_concurrency=64, input_tokens_per_min=4_000_000,
        output_tokens_per_min=2_000_000,
    ),
    TenantQuota(
        name="batch", priority_class="batch", weight=0.5, max_concurrency=32,
        input_tokens_per_min=2_000_000, output_tokens_per_min=1_000_000,
    ),
)  # fmt: skip


class FleetError(RuntimeError):
    """A part of the fleet could not start; the message names it and its log."""


@dataclass(frozen=True, slots=True)
class FleetConfig:
    engines: int = 2
    routers: int = 1
    router_port: int = 8080  # the first router's (0: a free one); the others take free ones
    pool: str = "local"
    model: str = "meta-llama/Llama-3.1-8B-Instruct"
    engine: str = "reference"  # or "sglang"
    model_path: str = ""  # SGLang: the weights to serve
    # SGLang: the Python that has it installed (empty: this one), and launch flags added
    # to Weir's (`--device cpu ...` on a machine without a GPU).
    sglang_python: str = ""
    engine_args: tuple[str, ...] = ()
    # SGLang: variables its servers' environment adds to ours (the CPU engine's switch).
    engine_env: tuple[tuple[str, str], ...] = ()
    redis_url: str = ""  # empty: start a redis-server
    speed_factor: float = 1.0
    kv_tokens: int = 0  # reference engines: KV pool size in tokens (0: the model's)
    startup_timeout_s: float = 120.0
    tenants: tuple[TenantQuota, ...] = DEMO_TENANTS
    # P/D: this many prefill engines serve `pool`; the `engines` decode `<pool>-decode`.
    prefill_engines: int = 0
    # Reference engines: `weir engine` flags added to Weir's (tests, benchmarks).
    reference_args: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not 1 <= self.engines <= 64:
            raise ValueError("engines must be between 1 and 64")
        if not 0 <= self.prefill_engines <= 64:
            raise ValueError("prefill engines must be between 0 and 64")
        if self.prefill_engines and self.engine != "reference":
            raise ValueError("a local P/D fleet runs reference engines (--engine reference)")
        if not 1 <= self.routers <= 16:
            raise ValueError("routers must be between 1 and 16")
        if self.engine not in ("reference", "sglang"):
            raise ValueError("engine must be 'reference' or 'sglang'")
        if self.engine == "sglang":
            check_launch(self.sglang_python, self.model_path)
        elif self.sglang_python or self.engine_args or self.engine_env:
            raise ValueError("--sglang-python and --engine-arg go with --engine sglang")


@dataclass
class _Child:
    name: str
    proc: subprocess.Popen[bytes]
    log: Path


@dataclass
class LocalFleet(LocalService):
    config: FleetConfig
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="weir-up-")))
    redis: RedisServer | None = None
    redis_url: str = ""
    engine_urls: list[str] = field(default_factory=list)
    sidecar_urls: list[str] = field(default_factory=list)
    router_urls: list[str] = field(default_factory=list)
    decode_router_url: str = ""  # a P/D fleet's decode pool's router
    _children: list[_Child] = field(default_factory=list)

    @property
    def model(self) -> str:
        c = self.config
        return c.model_path if c.engine == "sglang" else c.model

    @property
    def decode_pool(self) -> str:
        """A P/D fleet's decode pool ("" for a mixed fleet)."""
        return f"{self.config.pool}-decode" if self.config.prefill_engines else ""

    def policy(self, role: Role = Role.MIXED) -> PoolPolicy:
        """A pool's policy, as its routers and sidecars read it (the operator's ConfigMap
        in a cluster): a P/D fleet's decode pool's (`Role.DECODE`), else that of the pool
        the routers serve (a P/D fleet's prefill pool)."""
        c = self.config
        if role is Role.DECODE:
            return PoolPolicy(pool=self.decode_pool, model=self.model, role=role)
        if c.prefill_engines:
            return PoolPolicy(pool=c.pool, model=self.model, tenants=c.tenants,
                              role=Role.PREFILL, decode_pool=self.decode_pool)  # fmt: skip
        return PoolPolicy(pool=c.pool, model=self.model, tenants=c.tenants)

    def start(self) -> LocalFleet:
        c = self.config
        if c.router_port and port_in_use(c.router_port):
            # Else the router could not bind, and waiting for the port would find the
            # other listener and take it for ours.
            raise FleetError(f"port {c.router_port} is in use; choose another with --port")
        try:
            if c.redis_url:
                self.redis_url = c.redis_url
            else:
                self.redis = RedisServer().start()
                self.redis_url = self.redis.url
            # Engines load weights side by side: started together, then waited for.
            roles = (
                [Role.PREFILL] * c.prefill_engines + [Role.DECODE] * c.engines
                if c.prefill_engines
                else [Role.MIXED] * c.engines
            )
            ports = [free_port() for _ in roles]
            for i, (role, port) in enumerate(zip(roles, ports, strict=True)):
                self._spawn(f"engine-{i}", self._engine_command(port, role), port, wait=False,
                            env=dict(c.engine_env))  # fmt: skip
                self.engine_urls.append(f"http://127.0.0.1:{port}")
            for child, port in zip(self._children[-len(roles) :], ports, strict=True):
                self._wait_listening(child, port)
            for i, (role, engine_url) in enumerate(zip(roles, self.engine_urls, strict=True)):
                port = free_port()
                pool = self.decode_pool if role is Role.DECODE else c.pool
                # A P/D endpoint's sidecar learns its pool's role from the policy.
                policy = [] if role is Role.MIXED else ["--policy-file", self._policy_file(role)]
                self._spawn(
                    f"sidecar-{i}",
                    [*WEIR, "sidecar", "--engine-url", engine_url, "--port", str(port),
                     "--pool", pool, "--endpoint-id", f"{pool}-{i}", *policy,
                     "--heartbeat-s", "0.5", "--lease-ttl-s", "3"],
                    port,
                    control_plane=True,
                )  # fmt: skip
                self.sidecar_urls.append(f"http://127.0.0.1:{port}")
            if c.prefill_engines:
                # The decode pool's router publishes its handoff credit budget.
                port = free_port()
                self._spawn("router-decode", self._router_command(port, Role.DECODE), port,
                            control_plane=True)  # fmt: skip
                self.decode_router_url = f"http://127.0.0.1:{port}"
            for i in range(c.routers):
                port = (c.router_port if i == 0 else 0) or free_port()
                self._spawn(
                    "router" if i == 0 else f"router-{i}",
                    self._router_command(port, roles[0]),
                    port,
                    control_plane=True,
                )  # fmt: skip
                self.router_urls.append(f"http://127.0.0.1:{port}")
            self._wait_ready()
        except BaseException:
            self.close()
            raise
        return self

    def _policy_file(self, role: Role) -> str:
        """`policy(role)`, written once to the work directory."""
        path = self.workdir / ("policy-decode.json" if role is Role.DECODE else "policy.json")
        if not path.exists():
            path.write_bytes(encode_json(self.policy(role)))
        return str(path)

    def _router_command(self, port: int, role: Role) -> list[str]:
        c = self.config
        return [*WEIR, "router", "--port", str(port), "--policy-file", self._policy_file(role),
                "--bytes-per-token", "1" if c.engine == "reference" else "4"]  # fmt: skip

    def _engine_command(self, port: int, role: Role) -> list[str]:
        c = self.config
        if c.engine == "sglang":
            return launch_command(c.sglang_python, c.model_path, port, c.engine_args)
        kv = ["--max-total-tokens", str(c.kv_tokens)] if c.kv_tokens else []
        pd: list[str] = []
        if role is not Role.MIXED:
            pd = ["--disaggregation-mode", role.value]
        if role is Role.PREFILL:  # one bootstrap server per engine on this host
            pd += ["--disaggregation-bootstrap-port", str(free_port())]
        return [*WEIR, "engine", "--port", str(port), "--model", c.model,
                "--speed-factor", str(c.speed_factor), *kv, *pd, *c.reference_args]  # fmt: skip

    def _spawn(
        self,
        name: str,
        command: list[str],
        port: int,
        wait: bool = True,
        *,
        control_plane: bool = False,
        env: dict[str, str] | None = None,
    ) -> None:
        """Start a child, its environment ours plus `env`; `control_plane`: it gets the
        Redis URL in $WEIR_REDIS_URL (not on its command line, where a password would show
        in process listings)."""
        log = self.workdir / f"{name}.log"
        added = {**(env or {}), **({"WEIR_REDIS_URL": self.redis_url} if control_plane else {})}
        with log.open("wb") as out:
            proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                    env={**os.environ, **added})  # fmt: skip
        child = _Child(name, proc, log)
        self._children.append(child)
        if wait:
            self._wait_listening(child, port)

    def _wait_listening(self, child: _Child, port: int) -> None:
        deadline = time.monotonic() + self.config.startup_timeout_s
        while True:
            if child.proc.poll() is not None:
                raise FleetError(
                    f"{child.name} exited with {child.proc.returncode}:\n{log_tail(child.log)}"
                )
            try:
                wait_for_port(port, timeout_s=0.5)
                return
            except TimeoutError:
                if time.monotonic() > deadline:
                    raise FleetError(
                        f"{child.name} did not listen on {port}:\n{log_tail(child.log)}"
                    ) from None

    @property
    def router_url(self) -> str:
        """The first router's URL (the only one, unless `routers` asks for more)."""
        return self.router_urls[0] if self.router_urls else ""

    def _wait_ready(self) -> None:
        """Until every router sees every endpoint of its pool in its snapshot (a P/D
        fleet's routers the decode pool's too)."""
        c = self.config
        deadline = time.monotonic() + c.startup_timeout_s
        expected = dict.fromkeys(self.router_urls, c.prefill_engines or c.engines)
        if self.decode_router_url:
            expected[self.decode_router_url] = c.engines
        waiting = list(expected)
        while True:
            try:
                while waiting:
                    status = self.status(waiting[0])
                    decode = status.get("decode")
                    if (
                        len(status["endpoints"]) < expected[waiting[0]]
                        or status["stale"]
                        or (decode is not None and len(decode["endpoints"]) < c.engines)
                    ):
                        break
                    waiting.pop(0)
                else:
                    return
            except (OSError, urllib.error.URLError, ValueError):
                pass
            for child in self._children:
                if child.proc.poll() is not None:
                    raise FleetError(f"{child.name} exited:\n{log_tail(child.log)}")
            if time.monotonic() > deadline:
                raise FleetError("the router did not see every endpoint in time")
            time.sleep(0.1)

    def status(self, router_url: str = "") -> dict[str, Any]:
        """The fleet as a router (the first, by default) sees it (`GET /weir/v1/pool`)."""
        url = router_url or self.router_url
        with urllib.request.urlopen(url + "/weir/v1/pool", timeout=5) as reply:
            data: dict[str, Any] = json.loads(reply.read())
            return data

    def kill(self, name: str) -> None:
        """SIGKILL one part (`engine-0`, `sidecar-1`, `router`, `router-1`), as a crashed
        pod's."""
        for child in self._children:
            if child.name == name:
                child.proc.kill()
                child.proc.wait()
                return
        raise KeyError(name)

    def failed_children(self) -> list[str]:
        return [c.name for c in self._children if c.proc.poll() is not None]

    def close(self) -> None:
        for child in reversed(self._children):
            if child.proc.poll() is None:
                child.proc.terminate()
        for child in reversed(self._children):
            try:
                child.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                child.proc.kill()
                child.proc.wait()
        self._children.clear()
        if self.redis is not None:
            self.redis.close()
            self.redis = None


def format_status(status: dict[str, Any]) -> str:
    """A table of the fleet: one row per endpoint."""
    rows = [("endpoint", "watermark", "kv used/capacity", "running", "queued", "lease")]
    for e in status["endpoints"]:
        capacity = e["kv_capacity_tokens"] or 1
        used = e["kv_used_tokens"] + e["kv_reserved_growth_tokens"]
        lease = "-" if e["lease_left_s"] is None else f"{e['lease_left_s']:.1f}s"
        rows.append((
            e["endpoint_id"], e["watermark"],
            f"{e['kv_used_tokens']}/{e['kv_capacity_tokens']} ({100 * used / capacity:.0f}%)",
            str(e["running_requests"]), str(e["queued_requests"]), lease,
        ))  # fmt: skip
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(widths[i]) for i, cell in enumerate(r)).rstrip() for r in rows]
    age = status["snapshot_age_s"]
    lines.append(f"pool {status['pool']}: snapshot age {age:.1f}s, router queue {status['queued']}")
    return "\n".join(lines)
