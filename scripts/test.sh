#!/usr/bin/env bash
# Set up (CPU) and run the whole test suite. `.ci/run` calls exactly this.
# Two pytest workers (pytest-xdist, one test file per worker at a time so that a file's module
# fixtures are built once): most tests use one core, so the suite runs about twice as fast on
# the 2 cores CI has. MEMAUDIT_TEST_WORKERS=0 runs it in one process (e.g. to debug).
set -euo pipefail
cd "$(dirname "$0")/.."
MEMAUDIT_BROWSER=1 bash scripts/setup.sh
. .venv/bin/activate
export XLA_FLAGS="${XLA_FLAGS:---xla_force_host_platform_device_count=8}"
workers="${MEMAUDIT_TEST_WORKERS:-2}"
if [ "$workers" = "0" ]; then
    exec python -m pytest -q --durations=20 "$@"
fi
exec python -m pytest -q -n "$workers" --dist loadfile --durations=20 "$@"
