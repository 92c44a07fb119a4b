#!/usr/bin/env bash
# Set up (CPU) and run the main job on the embedded default: synthetic corpus, tiny model.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
memaudit train configs/tiny.yaml --out runs/tiny --overwrite
