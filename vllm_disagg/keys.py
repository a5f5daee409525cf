"""``vllm-disagg keys``: make CurveZMQ keypairs for the orchestrator and its agents (docs/security.md).

``vllm-disagg keys orchestrator DIR`` writes ``DIR/orchestrator.key`` and ``.key_secret``;
``vllm-disagg keys agent ID DIR`` writes ``DIR/ID.key`` and ``DIR/ID.key_secret``. Copy ``ID.key`` into
the orchestrator's ``--agent-keys`` directory (its name binds the key to the agent id); give the agent
``ID.key_secret`` and ``orchestrator.key``. Secret files are created readable by their owner only.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from vllm_disagg.errors import ConfigError
from vllm_disagg.protocol.curve import make_keypair

_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``keys``."""
    parser.add_argument("kind", choices=("orchestrator", "agent"), help="whose keypair")
    parser.add_argument("names", nargs="+", metavar="[ID] DIR", help="agent: the agent id, then DIR")


def run(args: argparse.Namespace) -> int:
    """Write the keypair; print the two paths."""
    if args.kind == "orchestrator":
        if len(args.names) != 1:
            raise ConfigError("usage: vllm-disagg keys orchestrator DIR")
        name, directory = "orchestrator", args.names[0]
    else:
        if len(args.names) != 2:
            raise ConfigError("usage: vllm-disagg keys agent ID DIR")
        name, directory = args.names
        if not _ID.fullmatch(name):
            raise ConfigError(
                f"an agent id names a file: letters, digits, '.', '_' and '-' only, got {name!r}"
            )
    public, secret = make_keypair(Path(directory), name)
    print(f"public: {public}\nsecret: {secret}")
    return 0
