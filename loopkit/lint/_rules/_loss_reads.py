"""The loss tensor used as a Python value (LK016): a branch on it, a float of it, formatted
into a string, printed, handed to a tracker or a progress bar. An explicit read is LK002's."""

from __future__ import annotations

import ast

from .._syntax import callee, dotted, method, receiver
from ._sync_reads import SYNCS

# What a tensor tells without its values: reading these waits for nothing.
_METADATA = {"shape", "dtype", "device", "requires_grad", "ndim", "is_cuda", "grad_fn", "size"}
_MATH = {"exp", "log", "sqrt", "isnan", "isinf", "isfinite", "floor", "ceil"}
# Tracker calls that take the value: the argument's index, or the keyword's name.
_TRACKER_VALUE = {"log": 0, "add_scalar": 1, "add_scalars": 1, "log_metric": 1, "log_metrics": 0}
_TRACKER_KEYWORDS = {"value", "metrics", "data", "scalar_value", "tag_scalar_dict", "values"}
# Receivers whose ``log`` is a tracker's: a name made of one of these words.
_TRACKERS = {"wandb", "run", "experiment", "tracker", "accelerator", "mlflow", "neptune", "comet"}


def test_of(node: ast.AST) -> ast.expr | None:
    """What Python turns into a bool: an if/while/assert/ternary test."""
    if isinstance(node, ast.If | ast.While | ast.Assert | ast.IfExp):
        return node.test
    return None


def loss_as_value(node: ast.AST, losses: set[str]) -> str | None:
    """What ``node`` does with a loss tensor as a Python value, if it does."""
    test = test_of(node)
    if test is not None:
        if _uses_value(test, losses):
            return f"`{ast.unparse(test)[:40]}`: a branch on the loss tensor"
        return None
    if isinstance(node, ast.FormattedValue):
        if _uses_value(node.value, losses):
            return f"`{{{ast.unparse(node.value)[:40]}}}`: the loss tensor formatted into a string"
        return None
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod):
        if _is_str(node.left) and _uses_value(node.right, losses):
            return f"`{ast.unparse(node)[:40]}`: the loss tensor formatted into a string"
        return None
    if not isinstance(node, ast.Call):
        return None
    return _call_uses(node, losses)


def _call_uses(node: ast.Call, losses: set[str]) -> str | None:
    given = [*node.args, *(k.value for k in node.keywords)]
    name = callee(node)
    if isinstance(node.func, ast.Name) and name in {"float", "bool", "int"} and node.args:
        if _uses_value(node.args[0], losses):
            return f"`{name}({ast.unparse(node.args[0])[:40]})` on the loss tensor"
        return None
    if isinstance(node.func, ast.Name) and name == "print":
        if any(_uses_value(v, losses) and not isinstance(v, ast.JoinedStr) for v in given):
            return "`print(...)` of the loss tensor formats its value"
        return None
    if method(node) == "format" and _is_str(receiver(node)):
        if any(_uses_value(v, losses) for v in given):
            return "`str.format(...)` of the loss tensor formats its value"
        return None
    if method(node) in {"set_postfix", "set_postfix_str", "set_description"}:
        if any(_uses_value(v, losses) and not isinstance(v, ast.JoinedStr) for v in given):
            return f"`{ast.unparse(node.func)}(...)` given the loss tensor formats its value"
        return None
    if _is_math(node) and node.args and _uses_value(node.args[0], losses):
        return f"`{ast.unparse(node)[:40]}`: math on the loss tensor reads it"
    tracked = _tracked_value(node)
    if tracked is not None and _uses_value(tracked, losses):
        return f"`{ast.unparse(node.func)}(...)` given the loss tensor: the tracker reads it"
    return None


def _uses_value(expr: ast.AST, losses: set[str]) -> bool:
    """Whether ``expr`` needs a loss tensor's value: the name appears other than as
    ``loss.shape``/``.dtype``/``.device``..., ``loss is None`` or ``isinstance(loss, T)``,
    and with no explicit read in it (``loss.item()``: LK002's)."""
    if _reads(expr):
        return False
    skip: set[int] = set()
    for n in ast.walk(expr):
        if isinstance(n, ast.Attribute) and n.attr in _METADATA:
            skip.add(id(n.value))
        elif isinstance(n, ast.Compare) and all(isinstance(o, ast.Is | ast.IsNot) for o in n.ops):
            skip.update(id(p) for p in [n.left, *n.comparators])
        elif isinstance(n, ast.Call) and callee(n) in {"isinstance", "type", "hasattr", "id"}:
            skip.update(id(a) for a in n.args)
    return any(
        isinstance(n, ast.Name) and n.id in losses and id(n) not in skip for n in ast.walk(expr)
    )


def _reads(expr: ast.AST) -> bool:
    """An explicit read in ``expr`` (``loss.item()``, ``float(...)``)."""
    return any(
        isinstance(n, ast.Call) and (method(n) in SYNCS or callee(n) == "float")
        for n in ast.walk(expr)
    )


def _is_str(node: ast.AST | None) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, str)


def _is_math(call: ast.Call) -> bool:
    """``math.exp(x)`` and friends: Python math, which takes a float (the tensor's value)."""
    name = dotted(call.func) or ""
    return name.startswith("math.") and name.rsplit(".", 1)[-1] in _MATH


def _tracked_value(call: ast.Call) -> ast.expr | None:
    """The value a tracker call records: ``wandb.log({...})``, ``writer.add_scalar(tag, v)``,
    ``mlflow.log_metric(key, v)``, ``accelerator.log({...})``, by position or keyword."""
    name = method(call) if isinstance(call.func, ast.Attribute) else None
    owner = (dotted(receiver(call)) or "").lower()
    if name not in _TRACKER_VALUE or not owner:
        return None
    words = set(owner.replace(".", "_").split("_"))
    if name == "log" and not words & _TRACKERS:
        return None  # logger.log(level, msg), np.log(...), pruner.log(x): not a tracker
    index = _TRACKER_VALUE[name]
    if index < len(call.args):
        return call.args[index]
    return next((k.value for k in call.keywords if k.arg in _TRACKER_KEYWORDS), None)
