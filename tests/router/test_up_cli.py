"""`weir up` and `weir router` refuse bad configurations clearly, before starting anything."""

from __future__ import annotations

import importlib.util
import socket
from pathlib import Path

import pytest

from weir.cli import main


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="SGLang is installed")
def test_weir_up_with_sglang_but_without_it_installed_says_how_to_get_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["up", "--engine", "sglang", "--model", "/models/llama"]) == 2
    assert "pip install 'weir[sglang]'" in capsys.readouterr().err


def test_weir_up_refuses_an_absurd_engine_count(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["up", "--engines", "0"]) == 2
    assert "engines must be between 1 and 64" in capsys.readouterr().err


def test_weir_up_refuses_an_absurd_router_count(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["up", "--routers", "0"]) == 2
    assert "routers must be between 1 and 16" in capsys.readouterr().err


def test_weir_up_refuses_a_router_port_in_use(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["up", "--port", str(port), "--smoke"]) == 1
    assert f"port {port} is in use" in capsys.readouterr().err


def test_weir_router_refuses_a_bad_profile(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    profile = tmp_path / "profile.yaml"
    profile.write_text("scorers: [{name: no-such-scorer}]\n")
    assert main(["router", "--endpoint", "http://127.0.0.1:9", "--profile", str(profile)]) == 2
    assert "unknown scorer 'no-such-scorer'" in capsys.readouterr().err
