#!/usr/bin/env bash
# The KV connector's GPU copy path (docs/kv-pool.md, "The GPU path"), measured with torch alone: no
# vLLM, no network, none of the project's other dependencies. Writes a JSON of GB/s per direction
# against a plain pinned-memory copy of the same bytes; under 5 minutes.
#
#   scripts/gpu_check.sh [OUT.json] [gpu_check flags: --device cuda:1, --layers 32, --blocks 256, ...]
#   PYTHON=/path/to/python scripts/gpu_check.sh        # a Python other than python3
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out=gpu_check.json
if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then out="$1"; shift; fi
out="$(realpath -m "$out")"  # before the cd: a relative path is the caller's
cd "$root"
PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" exec timeout 300 "${PYTHON:-python3}" \
    -m vllm_disagg.agent.kv.gpu_check --out "$out" "$@"
