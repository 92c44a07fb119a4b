#!/bin/bash
# One piece of configs/study-tpu.yaml on a lent TPU machine, one 10-minute command at a time:
#   bash scripts/study_tpu_piece.sh ONLY STOP_AFTER HARD_LIMIT [collect]
# e.g. bash scripts/study_tpu_piece.sh '*-tiny-*' 470 550   (carry: [".whl-tpu"]); HARD_LIMIT
# counts from the command's start (the first call's install comes off it)
# The first call on a machine installs the wheels carried in .whl-tpu (docs/accelerators.md),
# torch's CPU build from the host's /opt/wheels and matplotlib from its index. The sweep folder
# and the compilation cache live in the machine's /tmp, which stays between its commands. Exit 3
# of the sweep: stopped in time, call again; 0: this part is complete. With `collect` (or when
# the part is complete) what comes back is written under $OUT: `memaudit collect`'s archive.
# The sweep writes no report on the machine (--no-report): it is built at home from all parts.
# SWEEP_OUT (default /tmp/study-tpu/sweep) and SWEEP_ARGS (e.g. "--set KEY=VALUE ...") run a
# variant of the study beside it on the same machine, e.g. a federated setting tried at tiny;
# COLLECT_AS names the archive (default: the sweep folder's name; scripts/study_tpu_variants.sh
# runs several variants of one point in one folder, each collected under its own name).
set -u
only=$1 stop_after=$2 hard=$3
t0=$(date +%s)
. scripts/tpu_env.sh || exit 9
export JAX_COMPILATION_CACHE_DIR=/tmp/study-tpu/jax-cache
cat > /tmp/memaudit <<'EOS'
#!/bin/sh
exec python3 -c 'import sys; sys.argv[0] = "memaudit"; from memaudit.cli import main; main()' "$@"
EOS
chmod +x /tmp/memaudit
export PATH=/tmp:$PATH
out=${SWEEP_OUT:-/tmp/study-tpu/sweep}
mkdir -p /tmp/study-tpu "${OUT:-/tmp/study-tpu/out}"
log=/tmp/study-tpu/piece.$(date +%s).log
t1=$(date +%s)
# the hard limit counts from the command's start: an install's seconds come off it (a first call
# of 34 s install + 585 s once ran past the call's 600 s and was killed from outside)
hard=$(( hard - (t1 - t0) ))
stop_after=$(( stop_after < hard - 30 ? stop_after : hard - 30 ))
# shellcheck disable=SC2086  # SWEEP_ARGS: several words
timeout -s TERM "$hard" memaudit sweep configs/study-tpu.yaml --only "$only" --out "$out" \
  --stop-after "$stop_after" --no-report ${SWEEP_ARGS:-} > "$log" 2>&1
rc=$?
echo "sweep piece: exit $rc, $(( $(date +%s) - t1 )) s"
tail -c 3000 "$log"
if [ "${4:-}" = collect ] || [ $rc = 0 ]; then
  name=study; [ -n "${SWEEP_OUT:-}" ] && name=$(basename "$out")
  name=${COLLECT_AS:-$name}
  memaudit collect "$out" --to "${OUT:-/tmp/study-tpu/out}/$name"
fi
echo "total $(( $(date +%s) - t0 )) s"
