#!/bin/sh
# Another commit's orchestrator as a router for `vllm-disagg bench gateway --compare`, so two commits
# are measured side by side in one run (docs/benchmarks.md):
#   git worktree add /tmp/base REV
#   vllm-disagg bench gateway --compare "base=scripts/compare_worktree.sh /tmp/base {port} P {prefill_urls} D {decode_urls}"
# The orchestrator is exec'd in the measured process group, as ours is; its agents (`connect`, one per
# engine) run in sessions of their own, so, as ours, they are not in its CPU figure; stop them after
# the run with `pkill -f compare-agent-`.
set -eu
TREE=$1; PORT=$2; shift 2
ZMQ=$((PORT + 51))
PY=${PYTHON:-$(cd "$(dirname "$0")/.." && pwd)/.venv/bin/python}
export PYTHONPATH="$TREE"
# From the tree itself: `python -c` puts the working directory before PYTHONPATH on sys.path, so run
# from another checkout it would measure that checkout instead of this one.
cd "$TREE"
# The command's entry point, in the layout of either side of the move to cli/ (issue 25).
CLI="try:
    from vllm_disagg.cli.commands import main
except ImportError:
    from vllm_disagg.cli import main
raise SystemExit(main())"
role=prefill; i=0
for arg in "$@"; do
  case $arg in
    P) role=prefill ;;
    D) role=decode ;;
    *) setsid "$PY" -c "$CLI" connect --orchestrator "tcp://127.0.0.1:$ZMQ" --url "$arg" --role $role \
         --agent-id "compare-agent-$role-$i" > /dev/null 2>&1 &
       i=$((i + 1)) ;;
  esac
done
exec "$PY" -c "$CLI" orchestrator --host 127.0.0.1 --port "$PORT" --zmq-endpoint "tcp://127.0.0.1:$ZMQ" \
  --heartbeat-interval-s 0.25 --heartbeat-timeout-s 1.0 --connect-timeout-s 2.0 --no-preload-tokenizer-libs
