"""The packages form layers, no module imports upward, and no modules import each other in a circle.

Every import counts: at top level, inside a function (lazy) and under ``TYPE_CHECKING``.

First level (``vllm_disagg/<layer>``):

- **base**: errors, http_errors, clock, jsonutil, config, procfs, runtime, keys, logs (and the
  trace_context it reads); ``protocol`` (ours), ``wire``
  (vLLM's formats), ``model`` (test models, the simulated model's tokenizer) and ``etcd`` (the etcd
  client, leader election, membership) import only the package root and the plain utilities (errors,
  clock, jsonutil);
- **engines and services**: ``sim_engine`` (the simulated engine) sees the base; ``agent`` the base and
  ``sim_engine`` (it launches one); ``orchestrator`` the base only; ``cluster_sim`` (the discrete-event
  simulator) the base, ``sim_engine`` (its timing model) and ``orchestrator`` (whose code decides in it);
- **tools** (``cli``, ``bench``, ``chaos``) see everything.

Second level (``vllm_disagg/orchestrator/<part>``), bottom up: ``state`` (what the orchestrator knows);
``scheduling`` and ``metrics`` read it; ``admission`` (the gateway's queue, on the scheduler's
predictions); ``control`` (the agents' sessions and the commands to them);
``planner`` (decides role changes, carried out by control); ``gateway`` (requests, and its workers);
``admin`` (the operators' HTTP surfaces); ``replicas`` (the election and the replicas' link, on
``control``); ``app`` and ``main`` wire it all.

Without the first check a cycle crept in once: sim → agent (KV-event frames) → orchestrator (the prefix
index) → sim (the simulated tokenizer). Without the last, two hid behind lazy and ``TYPE_CHECKING``
imports (the gateway's flow and its routes; the agent's engine and its vLLM command).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2] / "vllm_disagg"
BASE = frozenset(
    {
        "errors",
        "http_errors",
        "clock",
        "jsonutil",
        "private_files",
        "config",
        "procfs",
        "runtime",
        "keys",
        "protocol",
        "wire",
        "model",
        "etcd",
        "logs",
        "trace_context",
    }
)
CORE = frozenset({"__init__", "errors", "clock", "jsonutil", "private_files"})  # the root, plain utilities
ALLOWED: dict[str, frozenset[str]] = {
    "errors": frozenset(),
    "http_errors": CORE,
    "clock": frozenset(),
    "jsonutil": frozenset(),
    "private_files": frozenset({"errors"}),
    "procfs": frozenset(),
    "runtime": frozenset(),
    "protocol": CORE,
    "wire": CORE,
    "model": CORE,
    "etcd": CORE,
    "config": CORE | {"protocol"},
    "keys": CORE | {"protocol"},
    "trace_context": frozenset(),
    "logs": CORE | {"trace_context"},
    "sim_engine": BASE | CORE,
    "agent": BASE | CORE | {"sim_engine"},
    "orchestrator": BASE | CORE,
    "cluster_sim": BASE | CORE | {"sim_engine", "orchestrator"},
}
TOOLS = frozenset({"cli", "bench", "chaos", "__init__"})

# The orchestrator's parts; each sees the ones listed (and everything outside the orchestrator its
# first-level layer allows).
_STATE = frozenset({"state"})
ORCHESTRATOR: dict[str, frozenset[str]] = {
    "__init__": frozenset(),
    "flags": frozenset(),
    "loop_lag": frozenset(),
    "state": frozenset(),
    "scheduling": _STATE,
    "metrics": _STATE,
    "control": _STATE | {"metrics"},
    "admission": _STATE | {"scheduling"},
    "planner": _STATE | {"scheduling", "metrics", "control", "admission"},
    "gateway": _STATE | {"scheduling", "metrics", "control", "planner", "admission", "loop_lag"},
    "admin": _STATE | {"metrics", "control", "admission", "gateway"},
    "replicas": _STATE | {"metrics", "control"},
    "kv_warmup": _STATE | {"metrics"},
    "app": _STATE
    | {"scheduling", "metrics", "control", "admission", "planner", "gateway", "admin", "replicas"}
    | {"loop_lag", "kv_warmup"},
    "main": _STATE | {"scheduling", "control", "planner", "gateway", "admin", "replicas", "app", "flags"},
}


def module_name(path: Path) -> str:
    """``vllm_disagg/a/b.py`` → ``a.b``; a package's ``__init__.py`` → the package (``a``)."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def imports_of(path: Path) -> set[str]:
    """The ``vllm_disagg`` modules a file imports (``a.b``; a package's name for its ``__init__``), wherever
    the import statement stands: module level, a function, an ``if TYPE_CHECKING:`` block."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] != "vllm_disagg":
                continue
            dotted = ".".join(parts[1:]) or "__init__"
            if dotted in MODULES or dotted == "__init__":
                found.add(dotted)
            elif "." in dotted and dotted.rsplit(".", 1)[0] in MODULES:
                pass  # a name from a module: its module is in ``names`` too
            elif isinstance(node, ast.Import):
                found.add(dotted)  # a module that does not exist: the test says so
    return found


def layer_of(module: str) -> str:
    return module.split(".")[0]


def part_of(module: str) -> str | None:
    """The orchestrator's part a module is in, or None outside the orchestrator."""
    parts = module.split(".")
    if parts[0] != "orchestrator":
        return None
    return parts[1] if len(parts) > 1 else "__init__"


def test_every_package_has_a_layer() -> None:
    layers = {layer_of(m) for m in MODULES}
    assert layers <= set(ALLOWED) | TOOLS, sorted(layers - set(ALLOWED) - TOOLS)


def test_every_orchestrator_part_has_a_place() -> None:
    parts = {part_of(m) for m in MODULES} - {None}
    assert parts <= set(ORCHESTRATOR), sorted(str(p) for p in parts - set(ORCHESTRATOR))


@pytest.mark.parametrize("module", sorted(m for m in MODULES if layer_of(m) not in TOOLS))
def test_no_module_imports_upward(module: str) -> None:
    layer = layer_of(module)
    upward = {layer_of(m) for m in imports_of(MODULES[module])} - ALLOWED[layer] - {layer}
    assert not upward, f"{module} ({layer}) imports {sorted(upward)}"


@pytest.mark.parametrize("module", sorted(m for m in MODULES if part_of(m) is not None))
def test_no_orchestrator_part_imports_upward(module: str) -> None:
    part = part_of(module)
    assert part is not None
    seen = {part_of(m) for m in imports_of(MODULES[module])} - {None}
    upward = seen - ORCHESTRATOR[part] - {part}
    assert not upward, f"{module} (orchestrator's {part}) imports {sorted(str(p) for p in upward)}"


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's strongly connected components of more than one module, and modules importing themselves
    (Tarjan's algorithm, iterative: a deep import chain must not hit the recursion limit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1 or node in graph.get(node, ()):
                    found.append(sorted(component))
    return found


def test_no_import_cycles() -> None:
    graph = {m: imports_of(p) - {m} for m, p in MODULES.items()}
    for module, imported in graph.items():
        # importing ``a.b.c`` runs ``a`` and ``a.b`` first; a package's ``__init__`` importing its own
        # module is the package's business, not a cycle between modules.
        graph[module] = {i for i in imported if not module.startswith(i + ".")}
    assert cycles(graph) == []


def test_the_checks_see_lazy_and_type_checking_imports(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from vllm_disagg.orchestrator.gateway.flow import Flow\n"
        "def f():\n"
        "    from vllm_disagg.orchestrator.state.registry import Registry\n"
        "    import vllm_disagg.sim_engine.core\n"
    )
    assert imports_of(module) == {
        "orchestrator.gateway.flow",
        "orchestrator.state.registry",
        "sim_engine.core",
    }


def test_the_cycle_check_finds_a_circle_and_a_self_import() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"d"}, "e": {"a"}}
    assert sorted(cycles(graph)) == [["a", "b", "c"], ["d"]]
