#!/bin/sh
# CPU instructions per scheduling decision of the checkout TREE (default: this one), counted by
# cachegrind: PART is decide (default), snapshot, lookup, decode or prefill; further flags go to `bench scheduler`'s
# cluster (default here: 20,000 blocks, to keep the build short under valgrind). Two trees side by side:
#   git worktree add /tmp/base REV
#   scripts/scheduler_instructions.sh /tmp/base; scripts/scheduler_instructions.sh .
set -eu
HERE=$(cd "$(dirname "$0")/.." && pwd)
TREE=$(cd "${1:-$HERE}" && pwd); PART=${2:-decide}
[ $# -ge 2 ] && shift 2 || shift $#
count() {
  rounds=$1; shift
  # From / : `python file` puts the script's folder first on sys.path, and PYTHONPATH before the venv.
  (cd / && PYTHONHASHSEED=0 PYTHONPATH="$TREE" valgrind --tool=cachegrind --cache-sim=no \
    --cachegrind-out-file=/dev/null "$HERE/.venv/bin/python" "$HERE/scripts/scheduler_instructions.py" \
    "$rounds" "$PART" --blocks 20000 "$@" 2>&1) | sed -n 's/.*I *refs: *//p' | tr -d ,
}
one=$(count 1 "$@"); six=$(count 6 "$@")
echo "$TREE $PART: $(( (six - one) / 1500 )) instructions per decision"
