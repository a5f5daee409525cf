"""The margin admission keeps (``admission.slack``): a high quantile of how much later than predicted
first tokens came, over the recent requests only, never below zero, and none before there is enough
to go on."""

from __future__ import annotations

import math

from vllm_disagg.orchestrator.admission.slack import MIN_SAMPLES, Slack


def test_no_margin_before_enough_requests_were_seen() -> None:
    slack = Slack()
    for _ in range(MIN_SAMPLES - 1):
        slack.observe(2.0, 0.5, 0.5)  # a second later than predicted
    assert slack.value() == 0.0
    slack.observe(2.0, 0.5, 0.5)
    assert slack.value() == 1.0


def test_the_margin_is_the_ninetieth_percentile_of_the_residuals() -> None:
    slack = Slack(window=100)
    for i in range(100):  # residuals 0.00 .. 0.99 s, in any order
        slack.observe(1.0 + (i * 37 % 100) / 100, 0.4, 0.6)
    assert math.isclose(slack.value(), 0.90)


def test_early_first_tokens_give_no_negative_margin() -> None:
    slack = Slack()
    for _ in range(MIN_SAMPLES):
        slack.observe(0.3, 0.0, 0.5)
    assert slack.value() == 0.0


def test_only_the_last_window_counts() -> None:
    slack = Slack(window=MIN_SAMPLES)
    for _ in range(MIN_SAMPLES):
        slack.observe(3.0, 0.0, 1.0)  # 2 s late, long ago
    for _ in range(MIN_SAMPLES):
        slack.observe(1.1, 0.0, 1.0)
    assert math.isclose(slack.value(), 0.1) and len(slack) == MIN_SAMPLES


def test_a_figure_that_is_not_a_number_is_left_out() -> None:
    slack = Slack()
    slack.observe(float("nan"), 0.0, 1.0)
    assert len(slack) == 0


def test_a_request_without_a_prediction_is_left_out() -> None:
    """Its pair was gone at the check (``fit`` answered without predicting): its whole TTFT is no error
    of a prediction."""
    slack = Slack()
    slack.observe(2.0, 0.0, 0.0)
    slack.observe(2.0, 0.0, -1.0)
    assert len(slack) == 0
