"""``--command-log FILE``: one JSON line per command the agent received, carried out or refused.

The line is written (and flushed) before an accepted command is carried out, so the file orders what
the agent did by leadership term: the replicated control plane's tests read it to prove that two
leaders never acted on one agent at once. Fields (docs/agent.md#the-command-log): ``t`` (wall time),
``mono`` (monotonic time), ``id``, ``kind``, ``epoch``, ``from`` (the orchestrator endpoint it came
on), ``accepted``, ``code`` and ``error`` (of a refusal; "" otherwise). Never a command's payload: a
grant's token authorizes a fetch of prompts' KV.
"""

from __future__ import annotations

import time
from typing import BinaryIO

from vllm_disagg import jsonutil
from vllm_disagg.errors import ConfigError
from vllm_disagg.protocol.messages import Command


class CommandLog:
    """An append-only file of the commands received, one JSON object a line."""

    def __init__(self, file: BinaryIO) -> None:
        self._file = file
        self.lines = 0

    @classmethod
    def open(cls, path: str) -> CommandLog:
        """Append to ``path`` (created if missing); ``ConfigError`` when it cannot be written."""
        try:
            return cls(open(path, "ab"))  # for the agent's life: close() closes it
        except OSError as exc:
            raise ConfigError(f"agent.command_log: cannot write {path!r}: {exc.strerror or exc}") from exc

    def record(
        self, command: Command, origin: str, *, accepted: bool, code: str = "", error: str = ""
    ) -> None:
        """One line for ``command``, received from ``origin``; on the disk's way before this returns."""
        line = {
            "t": time.time(),
            "mono": time.monotonic(),
            "id": command.id,
            "kind": command.kind,
            "epoch": command.epoch,
            "from": origin,
            "accepted": accepted,
            "code": code,
            "error": error,
        }
        # A small write per command (they come per KV move at most): cheaper than a thread hop.
        self._file.write(jsonutil.dumps(line) + b"\n")
        self._file.flush()
        self.lines += 1

    def close(self) -> None:
        """Close the file."""
        self._file.close()
