"""`weir router` and `weir sidecar` take the servers' limits on what clients send as flags,
and refuse values out of range before serving."""

from __future__ import annotations

import pytest

from tests.router.router_process import weir_router
from tests.transport.raw_client import RawConnection, request_head
from weir.cli import main


async def test_the_router_serves_with_the_limits_its_flags_give() -> None:
    """On the loop `weir router` runs on (uvloop), whose transports are not asyncio's."""
    args = [
        "--port", "0", "--model", "m", "--endpoint", "http://127.0.0.1:9",
        "--max-body-mib", "0.01", "--max-connections", "2", "--header-timeout-s", "0.5",
        "--idle-timeout-s", "1",
    ]  # fmt: skip
    async with weir_router(*args) as router:
        first = await RawConnection.open(router.url)
        await first.send(request_head("/v1/completions", 20_000))  # over 0.01 MiB
        answer = await first.answer()
        assert answer.status == 413
        assert "10486 bytes" in str(answer.error()["message"])
        slow = await RawConnection.open(router.url)
        await slow.send(b"POST /v1/completions HTTP/1.1\r\n")  # and no more of its head
        over = await RawConnection.open(router.url)  # past --max-connections 2
        assert (await over.answer()).status == 503
        assert await slow.closed_by_server()  # the head's 0.5 s
        assert await first.closed_by_server()  # idle for 1 s after its answer
        for conn in (first, slow, over):
            await conn.close()


@pytest.mark.parametrize(
    ("command", "flags", "says"),
    [
        (["router", "--endpoint", "http://127.0.0.1:9"], ["--max-body-mib", "-1"], ">= 0"),
        (
            ["router", "--endpoint", "http://127.0.0.1:9"],
            ["--max-body-mib", "2", "--max-body-in-flight-mib", "1"],
            "at least one largest body",
        ),
        (["sidecar", "--engine-url", "http://127.0.0.1:9"], ["--header-timeout-s", "0"],
         "header_timeout_s"),
        (["sidecar", "--engine-url", "http://127.0.0.1:9"], ["--max-connections", "0"],
         "max_connections"),
    ],
)  # fmt: skip
def test_limits_out_of_range_are_refused_before_serving(
    command: list[str], flags: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*command, *flags]) == 2
    assert says in capsys.readouterr().err
