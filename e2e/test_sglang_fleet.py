"""`weir up --engine sglang`: the README's GPU path, run on this machine's CPU with SGLang's
own server (0.5.23) serving the tiny model, behind its sidecar and the router. One engine:
two real servers behind one router are the SGLang tier's migration test
(tests/sglang/test_lifecycle.py); here the command is what is under test."""

from __future__ import annotations

import os
import re
import subprocess

import pytest

from e2e.conftest import WEIR
from tests.sglang.server import weir_sglang_args
from weir.local.sglang_cpu import cpu_environment

pytestmark = [pytest.mark.sglang, pytest.mark.redis, pytest.mark.slow, pytest.mark.timeout(420)]
VERSION = "0.5.23"


def test_weir_up_with_real_sglang_engines_serves_the_sample_requests() -> None:
    done = subprocess.run(
        [*WEIR, "up", *weir_sglang_args(VERSION), "--engines", "1", "--smoke",
         "--requests", "2", "--port", "0", "--startup-timeout-s", "300"],
        capture_output=True, text=True, timeout=400, env={**os.environ, **cpu_environment()},
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "2/2 sample requests ok" in done.stdout
    # The tiny model's text may hold line breaks: each sample ends with its endpoint.
    assert len(re.findall(r"\[local-\d\]$", done.stdout, re.M)) == 2
