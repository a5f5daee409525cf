"""A chat template's content format: a port of vLLM 0.32's ``_detect_content_format``.

vLLM passes message content as a string, or as a list of {"type": "text", ...} parts when the template
loops over a message's content. The guess is syntactic, so it is reproduced syntactically. jinja2 and
transformers are imported only when a template is examined (in the tokenizer-loading thread).
"""

from __future__ import annotations

import importlib
from collections import deque
from collections.abc import Iterable
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from jinja2 import nodes

ContentFormat = Literal["string", "openai"]


def content_format(template: str) -> ContentFormat:
    """ "openai" when vLLM 0.32 would hand this template content parts, else "string"."""
    try:
        utils = importlib.import_module("transformers.utils.chat_template_utils")
        root = utils._compile_jinja_template(template).environment.parse(template)
    except Exception:
        return "string"
    try:
        return "openai" if _loops_over_content(root) else "string"
    except Exception:  # vLLM's own walk fails (asserts) on the same shapes: it answers "string" too
        return "string"


def _is_var(node: nodes.Node, name: str) -> bool:
    from jinja2 import nodes as jn

    return isinstance(node, jn.Name) and node.ctx == "load" and node.name == name


def _is_var_or_elems(node: nodes.Node, name: str, key: str | None = None) -> bool:
    from jinja2 import nodes as jn

    if isinstance(node, jn.Filter):
        return node.node is not None and _is_var_or_elems(node.node, name, key)
    if isinstance(node, jn.Test) or (isinstance(node, jn.Getitem) and isinstance(node.arg, jn.Slice)):
        return _is_var_or_elems(node.node, name, key)
    if key is None:
        return _is_var(node, name)
    if isinstance(node, jn.Getitem):
        return _is_var(node.node, name) and isinstance(node.arg, jn.Const) and node.arg.value == key
    return isinstance(node, jn.Getattr) and _is_var(node.node, name) and node.attr == key


def _target_name(node: nodes.Node) -> str:
    from jinja2 import nodes as jn

    if not isinstance(node, jn.Name):
        raise ValueError("unsupported assignment target")
    return str(node.name)


def _aliases(root: nodes.Template, name: str) -> list[str]:
    """``name`` and every variable assigned from it (or from its elements), transitively."""
    from jinja2 import nodes as jn

    found, queue = [name], deque([name])
    while queue:
        related = queue.popleft()
        for assign in root.find_all(jn.Assign):
            if _is_var_or_elems(assign.node, related):
                target = _target_name(assign.target)
                if target not in found:  # vLLM loops forever on a cycle; a one-off guard here
                    found.append(target)
                    queue.append(target)
    return found


def _message_vars(root: nodes.Template) -> list[str]:
    from jinja2 import nodes as jn

    messages = _aliases(root, "messages")
    return [
        _target_name(loop.target)
        for loop in root.find_all(jn.For)
        if any(_is_var_or_elems(loop.iter, v) for v in messages)
    ]


def _macro_content_params(
    root: nodes.Template, message_vars: Iterable[str]
) -> tuple[dict[int, set[str]], set[int]]:
    """Loops inside macros -> the macro's parameters that receive ``message.content``; all such loops."""
    from jinja2 import nodes as jn

    def is_content(arg: nodes.Node) -> bool:
        return any(_is_var_or_elems(arg, v, "content") for v in message_vars)

    params_by_loop: dict[int, set[str]] = {}
    loops_in_macros: set[int] = set()
    for macro in root.find_all(jn.Macro):
        names = {arg.name for arg in macro.args}
        params: set[str] = set()
        for call in root.find_all(jn.Call):
            if not (isinstance(call.node, jn.Name) and call.node.name == macro.name):
                continue
            params |= {
                macro.args[i].name for i, a in enumerate(call.args) if i < len(macro.args) and is_content(a)
            }
            params |= {kw.key for kw in call.kwargs if kw.key in names and is_content(kw.value)}
        for loop in macro.find_all(jn.For):
            loops_in_macros.add(id(loop))
            if params:
                params_by_loop[id(loop)] = params
    return params_by_loop, loops_in_macros


def _loops_over_content(root: nodes.Template) -> bool:
    from jinja2 import nodes as jn

    message_vars = _message_vars(root)
    params_by_loop, loops_in_macros = _macro_content_params(root, message_vars)
    for loop in root.find_all(jn.For):
        it = loop.iter
        if (
            any(_is_var_or_elems(it, v, "content") for v in message_vars)
            or (isinstance(it, jn.Name) and it.name in params_by_loop.get(id(loop), ()))
            or (id(loop) not in loops_in_macros and isinstance(it, jn.Name) and it.name == "content")
        ):
            _target_name(loop.target)
            return True
    return False
