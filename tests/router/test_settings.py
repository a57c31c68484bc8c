"""The router's settings (`controlplane.router.config`): a value out of range is refused
when it is made, named by its dotted path from `RouterConfig`; `weir router` reports it
as argparse reports a bad flag."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import pytest

from controlplane.contract import KVPolicy, PoolPolicy, Role, TenantQuota
from controlplane.router import (
    HandoffSettings,
    QuotaSettings,
    RouterConfig,
    SettingError,
    UpstreamSettings,
)
from weir.cli import main

PREFILL = RouterConfig(pool="p", role=Role.PREFILL, handoff=HandoffSettings("d"))

REFUSED: dict[str, tuple[str, Callable[[], object]]] = {
    "negative connect timeout": (
        "upstream.connect_timeout_s",
        lambda: UpstreamSettings(connect_timeout_s=-1.0),
    ),
    "endless connect timeout": (
        "upstream.connect_timeout_s",
        lambda: UpstreamSettings(connect_timeout_s=math.inf),
    ),
    "NaN chunk timeout": (
        "upstream.chunk_timeout_s",
        lambda: UpstreamSettings(chunk_timeout_s=math.nan),
    ),
    "no upstream connections": (
        "upstream.max_connections",
        lambda: UpstreamSettings(max_connections=0),
    ),
    "negative resumes": ("upstream.max_resumes", lambda: UpstreamSettings(max_resumes=-1)),
    "free KV": ("handoff.kv_bytes_per_token", lambda: HandoffSettings(kv_bytes_per_token=0)),
    "credits that never live": ("handoff.credit_ttl_s", lambda: HandoffSettings(credit_ttl_s=0.0)),
    "a tenant twice": (
        "quotas.tenants",
        lambda: QuotaSettings(tenants=(TenantQuota(name="a"), TenantQuota(name="a"))),
    ),
    "no pool": ("pool", lambda: RouterConfig(pool="")),
    "no model": ("model", lambda: RouterConfig(model="")),
    "a port past 65535": ("port", lambda: RouterConfig(port=65_536)),
    "a prefill pool without its decode pool": (
        "handoff.decode_pool",
        lambda: RouterConfig(role=Role.PREFILL),
    ),
    "a decode pool on a mixed pool": (
        "handoff.decode_pool",
        lambda: RouterConfig(handoff=HandoffSettings("d")),
    ),
    "a decode pool on a decode pool": (
        "handoff.decode_pool",
        lambda: RouterConfig.from_policy(
            PoolPolicy(pool="p", model="m", role=Role.DECODE, decode_pool="d")
        ),
    ),
    "a prefill pool its own decode pool": (
        "handoff.decode_pool",
        lambda: dataclasses.replace(PREFILL, handoff=HandoffSettings("p")),
    ),
    "a prefill pool made mixed, its decode pool kept": (
        "handoff.decode_pool",
        lambda: dataclasses.replace(PREFILL, role=Role.MIXED),
    ),
}


@pytest.mark.parametrize("case", REFUSED)
def test_a_setting_out_of_range_is_refused_by_its_dotted_path(case: str) -> None:
    path, make = REFUSED[case]
    with pytest.raises(ValueError, match=rf"^{path} ") as refused:
        make()
    assert isinstance(refused.value, SettingError)
    assert refused.value.path == path


def test_the_edges_of_each_range_are_settings_still() -> None:
    assert UpstreamSettings(max_resumes=0, max_connections=1).max_resumes == 0  # never resume
    assert RouterConfig(port=65_535).port == 65_535
    assert PREFILL.handoff.decode_pool == "d"
    assert RouterConfig().quotas == QuotaSettings(enforce=False, tenants=())


def test_a_pd_policy_sets_the_role_and_the_handoff() -> None:
    kv = KVPolicy(emergency_watermark=0.9)
    prefill = PoolPolicy(pool="p", model="m", role=Role.PREFILL, decode_pool="d", kv=kv)
    config = RouterConfig.from_policy(prefill)
    assert config.role is Role.PREFILL
    assert config.handoff == HandoffSettings(decode_pool="d", kv=kv)
    decode = PoolPolicy(pool="d", model="m", role=Role.DECODE, kv=kv)
    upstream = UpstreamSettings(max_resumes=1)
    config = RouterConfig.from_policy(decode, upstream=upstream)  # a whole group overridden
    assert (config.role, config.handoff.kv, config.upstream) == (Role.DECODE, kv, upstream)


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (
            ["--max-upstream-connections", "0"],
            "argument --max-upstream-connections: upstream.max_connections must be at least "
            "1, got 0",
        ),
        (["--port", "70000"], "argument --port: port must be in [0, 65535]"),
        (["--host", ""], "argument --host: host must not be empty"),
        (["--pool", "p", "--prefill-for", "p"], "handoff.decode_pool must be another pool"),
    ],
)
def test_weir_router_reports_a_refused_setting_as_argparse_does(
    flags: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["router", "--endpoint", "http://127.0.0.1:9", *flags])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: weir router ")
    assert f"weir router: error: {says}" in err
