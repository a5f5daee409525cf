"""Which traces the flags and OpenTelemetry's standard variables ask for: off unless configured, a flag
over its variable, every bad value refused with what and why."""

from __future__ import annotations

import argparse

import pytest

from vllm_disagg.config import TracingConfig
from vllm_disagg.errors import ConfigError
from vllm_disagg.orchestrator.flags import add_tracing_arguments, tracing_argv, tracing_from_args

URL = "http://collector:4318/v1/traces"


def resolve(argv: list[str], environ: dict[str, str]) -> TracingConfig | None:
    parser = argparse.ArgumentParser()
    add_tracing_arguments(parser)
    return tracing_from_args(parser.parse_args(argv), environ)


@pytest.mark.parametrize(
    ("argv", "environ", "expected"),
    [
        pytest.param([], {}, None, id="nothing-configured-is-off"),
        pytest.param([], {"OTEL_SERVICE_NAME": "x"}, None, id="a-name-alone-is-off"),
        pytest.param(["--otlp-traces-endpoint", URL], {}, TracingConfig(endpoint=URL), id="the-flag"),
        pytest.param(
            [], {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": URL}, TracingConfig(endpoint=URL), id="its-variable"
        ),
        pytest.param(
            [],
            {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"},
            TracingConfig(),
            id="the-base-endpoint",
        ),
        pytest.param(
            [], {"OTEL_TRACES_EXPORTER": "console"}, TracingConfig(exporter="console"), id="console-exporter"
        ),
        pytest.param(
            [],
            {"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": URL},
            None,
            id="exporter-none",
        ),
        pytest.param(["--otlp-traces-endpoint", URL], {"OTEL_SDK_DISABLED": "true"}, None, id="sdk-disabled"),
        pytest.param(
            ["--otlp-traces-endpoint", URL, "--otel-service-name", "gw", "--otlp-protocol", "grpc"],
            {"OTEL_SERVICE_NAME": "ignored", "OTEL_TRACES_SAMPLER": "ParentBased_TraceIdRatio"},
            TracingConfig(
                endpoint=URL, service_name="gw", protocol="grpc", sampler="parentbased_traceidratio"
            ),
            id="flags-over-variables",
        ),
        pytest.param(
            ["--otlp-traces-endpoint", URL],
            {"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.25"},
            TracingConfig(endpoint=URL, sampler="traceidratio", sampler_arg="0.25"),
            id="a-sampled-share",
        ),
    ],
)
def test_traces_are_on_only_when_an_exporter_or_endpoint_is_configured(
    argv: list[str], environ: dict[str, str], expected: TracingConfig | None
) -> None:
    assert resolve(argv, environ) == expected


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}, "tracing.protocol must be one of"),
        ({"OTEL_TRACES_SAMPLER": "sometimes"}, "tracing.sampler must be one of"),
        (
            {"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "2"},
            r"ratio in \[0, 1\], got '2'",
        ),
        ({"OTEL_TRACES_SAMPLER_ARG": "half"}, "ratio in"),
        ({"OTEL_TRACES_EXPORTER": "zipkin"}, "tracing.exporter must be one of"),
    ],
)
def test_a_bad_setting_is_refused_with_what_and_why(environ: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        resolve(["--otlp-traces-endpoint", URL], environ)


def test_a_bad_setting_is_refused_even_where_nothing_turns_tracing_on() -> None:
    with pytest.raises(ConfigError, match=r"tracing\.sampler must be one of"):
        resolve(["--otel-traces-sampler", "sometimes"], {})


def test_up_forwards_exactly_the_tracing_flags_it_was_given() -> None:
    parser = argparse.ArgumentParser()
    add_tracing_arguments(parser)
    args = parser.parse_args(["--otlp-traces-endpoint", URL, "--otel-traces-sampler", "always_on"])
    assert tracing_argv(args) == ("--otlp-traces-endpoint", URL, "--otel-traces-sampler", "always_on")
