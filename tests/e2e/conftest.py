"""What every e2e test shares: a failed test shows its cluster's log."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

LOG_TAIL_LINES = 120


def _telling(line: str) -> bool:
    """Not an engine's access log line: the agents scrape /metrics and /health several times a second,
    and those lines would push what the orchestrator and agents said out of the tail."""
    return not (
        line.startswith("INFO:     127.0.0.1:") and ('"GET /metrics' in line or '"GET /health' in line)
    )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """A failed test that holds a cluster (a fixture with a ``log`` path) shows that log's last lines:
    what the orchestrator, agents and engines said is the first thing to read, and CI keeps no files."""
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    if not report.failed:
        return
    for value in getattr(item, "funcargs", {}).values():
        log = getattr(value, "log", None)
        if isinstance(log, Path) and log.exists():
            lines = [x for x in log.read_text(errors="replace").splitlines() if _telling(x)][-LOG_TAIL_LINES:]
            report.sections.append((f"{log}, last lines", "\n".join(line[:400] for line in lines)))
