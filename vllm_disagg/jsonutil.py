"""Fast JSON in one place, so the hot path never imports the standard ``json`` by accident."""

from __future__ import annotations

from typing import Any

import orjson

JSONDecodeError = orjson.JSONDecodeError


def dumps(obj: Any) -> bytes:
    """Serialise to UTF-8 JSON bytes."""
    return orjson.dumps(obj)


def loads(data: bytes | bytearray | memoryview | str) -> Any:
    """Parse JSON; raises ``JSONDecodeError`` (a ``ValueError``) on bad input."""
    return orjson.loads(data)
