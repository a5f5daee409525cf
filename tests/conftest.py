"""Test-wide configuration: the tiers, and the environment every test runs in.

Every test belongs to one tier, the top folder it lives in, and carries that tier's marker (so
``pytest -m unit`` or ``-m "not e2e"`` picks tiers; docs/testing.md says what each is for). A test
that starts real vLLM engines (it asks for the tiny model) also carries ``vllm``. A test outside the
tier folders is a usage error, not a test without a tier.

Every orchestrator the tests start, in-process or as a child (``up``, ``vllm-disagg orchestrator``),
guards its admin API with one known token: children read it from ``VLLM_DISAGG_ADMIN_TOKEN``, as an
operator's would; test code sends ``tests.helpers.ADMIN``.
"""

import os
from pathlib import Path

import pytest
from xdist.workermanage import Producer

from tests.helpers import ADMIN_TOKEN
from tests.lanes import LaneScheduling
from vllm_disagg.orchestrator.admin.auth import ENV_ADMIN_TOKEN

os.environ[ENV_ADMIN_TOKEN] = ADMIN_TOKEN

# vLLM 0.32 renders a chat template under a 30 s watchdog (a 500 when it fires). The tiny model's
# template renders in milliseconds, so only a frozen machine can fire it: a fresh-clone run that froze
# for 27 s got a 500 from it. No deadline for the engines the tests start (they inherit this
# environment); the product leaves vLLM's default alone.
os.environ["VLLM_CHAT_TEMPLATE_RENDER_TIMEOUT"] = "0"


TIERS = ("unit", "integration", "e2e", "chaos", "fuzz", "browser")
ORDER = ("e2e", "chaos", "browser", "integration", "fuzz", "unit")
_TESTS = Path(__file__).parent


def _tier(item: pytest.Item) -> str:
    parts = item.path.relative_to(_TESTS).parts
    if len(parts) < 2 or parts[0] not in TIERS:
        raise pytest.UsageError(f"{item.nodeid}: every test lives in a tier folder, one of {TIERS}")
    return parts[0]


def _real_vllm(item: pytest.Item) -> bool:
    """It starts real vLLM engines: it asks for the tiny model. Such tests live in tests/e2e/vllm."""
    wants = "tiny_model" in getattr(item, "fixturenames", ())
    lives = item.path.is_relative_to(_TESTS / "e2e" / "vllm")
    if wants != lives:
        raise pytest.UsageError(f"{item.nodeid}: a test that starts vLLM lives in tests/e2e/vllm, no other")
    return wants


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Each test gets its tier's marker, and ``vllm`` where it starts real engines. The real-vLLM
    tests go first, then the tiers longest first (tests/lanes.py: a parallel run keeps this order)."""
    for item in items:
        item.add_marker(_tier(item))
        if _real_vllm(item):
            item.add_marker("vllm")
    items.sort(key=lambda item: (item.get_closest_marker("vllm") is None, ORDER.index(_tier(item))))


def pytest_xdist_make_scheduler(config: pytest.Config, log: Producer) -> LaneScheduling | None:
    """``--dist loadfile`` runs in lanes (tests/lanes.py); any other ``--dist`` is xdist's own."""
    return LaneScheduling(config, log) if config.getvalue("dist") == "loadfile" else None
