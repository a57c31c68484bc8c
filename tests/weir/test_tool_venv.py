"""A load generator's cached venv: where it lives, when it counts as built, and the error
when the Python it needs is not here (no install is run: that needs the package index)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from weir.benchmarks._tool_venv import STAMP, ToolVenv, ToolVenvError


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("PYENV_ROOT", str(tmp_path / "no-pyenv"))
    return tmp_path


def test_a_venv_is_ready_only_with_a_stamp_from_its_own_pins(cache: Path) -> None:
    venv = ToolVenv("some-tool", "1.0", (3, 12), ("dep==2",))
    assert venv.folder == cache / "weir" / "some-tool" / "1.0" / "venv"
    assert not venv.ready()
    venv.folder.mkdir(parents=True)
    (venv.folder / STAMP).write_text(json.dumps({"key": venv.key}))
    assert venv.ready()
    assert venv.ensure() == venv.folder  # nothing to build
    repinned = ToolVenv("some-tool", "1.0", (3, 12), ("dep==3",))
    assert repinned.key != venv.key
    assert not repinned.ready()


def test_a_missing_python_is_a_clear_error(cache: Path) -> None:
    venv = ToolVenv("some-tool", "1.0", (3, 99), ())
    with pytest.raises(ToolVenvError, match=r"some-tool 1.0 needs python3\.99"):
        venv.ensure()
    assert not venv.ready()
