#!/usr/bin/env bash
# Run a sweep in time-boxed pieces, as a lent accelerator runs it one command at a time:
#   scripts/sweep_in_pieces.sh CONFIG OUT SECONDS [MARGIN] [-- extra sweep options]
# Each piece is `memaudit sweep CONFIG --out OUT --stop-after SECONDS`, under a hard limit of
# SECONDS + MARGIN (default 120: one checkpoint stretch and one point's probes) that ends it with
# SIGTERM (the runs it interrupts resume from their last checkpoint); pieces follow each other
# until the sweep ends (exit 0) or fails. One line a piece: its number, exit code and seconds.
# Then `memaudit collect OUT --to OUT.collected` packs what a machine would send back.
set -uo pipefail
config=$1 out=$2 seconds=$3 margin=${4:-120}
shift $(( $# >= 4 ? 4 : 3 ))
[ "${1:-}" = "--" ] && shift
memaudit=${MEMAUDIT:-memaudit}
piece=0 start=$(date +%s)
while :; do
  piece=$((piece + 1)) t0=$(date +%s)
  timeout -s TERM $((seconds + margin)) $memaudit sweep "$config" --out "$out" --stop-after "$seconds" "$@" \
    > "$out.piece$piece.log" 2>&1
  rc=$?
  echo "piece $piece: exit $rc, $(( $(date +%s) - t0 )) s"
  case $rc in
    0) break ;;
    3|124) continue ;;  # stopped at a checkpoint or boundary; or ended by the hard limit
    *) echo "the sweep failed (exit $rc): see $out.piece$piece.log" >&2; exit "$rc" ;;
  esac
done
echo "pieces: $piece, wall: $(( $(date +%s) - start )) s"
$memaudit collect "$out" --to "$out.collected"
