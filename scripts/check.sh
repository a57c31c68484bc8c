#!/usr/bin/env bash
# Runs every check in order and stops at the first failure. `--no-tests` skips pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bin=.venv/bin
export PATH="$PWD/.cache/bin:$PATH"
step() { printf '\n== %s ==\n' "$*"; }

step "format (ruff format --check)"; $bin/ruff format --check .
step "lint (ruff check)";            $bin/ruff check .
step "types (mypy --strict)";        $bin/mypy
step "import contracts";             PYTHONPATH=operator $bin/lint-imports
if [ "${1:-}" != "--no-tests" ]; then
  # The slowest tests, printed: the CI time budget (docs/testing.md) is kept with them.
  # One process by default: two workers were no faster on a 2-core machine (docs/testing.md).
  # WEIR_TEST_WORKERS=N runs N; the tiers that share one costly server keep to one worker.
  step "tests (pytest)";             $bin/pytest -q --durations=25 \
                                       -n "${WEIR_TEST_WORKERS:-0}" --dist loadgroup
fi
