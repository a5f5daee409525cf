"""``bench gateway --compare``: how router commands are read and filled in, and how rounds are summed up."""

from __future__ import annotations

from dataclasses import asdict

import pytest

from vllm_disagg.bench.compare import OURS, Round, parse_compare, render_comparison, router_argv
from vllm_disagg.errors import ConfigError

P = ["http://127.0.0.1:9001", "http://127.0.0.1:9002"]
D = ["http://127.0.0.1:9003"]


def test_a_compared_router_is_a_name_and_a_command_split_at_the_first_equals_sign() -> None:
    assert parse_compare("vr=/opt/vr --policy=round_robin") == ("vr", "/opt/vr --policy=round_robin")


@pytest.mark.parametrize("item", ["no-equals-sign", "=cmd", "name=", f"{OURS}=anything"])
def test_a_malformed_or_ambiguous_compare_item_is_a_config_error(item: str) -> None:
    with pytest.raises(ConfigError, match="--compare"):
        parse_compare(item)


def test_placeholders_become_the_fleets_engines_and_ports_in_vllm_routers_form() -> None:
    argv = router_argv(
        "vr --vllm-pd-disaggregation {prefill_flags} {decode_flags} "
        "--port {port} --prometheus-port {metrics_port}",
        7002,
        P,
        D,
    )
    assert argv == (
        "vr", "--vllm-pd-disaggregation",
        "--prefill", P[0], "--prefill", P[1], "--decode", D[0],
        "--port", "7002", "--prometheus-port", "7003",
    )  # fmt: skip
    assert router_argv("r {prefill_urls} -- {decode_urls}", 1, P, D) == ("r", *P, "--", *D)


def test_an_unknown_placeholder_is_a_config_error_that_lists_the_known_ones() -> None:
    with pytest.raises(ConfigError, match=r"\{prefill_flags\}"):
        router_argv("r --workers {workers}", 7002, P, D)


def _round(router: str, n: int, p99: float, cpu: float) -> dict[str, object]:
    return asdict(Round(router, n, 64, False, 100, 1.0, p99, 500.0, cpu, 0.1 if router == OURS else None))


def test_the_table_shows_medians_over_rounds_their_spread_and_the_ratio_ours_to_theirs() -> None:
    rounds = [_round(OURS, n, p99, cpu) for n, (p99, cpu) in enumerate([(40, 0.5), (50, 0.6), (90, 0.9)])]
    rounds += [_round("vr", n, p99, cpu) for n, (p99, cpu) in enumerate([(20, 0.3), (25, 0.2), (30, 0.4)])]
    report = {
        "engines": "2P2D zero-delay sim",
        "rounds": 3,
        "requests": 100,
        "max_tokens": 64,
        "results": rounds,
    }
    lines = render_comparison(report).splitlines()
    ours = next(line for line in lines if line.startswith(OURS))
    theirs = next(line for line in lines if line.startswith("vr "))
    assert "50.00 [ 40.0- 90.0]" in ours and "0.600 [0.500-0.900]" in ours
    assert "25.00 [ 20.0- 30.0]" in theirs
    assert theirs.split()[-2:] == ["2.00x", "2.00x"], "ours / theirs: cpu 0.6 / 0.3, p99 50 / 25"
