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
  # Two workers: most tests wait on the servers they start, so two share two cores well;
  # the tiers that share one costly server keep to one worker (tests/conftest.py).
  step "tests (pytest)";             $bin/pytest -q --durations=25 \
                                       -n "${WEIR_TEST_WORKERS:-2}" --dist loadgroup
fi
