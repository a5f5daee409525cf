"""An instance's topology labels (``InstanceInfo.labels``): from ``--label KEY=VALUE`` flags over the
environment a deployment sets (``VLLM_DISAGG_NODE``, ``VLLM_DISAGG_ZONE``, ``VLLM_DISAGG_DOMAIN``; a
Kubernetes pod gets the first from the downward API). docs/agent.md, "Topology labels"."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence

from vllm_disagg.errors import ConfigError
from vllm_disagg.protocol.messages import LABEL_DOMAIN, LABEL_NODE, LABEL_ZONE, label_problem

Labels = tuple[tuple[str, str], ...]

# Environment variable -> the label it sets (a --label of the same key wins).
ENV_LABELS: Mapping[str, str] = {
    "VLLM_DISAGG_NODE": LABEL_NODE,
    "VLLM_DISAGG_ZONE": LABEL_ZONE,
    "VLLM_DISAGG_DOMAIN": LABEL_DOMAIN,
}


def parse_label(text: str) -> tuple[str, str]:
    """``KEY=VALUE`` as a (key, value) pair; ``argparse.ArgumentTypeError`` otherwise."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key, value


def parse_instance_label(text: str) -> tuple[str, str, str]:
    """``AGENT_ID:KEY=VALUE`` (``up --instance-label``) as (agent id, key, value)."""
    agent_id, sep, label = text.partition(":")
    if not sep or not agent_id:
        raise argparse.ArgumentTypeError(f"expected AGENT_ID:KEY=VALUE, got {text!r}")
    return (agent_id, *parse_label(label))


def add_label_arguments(parser: argparse.ArgumentParser) -> None:
    """The repeatable ``--label KEY=VALUE`` flag."""
    parser.add_argument(
        "--label",
        dest="labels",
        action="append",
        type=parse_label,
        default=[],
        metavar="KEY=VALUE",
        help="a topology label, repeatable (node, zone, domain: docs/scheduler.md); over "
        + ", ".join(ENV_LABELS),
    )


def resolve_labels(flags: Sequence[tuple[str, str]], env: Mapping[str, str] | None = None) -> Labels:
    """The labels the environment sets, overridden by the flags (the last of a repeated key wins),
    sorted by key; ``ConfigError`` past ``label_problem``'s bounds. An empty variable sets nothing."""
    env = os.environ if env is None else env
    labels = {key: env[var] for var, key in ENV_LABELS.items() if env.get(var)}
    labels.update(flags)
    problem = label_problem(labels)
    if problem is not None:
        raise ConfigError(f"agent labels: {problem}")
    return tuple(sorted(labels.items()))


def labels_from_args(args: argparse.Namespace) -> Labels:
    """``resolve_labels`` of the parsed ``--label`` flags and this process's environment."""
    return resolve_labels(getattr(args, "labels", None) or [])
