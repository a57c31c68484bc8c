"""The cluster end-to-end script runs only against a real cluster, and says so otherwise."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "e2e" / "cluster" / "install.sh"


def test_script_is_valid_bash() -> None:
    assert subprocess.run(["bash", "-n", str(SCRIPT)], check=False).returncode == 0


def test_script_skips_loudly_without_a_cluster() -> None:
    env = {k: v for k, v in os.environ.items() if k != "KUBECONFIG"}
    out = subprocess.run([str(SCRIPT)], env=env, capture_output=True, text=True, check=False)
    assert out.returncode == 0
    assert out.stdout.startswith("SKIPPED: KUBECONFIG is not set")
