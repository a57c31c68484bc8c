"""`weir bench fleet --compiled`: mypyc's build of the simulator gives exactly the
recorded results of the interpreted one (`tests/fleetsim/identical_cells.py`), a
compiled run imports the build and nothing else, and a changed source is a new build.

The build is the real one, made by mypyc in the user's cache (about two minutes on two
cores the first time for a source version, then found there)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fleetsim.identical_cells import assert_recorded
from weir.benchmarks._compiled_sim import (
    BUILD_ENV,
    PACKAGES,
    CompiledSimError,
    build_key,
    compiled_env,
    ensure_build,
    running_compiled,
    source_root,
)
from weir.cli import main

_IDENTICAL = """
import json, sys
from weir.benchmarks._compiled_sim import running_compiled
assert running_compiled()
from fleetsim.sim import is_baseline
assert not is_baseline("weir") and not is_baseline("oracle") and is_baseline("round_robin")
from tests.fleetsim.identical_cells import summaries
json.dump(summaries(), sys.stdout)
"""


@pytest.fixture(scope="module")
def build() -> Path:
    return ensure_build()


@pytest.mark.slow
def test_the_compiled_simulator_gives_the_recorded_identical_cells(
    build: Path, tmp_path: Path
) -> None:
    env = compiled_env(build)
    # The checkout after the build, for `tests`: the build's packages come first.
    env["PYTHONPATH"] += os.pathsep + str(source_root())
    done = subprocess.run(
        [sys.executable, "-P", "-c", _IDENTICAL],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert_recorded(json.loads(done.stdout))


@pytest.mark.slow
def test_bench_fleet_compiled_runs_in_a_child_on_the_build(build: Path, tmp_path: Path) -> None:
    out = tmp_path / "report"
    argv = ["bench", "fleet", "--compiled", "--scenario", "few_long_many_short"]
    argv += ["--policies", "weir,round_robin", "--engines", "2", "--duration", "4"]
    argv += ["--sweep", "", "--jobs", "1", "--out", str(out)]
    assert main(argv) == 0
    report = json.loads((out / "report.json").read_text())
    assert {cell["policy"] for cell in report["cells"]} == {"weir", "round_robin"}
    # Weir is compared with the baseline, not with itself: policy names are read from
    # module constants (a compiled class's attribute is its descriptor).
    assert [row["goodput_best_baseline"] for row in report["goals"]] == ["round_robin"]


def test_a_run_started_on_a_build_that_imports_the_interpreted_simulator_is_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(BUILD_ENV, raising=False)
    assert not running_compiled()
    monkeypatch.setenv(BUILD_ENV, str(tmp_path))
    with pytest.raises(CompiledSimError, match=r"imported .*loop\.py"):
        running_compiled()


def test_any_changed_file_of_the_three_packages_is_a_new_build(tmp_path: Path) -> None:
    root = source_root()
    for package in PACKAGES:
        shutil.copytree(root / package, tmp_path / package)
    key = build_key(tmp_path)
    assert build_key(root) == key  # where the packages live is not part of it
    data = next((tmp_path / "controlplane").rglob("*.lua"))
    data.write_text(data.read_text() + "\n")
    assert build_key(tmp_path) != key


def test_no_c_compiler_is_a_clear_error_and_leaves_no_build(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("CC", "no-such-compiler")
    with pytest.raises(CompiledSimError, match=r"no C compiler"):
        ensure_build()
    assert [p.name for p in (tmp_path / "weir" / "compiled-sim").iterdir()] == [".lock"]
