#!/bin/bash
# Variants of one point of configs/study-tpu.yaml in one 10-minute command on a lent TPU machine,
# sharing one sweep folder (its data and public base are made once):
#   bash scripts/study_tpu_variants.sh POINT TOTAL NAME='--set KEY=VALUE ...' ...
# e.g. bash scripts/study_tpu_variants.sh federated-tiny-eps8-s0 585 \
#        clip02='--set per_backend.federated.privacy.clip=0.2' \
#        aclip='--set per_backend.federated.privacy.adaptive_clipping.enabled=true'
# Each variant retrains the point with its settings (--overwrite: the base and data stay, as
# their configs do not change) and is collected at once under $OUT/NAME.tar.gz (probes.json, the
# run's metrics and the base's reference run; no weights), so a later variant replacing the point
# on the machine loses nothing that comes back. TOTAL: seconds for all of them from this
# command's start; a variant starts only with at least 100 s left.
set -u
point=$1 total=$2
shift 2
t0=$(date +%s)
export SWEEP_OUT=${SWEEP_OUT:-/tmp/study-tpu/variants}
for v in "$@"; do
  name=${v%%=*} sets=${v#*=}
  left=$(( total - ($(date +%s) - t0) ))
  if [ "$left" -lt 100 ]; then echo "variant $name: not started, $left s left"; continue; fi
  echo "== variant $name: $sets ($left s left)"
  COLLECT_AS=$name SWEEP_ARGS="--overwrite $sets" bash scripts/study_tpu_piece.sh "$point" \
    $(( left - 25 )) "$left" collect
done
echo "variants: $(( $(date +%s) - t0 )) s"
