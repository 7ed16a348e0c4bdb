"""The user's source around a refused window: where a loss was back-propagated directly.

Read only when a message is being built (never on a window that closes normally): the file of
the user's frame is parsed once per refusal, and the calls found are named ``file:line``.
"""

from __future__ import annotations

import ast
import inspect
import linecache
import sys
from types import FrameType

import torch


def direct_backwards(frame: FrameType | None, limit: int = 3) -> list[str]:
    """``file:line`` of each direct backward (``loss.backward()``, ``torch.autograd.backward(
    ...)``) in the function that ``frame`` runs; empty where its source cannot be read.

    A ``.backward(x)`` with a positional argument is a step's (``s.backward(loss)``,
    ``acc.backward(loss)``) where its receiver is a loopkit object or is not known in the
    frame; bound to a tensor, or to another object (``accelerator.backward(loss)``,
    ``fabric.backward(loss)``, Lightning's ``self.manual_backward(loss)``: they call
    ``loss.backward()``), it is a direct one."""
    if frame is None:
        return []
    path = frame.f_code.co_filename
    try:
        tree = ast.parse("".join(linecache.getlines(path)))
    except (SyntaxError, ValueError):
        return []
    scope = function_at(tree, frame.f_code.co_firstlineno, frame.f_code.co_name)
    names = {**frame.f_globals, **frame.f_locals}
    calls = [n for n in ast.walk(scope) if isinstance(n, ast.Call)]
    found = sorted({n.lineno for n in calls if _is_direct_backward(n, names)})
    return [f"{path}:{line}" for line in found[:limit]]


def function_at(tree: ast.Module, first: int, name: str) -> ast.AST:
    """The function whose code starts at line ``first`` (its decorators' line included), or
    the module for module-level code."""
    if name == "<module>":
        return tree
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            if start == first:
                return node
    return ast.Module(body=[], type_ignores=[])  # not found: say nothing rather than guess


def _is_direct_backward(node: ast.Call, names: dict[str, object]) -> bool:
    if not isinstance(node.func, ast.Attribute):
        return False
    func = node.func
    if func.attr not in ("backward", "manual_backward"):
        return False
    receiver = func.value
    if isinstance(receiver, ast.Attribute) and receiver.attr == "autograd":
        return True  # torch.autograd.backward(...)
    bound = _bound(receiver, names)
    if isinstance(bound, torch.Tensor):
        return True
    if bound is not _UNKNOWN and type(bound).__module__.split(".")[0] == "loopkit":
        return False  # a step's, an accumulate's, an autocast_step's own backward
    if func.attr == "manual_backward" or (bound is not _UNKNOWN and node.args):
        # accelerator.backward(loss), fabric.backward(loss), engine.backward(loss),
        # self.manual_backward(loss): a framework's backward, which calls loss.backward().
        return True
    return not node.args  # loss.backward(), (a + b).backward(retain_graph=True)


_UNKNOWN = object()


def _bound(expr: ast.expr, names: dict[str, object]) -> object:
    """What ``expr`` (a name, or attributes of one: ``self.accelerator``) is bound to in the
    frame, read without running any code (no property, no ``__getattr__``); else _UNKNOWN."""
    if isinstance(expr, ast.Name):
        return names.get(expr.id, _UNKNOWN)
    if isinstance(expr, ast.Attribute):
        owner = _bound(expr.value, names)
        if owner is _UNKNOWN:
            return _UNKNOWN
        try:
            value = inspect.getattr_static(owner, expr.attr)
        except AttributeError:
            return _UNKNOWN
        return _UNKNOWN if hasattr(type(value), "__get__") and not callable(value) else value
    return _UNKNOWN


def built_as(depth: int) -> str:
    """What the user called to build an accumulate: ``loopkit.step`` (whose ``__init__``
    builds one, ``depth`` frames above the caller) or ``loopkit.accumulate``. Build time only."""
    compose = sys.modules.get(f"{__package__}._compose")
    frame = sys._getframe(depth + 1)
    maker = frame.f_locals.get("self") if frame.f_code.co_name == "__init__" else None
    if compose is not None and isinstance(maker, compose.step):
        return "loopkit.step"
    return "loopkit.accumulate"
