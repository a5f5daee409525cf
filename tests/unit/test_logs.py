"""JSON log lines: one object a line, the request's ids on every line logged while it is served."""

from __future__ import annotations

import asyncio
import io
import logging
import re
from collections.abc import Callable, Iterator

import pytest

from vllm_disagg import jsonutil, logs
from vllm_disagg.trace_context import parse_trace_id

CLIENT_TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
HEX32 = re.compile(r"[0-9a-f]{32}")


Read = Callable[[], list[dict[str, object]]]


@pytest.fixture
def read() -> Iterator[Read]:
    """What the JSON formatter wrote for the logger ``t`` so far, each line parsed back."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logs.JsonFormatter("orchestrator"))
    logger = logging.getLogger("t")
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    try:
        yield lambda: [jsonutil.loads(line) for line in stream.getvalue().splitlines()]
    finally:
        logger.removeHandler(handler)
        logger.propagate = True


def test_a_line_is_one_json_object_with_time_level_logger_process_and_message(
    read: Read,
) -> None:
    logging.getLogger("t").warning("two\nlines and %s", "ünïcode")
    [line] = read()
    assert line["msg"] == "two\nlines and ünïcode"
    assert (line["level"], line["logger"], line["process"]) == ("WARNING", "t", "orchestrator")
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", str(line["ts"]))
    assert "request_id" not in line and "trace_id" not in line, "no request is being served"


def test_an_exception_travels_in_its_line(read: Read) -> None:
    try:
        raise ValueError("the cause")
    except ValueError:
        logging.getLogger("t").exception("it failed")
    [line] = read()
    assert "ValueError: the cause" in str(line["exc"]) and "Traceback" in str(line["exc"])


def test_lines_while_a_request_is_served_carry_its_id_and_the_clients_trace_id(
    read: Read,
) -> None:
    token = logs.bind("req-1", CLIENT_TRACEPARENT)
    logging.getLogger("t").info("about req-1")
    logs.unbind(token)
    logging.getLogger("t").info("about nothing")
    first, second = read()
    assert (first["request_id"], first["trace_id"]) == ("req-1", "4bf92f3577b34da6a3ce929d0e0e4736")
    assert "request_id" not in second


@pytest.mark.parametrize("traceparent", [None, "", "garbage", "00-" + "0" * 32 + "-00f067aa0ba902b7-01"])
def test_without_a_valid_traceparent_a_request_gets_one_new_trace_id_for_all_its_lines(
    read: Read, traceparent: str | None
) -> None:
    token = logs.bind("req-2", traceparent)
    logging.getLogger("t").info("one")
    logging.getLogger("t").info("two")
    logs.unbind(token)
    token = logs.bind("req-3", traceparent)
    logging.getLogger("t").info("three")
    logs.unbind(token)
    one, two, three = read()
    assert HEX32.fullmatch(str(one["trace_id"])) and one["trace_id"] != "0" * 32
    assert one["trace_id"] == two["trace_id"], "one request, one trace"
    assert three["trace_id"] != one["trace_id"], "another request, another trace"


async def test_tasks_a_request_starts_inherit_its_ids_and_concurrent_requests_keep_their_own(
    read: Read,
) -> None:
    async def serve(request_id: str, started: asyncio.Event, go: asyncio.Event) -> None:
        token = logs.bind(request_id, None)
        try:
            started.set()
            await go.wait()  # both requests are being served at once

            async def leg() -> None:
                logging.getLogger("t").info("leg of %s", request_id)

            await asyncio.create_task(leg())
            logging.getLogger("t").info("end of %s", request_id)
        finally:
            logs.unbind(token)

    go = asyncio.Event()
    a, b = asyncio.Event(), asyncio.Event()
    tasks = [asyncio.create_task(serve("A", a, go)), asyncio.create_task(serve("B", b, go))]
    await a.wait()
    await b.wait()
    go.set()
    await asyncio.gather(*tasks)
    logging.getLogger("t").info("after")
    by_msg = {str(line["msg"]): line.get("request_id") for line in read()}
    assert by_msg == {"leg of A": "A", "end of A": "A", "leg of B": "B", "end of B": "B", "after": None}


def test_configure_installs_one_handler_in_the_format_asked_and_children_get_the_same_flags() -> None:
    root = logging.getLogger()
    saved, level = root.handlers[:], root.level
    try:
        logs.configure("debug", "json", "worker-1")
        assert len(root.handlers) == 1 and isinstance(root.handlers[0].formatter, logs.JsonFormatter)
        assert root.level == logging.DEBUG
        assert logs.child_argv() == ["--log-level", "DEBUG", "--log-format", "json"]
        logs.configure("INFO", "text")
        assert len(root.handlers) == 1 and not isinstance(root.handlers[0].formatter, logs.JsonFormatter)
        assert logs.child_argv() == ["--log-level", "INFO", "--log-format", "text"]
        with pytest.raises(ValueError, match="log format"):
            logs.configure("INFO", "xml")
    finally:
        root.handlers[:] = saved
        root.setLevel(level)


@pytest.mark.parametrize(
    ("header", "trace_id"),
    [
        pytest.param(CLIENT_TRACEPARENT, "4bf92f3577b34da6a3ce929d0e0e4736", id="valid"),
        pytest.param(f" {CLIENT_TRACEPARENT}\t", "4bf92f3577b34da6a3ce929d0e0e4736", id="surrounding-blanks"),
        pytest.param(
            "cc-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-more",
            "4bf92f3577b34da6a3ce929d0e0e4736",
            id="a-later-version-may-add-fields",
        ),
        pytest.param(CLIENT_TRACEPARENT + "-more", None, id="version-00-adds-nothing"),
        pytest.param(CLIENT_TRACEPARENT.upper(), None, id="upper-case"),
        pytest.param("ff" + CLIENT_TRACEPARENT[2:], None, id="version-ff"),
        pytest.param("00-" + "0" * 32 + "-00f067aa0ba902b7-01", None, id="zero-trace-id"),
        pytest.param("00-4bf92f3577b34da6a3ce929d0e0e4736-" + "0" * 16 + "-01", None, id="zero-parent-id"),
        pytest.param("00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01", None, id="short-trace-id"),
        pytest.param("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-1", None, id="short-flags"),
        pytest.param("00_4bf92f3577b34da6a3ce929d0e0e4736_00f067aa0ba902b7_01", None, id="wrong-separator"),
        pytest.param("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0x", None, id="non-hex"),
        pytest.param("", None, id="empty"),
        pytest.param(None, None, id="absent"),
    ],
)
def test_a_traceparent_gives_its_trace_id_only_when_it_follows_the_w3c_format(
    header: str | None, trace_id: str | None
) -> None:
    assert parse_trace_id(header) == trace_id
