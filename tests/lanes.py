"""How a parallel run (pytest-xdist, the Makefile's ``-n 4 --dist loadfile``) hands out work.

Each test file is one unit, run whole by one worker, so its module fixtures (clusters, engines,
servers) start once. The real-vLLM files (tests/e2e/vllm/) are the exception: they form ``LANES``
units, a lane being a chain of such files (a folder of them counting as one, as it shares a cluster)
that one worker runs one after the other. Each engine start takes one of two machine-wide engine slots
(tests/e2e/vllm/engine_slots.py); more workers among the real-vLLM files would only wait there while
the rest of the suite could run. The lanes go first (the
collection puts them first, tests/conftest.py): they are the longest chains.
"""

from __future__ import annotations

import pytest
from xdist.scheduler import LoadScopeScheduling
from xdist.workermanage import Producer

VLLM_DIR = "tests/e2e/vllm/"
LANES = 2  # one per engine slot


class LaneScheduling(LoadScopeScheduling):  # type: ignore[misc]  # xdist ships no type hints
    """Units of work: one per file, and ``LANES`` for the real-vLLM files, in collection order."""

    def __init__(self, config: pytest.Config, log: Producer | None = None) -> None:
        super().__init__(config, log)
        # Keep the collection's order: by default xdist would start the files with the most tests.
        config.option.loadscopereorder = False
        self._lanes: dict[str, str] = {}

    def _split_scope(self, nodeid: str) -> str:
        path = nodeid.split("::", 1)[0]
        if not path.startswith(VLLM_DIR):
            return path
        # A folder below is one link of a lane: its files share a cluster (a package fixture).
        link = VLLM_DIR + path[len(VLLM_DIR) :].split("/", 1)[0]
        return self._lanes.setdefault(link, f"vllm-lane-{len(self._lanes) % LANES}")
