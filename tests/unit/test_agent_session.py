"""The agent's protocol session: Hello backoff (pure) and the reactions to each orchestrator message."""

from __future__ import annotations

import random

import pytest

from vllm_disagg.agent.session import HELLO_BACKOFF_MAX_S, hello_delay


@pytest.mark.parametrize(
    ("attempt", "base"),
    [(0, 0.1), (1, 0.2), (2, 0.4), (3, 0.8), (4, 1.6), (5, 2.0), (100, 2.0)],
    ids=lambda v: str(v),
)
def test_hello_delay_doubles_from_a_tenth_of_a_second_to_two_seconds_with_jitter(
    attempt: int, base: float
) -> None:
    assert hello_delay(attempt, 0.0) == pytest.approx(base / 2)
    assert hello_delay(attempt, 0.999999) == pytest.approx(base, rel=1e-5)


def test_hello_delay_is_never_above_the_cap_nor_zero() -> None:
    rng = random.Random(7)
    delays = [hello_delay(a, rng.random()) for a in range(50) for _ in range(20)]
    assert max(delays) <= HELLO_BACKOFF_MAX_S
    assert min(delays) >= 0.05
    assert len({round(d, 6) for d in delays[-100:]}) > 50  # jittered, not one fixed value
