"""The packages form layers, and no module imports upward (lazy imports inside functions count too).

- **base**: errors, http_errors, clock, jsonutil, config, procfs, runtime, keys; ``protocol`` (ours), ``wire``
  (vLLM's formats) and ``model`` (test models, the simulated model's tokenizer) import only the
  package root and the plain utilities (errors, clock, jsonutil);
- **engines and services**: ``sim`` (the simulated engine) sees the base; ``agent`` the base and
  ``sim`` (it launches one); ``orchestrator`` the base only; ``cluster_sim`` (the discrete-event
  simulator) the base, ``sim`` (its timing model) and ``orchestrator`` (whose code decides in it);
- **tools** (``up``, ``cli``, ``bench``, ``chaos``) see everything.

Without it a cycle crept in once: sim → agent (KV-event frames) → orchestrator (the prefix index) →
sim (the simulated tokenizer).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2] / "vllm_disagg"
BASE = frozenset(
    {
        "errors",
        "http_errors",
        "clock",
        "jsonutil",
        "config",
        "procfs",
        "runtime",
        "keys",
        "protocol",
        "wire",
        "model",
    }
)
CORE = frozenset({"__init__", "errors", "clock", "jsonutil"})  # the package root, and plain utilities
ALLOWED: dict[str, frozenset[str]] = {
    "errors": frozenset(),
    "http_errors": CORE,
    "clock": frozenset(),
    "jsonutil": frozenset(),
    "procfs": frozenset(),
    "runtime": frozenset(),
    "protocol": CORE,
    "wire": CORE,
    "model": CORE,
    "config": CORE | {"protocol"},
    "keys": CORE | {"protocol"},
    "sim": BASE | CORE,
    "agent": BASE | CORE | {"sim"},
    "orchestrator": BASE | CORE,
    "cluster_sim": BASE | CORE | {"sim", "orchestrator"},
}
TOOLS = frozenset({"up", "cli", "bench", "chaos", "__init__"})


def layer_of(path: Path) -> str:
    """``vllm_disagg/<layer>/...`` or ``vllm_disagg/<layer>.py``."""
    return path.relative_to(ROOT).parts[0].removesuffix(".py")


def imported_layers(path: Path) -> set[str]:
    """The ``vllm_disagg`` layers a module imports, at top level or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [
                f"{node.module}.{a.name}" for a in node.names if node.module == "vllm_disagg"
            ]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "vllm_disagg" and len(parts) > 1:
                is_module = (ROOT / parts[1]).is_dir() or (ROOT / f"{parts[1]}.py").is_file()
                found.add(
                    parts[1] if is_module else "__init__"
                )  # e.g. ``from vllm_disagg import __version__``
    return found


MODULES = sorted(p for p in ROOT.rglob("*.py") if layer_of(p) not in TOOLS)


def test_every_package_has_a_layer() -> None:
    layers = {layer_of(p) for p in ROOT.rglob("*.py")}
    assert layers <= set(ALLOWED) | TOOLS, sorted(layers - set(ALLOWED) - TOOLS)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_module_imports_upward(path: Path) -> None:
    layer = layer_of(path)
    upward = imported_layers(path) - ALLOWED[layer] - {layer}
    assert not upward, f"{path.relative_to(ROOT)} ({layer}) imports {sorted(upward)}"


def test_the_check_sees_a_lazy_import(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    lazy = "    from vllm_disagg.orchestrator.registry import Registry\n    import vllm_disagg.sim.core\n"
    module.write_text(f"def f():\n{lazy}")
    assert imported_layers(module) == {"orchestrator", "sim"}
