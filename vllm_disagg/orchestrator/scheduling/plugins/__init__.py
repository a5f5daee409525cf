"""The scheduler's plugins, one module each; ``catalog.PLUGIN_SPECS`` lists them all by ``TYPE``.

Each module has ``TYPE``, a frozen ``Params`` dataclass that validates itself, the plugin class and
``PLUGIN``, its ``PluginSpec``. Filters and scorers work on the whole candidate list at once: the
scheduler must decide in well under 100 µs at 1,024 instances, so per-candidate work stays a few
attribute reads inside one comprehension. This package holds only the shared parameter checks (the
catalog imports the plugin modules, not this file, so importing a plugin stays cheap).
"""

from __future__ import annotations

import math


def check_real(
    plugin: str,
    field: str,
    value: object,
    *,
    gt: float | None = None,
    ge: float | None = None,
    le: float | None = None,
) -> None:
    """Raise ``ValueError`` unless ``value`` is a finite real number within the given bounds."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{plugin}: {field} must be a finite number, got {value!r}")
    if gt is not None and not value > gt:
        raise ValueError(f"{plugin}: {field} must be > {gt:g}, got {value!r}")
    if ge is not None and not value >= ge:
        raise ValueError(f"{plugin}: {field} must be >= {ge:g}, got {value!r}")
    if le is not None and not value <= le:
        raise ValueError(f"{plugin}: {field} must be <= {le:g}, got {value!r}")


def check_int(plugin: str, field: str, value: object, *, ge: int) -> None:
    """Raise ``ValueError`` unless ``value`` is an integer (not a bool) of at least ``ge``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{plugin}: {field} must be an integer, got {value!r}")
    if value < ge:
        raise ValueError(f"{plugin}: {field} must be >= {ge}, got {value!r}")
