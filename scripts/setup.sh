#!/usr/bin/env bash
# Set up memaudit in ./.venv for the CPU: torch pinned to the CPU build (constraints-cpu.txt).
# GPU users: create the venv yourself, install a CUDA torch and `pip install -e ".[dev,gpu]"`.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null 2>&1 || PY=python3
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q -c constraints-cpu.txt -e ".[dev,flower]"
if [ "${MEMAUDIT_BROWSER:-0}" = "1" ]; then
  bash scripts/install_browser.sh
fi
