#!/usr/bin/env bash
# The four Secrets deploy/kubernetes mounts (docs/kubernetes.md), made with the project's own commands:
#
#   vllm-disagg-admin-token        token                    the admin API's bearer token (orchestrators)
#   vllm-disagg-orchestrator-curve orchestrator.key_secret  the CurveZMQ server key every replica shares
#   vllm-disagg-agent-public-keys  <agent id>.key           the agents the orchestrators admit
#   vllm-disagg-agent-curve        <agent id>.key_secret,   each agent's key and the orchestrators'
#                                  orchestrator.key         public key (engine pods)
#
# An agent's id is its pod's name (vllm-prefill-0, ..., vllm-decode-0, ...): --prefill N and --decode M
# must be the pools' replicas. With --keys DIR the token and keys are kept there and reused, so a rerun
# with more replicas only adds keys; without it they live in a temporary directory, deleted at the end.
#
#   deploy/kubernetes/make-secrets.sh --prefill 1 --decode 1 --keys ~/vllm-disagg-keys --apply
#   deploy/kubernetes/make-secrets.sh --prefill 1 --decode 1 --out secrets.yaml   # to apply yourself
#
# Needs `vllm-disagg` (or $VLLM_DISAGG) and `kubectl` (or $KUBECTL), which only renders here
# (--dry-run=client) unless --apply is given.
set -euo pipefail

usage() {
    echo "usage: $0 [--namespace NS] [--prefill N] [--decode M] [--keys DIR] (--apply | --out FILE)"
}

namespace=vllm-disagg prefill=1 decode=1 keys="" out="" apply=0
while (($#)); do
    case $1 in
    -n | --namespace) namespace=$2 && shift 2 ;;
    --prefill) prefill=$2 && shift 2 ;;
    --decode) decode=$2 && shift 2 ;;
    --keys) keys=$2 && shift 2 ;;
    --out) out=$2 && shift 2 ;;
    --apply) apply=1 && shift ;;
    -h | --help) usage && exit 0 ;;
    *) usage >&2 && exit 2 ;;
    esac
done
if [[ -z $out && $apply == 0 ]]; then
    usage >&2
    exit 2
fi
vllm_disagg=${VLLM_DISAGG:-vllm-disagg}
kubectl=${KUBECTL:-kubectl}

umask 077 # every file below is the owner's only
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
keys=${keys:-$work/keys}
mkdir -p "$keys"

if [[ ! -s $keys/admin-token ]]; then
    head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$keys/admin-token" # 64 hex digits
fi
if [[ ! -s $keys/orchestrator.key_secret ]]; then
    "$vllm_disagg" keys orchestrator "$keys" >/dev/null
fi
ids=()
for ((i = 0; i < prefill; i++)); do ids+=("vllm-prefill-$i"); done
for ((i = 0; i < decode; i++)); do ids+=("vllm-decode-$i"); done
public=() secret=()
for id in "${ids[@]}"; do
    if [[ ! -s $keys/$id.key_secret ]]; then
        "$vllm_disagg" keys agent "$id" "$keys" >/dev/null
    fi
    public+=("--from-file=$keys/$id.key")
    secret+=("--from-file=$keys/$id.key_secret")
done

create() {
    "$kubectl" create secret generic "$1" --namespace "$namespace" --dry-run=client -o yaml "${@:2}"
}
{
    create vllm-disagg-admin-token "--from-file=token=$keys/admin-token"
    echo ---
    create vllm-disagg-orchestrator-curve "--from-file=$keys/orchestrator.key_secret"
    echo ---
    create vllm-disagg-agent-public-keys "${public[@]}"
    echo ---
    create vllm-disagg-agent-curve "--from-file=$keys/orchestrator.key" "${secret[@]}"
} >"$work/secrets.yaml"

if [[ -n $out ]]; then
    cp "$work/secrets.yaml" "$out"
fi
if ((apply)); then
    "$kubectl" apply -f "$work/secrets.yaml"
fi
echo "secrets for ${#ids[@]} agents (${ids[*]}) in namespace $namespace${out:+: $out}" >&2
