"""The loss tensor used as a Python value (LK016): a branch on it, a float of it, formatted
into a string, handed to a tracker. What counts as an explicit read is LK002's."""

from __future__ import annotations

import ast

from .._syntax import callee, dotted, method, receiver
from ._sync_reads import SYNCS, names_in


def test_of(node: ast.AST) -> ast.expr | None:
    """What Python turns into a bool: an if/while/assert/ternary test."""
    if isinstance(node, ast.If | ast.While | ast.Assert | ast.IfExp):
        return node.test
    return None


def loss_as_value(node: ast.AST, losses: set[str]) -> str | None:
    """What ``node`` does with a loss tensor as a Python value, if it does (an explicit read,
    ``.item()`` and the like, is LK002's)."""
    test = test_of(node)
    if test is not None:
        if names_in(test) & losses and not _reads(test):
            return f"`{ast.unparse(test)[:40]}`: a branch on the loss tensor"
        return None
    if isinstance(node, ast.FormattedValue):
        if names_in(node.value) & losses and not _reads(node.value):
            return f"`{{{ast.unparse(node.value)[:40]}}}`: the loss tensor formatted into a string"
        return None
    if not isinstance(node, ast.Call) or not node.args:
        return None
    first = node.args[0]
    if isinstance(node.func, ast.Name) and node.func.id in {"float", "bool", "int"}:
        if names_in(first) & losses and not _reads(first):
            return f"`{node.func.id}({ast.unparse(first)[:40]})` on the loss tensor"
        return None
    if _is_math(node) and names_in(first) & losses and not _reads(first):
        return f"`{ast.unparse(node)[:40]}`: math on the loss tensor reads it"
    tracked = _tracked_value(node)
    if tracked is not None and names_in(tracked) & losses and not _reads(tracked):
        return f"`{ast.unparse(node.func)}(...)` given the loss tensor: the tracker reads it"
    return None


def _reads(expr: ast.AST) -> bool:
    """An explicit read in ``expr`` (``loss.item()``, ``float(...)``), or ``.detach()``
    handed on (a tracker given it still reads it: its own LK016 elsewhere is enough)."""
    return any(
        isinstance(n, ast.Call) and (method(n) in SYNCS or callee(n) == "float")
        for n in ast.walk(expr)
    )


_MATH = {"exp", "log", "sqrt", "isnan", "isinf", "isfinite", "floor", "ceil"}


def _is_math(call: ast.Call) -> bool:
    """``math.exp(x)`` and friends: Python math, which takes a float (the tensor's value)."""
    name = dotted(call.func) or ""
    return name.startswith("math.") and name.rsplit(".", 1)[-1] in _MATH


# Tracker calls that take the value itself: wandb.log({...}), writer.add_scalar(tag, v, step),
# mlflow.log_metric(key, v), experiment.log_metric(...), run.log({...}).
_TRACKER_VALUE = {"log": 0, "add_scalar": 1, "log_metric": 1, "log_metrics": 0}


def _tracked_value(call: ast.Call) -> ast.expr | None:
    name = method(call) if isinstance(call.func, ast.Attribute) else None
    owner = (dotted(receiver(call)) or "").lower()
    if name not in _TRACKER_VALUE or not owner:
        return None
    if name == "log" and not any(w in owner for w in ("wandb", "run", "experiment", "tracker")):
        return None  # logger.log(level, msg), np.log(...): not a tracker
    index = _TRACKER_VALUE[name]
    if index < len(call.args):
        return call.args[index]
    wanted = {"value", "metrics", "data", "scalar_value"}
    return next((k.value for k in call.keywords if k.arg in wanted), None)
