#!/usr/bin/env bash
# Set up (CPU) and run the main job on the embedded default: a tiny model pretrained on a public
# synthetic corpus, then fine-tuned on private users (PII, canaries) with both backends, without
# DP and at two target epsilons; then probes and one report in runs/quickstart/report/.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
memaudit sweep configs/quickstart.yaml --out runs/quickstart
echo "open runs/quickstart/report/report.html"
