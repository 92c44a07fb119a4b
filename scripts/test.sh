#!/usr/bin/env bash
# Set up (CPU) and run the whole test suite. `.ci/run` calls exactly this.
set -euo pipefail
cd "$(dirname "$0")/.."
MEMAUDIT_BROWSER=1 bash scripts/setup.sh
. .venv/bin/activate
export XLA_FLAGS="${XLA_FLAGS:---xla_force_host_platform_device_count=8}"
exec python -m pytest -q --durations=20 "$@"
