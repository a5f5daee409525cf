"""Everything the package imports is declared in pyproject.toml: a dependency, or an optional extra."""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

ROOT = Path(__file__).parents[2]
PACKAGE = ROOT / "vllm_disagg"
CONNECTOR = "vllm_disagg/agent/kv/connector.py"
PLUGIN = "vllm_disagg/agent/vllm_plugin.py"
# Where an engine runs, not dependencies of the project: who may import them (vLLM loads both).
ENGINE_SIDE = {"vllm": {CONNECTOR}, "nixl": {PLUGIN}}


def _imported_modules() -> dict[str, set[str]]:
    """Top-level modules imported anywhere in the package (``importlib.import_module`` too) -> files."""
    found: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            elif (
                isinstance(node, ast.Call)
                and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module"
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)
            ):
                names = [node.args[0].value]
            for name in names:
                found.setdefault(name.split(".")[0], set()).add(str(path.relative_to(ROOT)))
    return found


def _declared() -> set[str]:
    """Distribution names in dependencies and every extra, normalised as PEP 503 says."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    specs = list(project["dependencies"])
    for extra in project.get("optional-dependencies", {}).values():
        specs += extra
    return {_normal(re.split(r"[<>=!~;\[ ]", spec, maxsplit=1)[0]) for spec in specs}


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_every_third_party_import_is_a_declared_dependency() -> None:
    owners = packages_distributions()
    undeclared = {}
    for module, files in _imported_modules().items():
        if module in sys.stdlib_module_names or module in ("vllm_disagg", "__future__"):
            continue
        if module in ENGINE_SIDE:  # the engine and NIXL: installed by scripts/setup_engine.sh, imported
            continue  # only by the modules vLLM loads into its own processes (a test below keeps it so)
        dists = {_normal(d) for d in owners.get(module, [module])}
        if not dists & _declared():
            undeclared[module] = sorted(files)
    assert not undeclared, f"imported but not declared in pyproject.toml: {undeclared}"


def test_only_the_modules_vllm_loads_import_the_engines_packages() -> None:
    imported = _imported_modules()
    assert {module: imported.get(module, set()) <= files for module, files in ENGINE_SIDE.items()} == {
        module: True for module in ENGINE_SIDE
    }, {module: imported.get(module) for module in ENGINE_SIDE}


def test_the_control_plane_never_imports_the_connector() -> None:
    """vLLM loads it by name (``kv_connector_module_path``); were any module of ours to import it,
    torch and vLLM would load into the agent or the orchestrator. Naming it in a string is fine."""
    importers = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            if "vllm_disagg.agent.kv.connector" in names:
                importers.add(str(path.relative_to(ROOT)))
    assert not importers
