"""The real SGLang tier: SGLang's own server on the CPU (scripts/sglang_env.py installs
0.5.23 and 0.5.5 and builds the tiny model), one version at a time for the session."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from controlplane.contract import SchedulingPolicy
from fleet_operator.rendering import scheduling_args
from tests.sglang import server
from tests.sglang.server import SGLangServer
from weir.local.sglang_cpu import versions


@pytest.fixture(scope="session", params=versions())
def sglang(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SGLangServer]:
    """A real SGLang server, once per version (tests run grouped by version), with the
    scheduling flags the operator renders for a pool's defaults (priority scheduling,
    fcfs, the prefill chunk): the tier tests the engine as Weir deploys it."""
    version: str = request.param
    yield from server.serve(
        version,
        log_dir=tmp_path_factory.mktemp(f"sglang-{version}"),
        extra_args=scheduling_args(SchedulingPolicy()),
    )
