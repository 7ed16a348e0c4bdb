"""Rules about autograd: a graph recorded where nothing will call backward."""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator

from .._rule import Hit, rule
from .._script import Script
from .._syntax import (
    FUNCS,
    callee,
    dotted,
    mentions_grad_off,
    method,
    names_grad_off,
    receiver,
    walk_scope,
    walk_stmts,
)


@rule(
    "LK008",
    theme="autograd",
    flags="a forward pass after `model.eval()` with autograd on (reported at the forward call)",
    why="autograd records a graph for a forward pass that never calls backward",
    fix="with torch.inference_mode():",
)
def eval_with_grad(script: Script) -> Iterator[Hit]:
    evals: dict[ast.AST, list[ast.Call]] = {}
    for call in script.method_calls("eval"):
        if not call.args and not call.keywords:
            scope = script.scope_of(call)
            if isinstance(scope, ast.Module | ast.FunctionDef | ast.AsyncFunctionDef):
                evals.setdefault(scope, []).append(call)
    if not evals:
        return
    covered = _called_with_grad_off(script.tree)
    for scope, eval_calls in evals.items():
        if isinstance(scope, FUNCS) and (
            scope.name in covered or any(mentions_grad_off(d) for d in scope.decorator_list)
        ):
            continue
        nodes = list(walk_scope(scope))
        if any(names_grad_off(n) for n in nodes):
            continue  # the scope turns autograd off somewhere: trust it
        for call in eval_calls:
            forward = _first_forward(call, nodes)
            if forward is not None:
                model = dotted(receiver(call))
                what = f"`{dotted(forward.func)}(...)` after `{model}.eval()`, with autograd on"
                yield forward, what


def _called_with_grad_off(tree: ast.Module) -> set[str]:
    """Names of the functions called under no_grad somewhere: they are covered there."""
    covered: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.With | ast.AsyncWith) and any(
            mentions_grad_off(i.context_expr) for i in node.items
        ):
            covered.update(callee(c) for c in walk_stmts(node.body) if isinstance(c, ast.Call))
    return covered


def _first_forward(eval_call: ast.Call, nodes: list[ast.AST]) -> ast.Call | None:
    """The first forward pass of the evaluated model before it goes back to ``.train()``."""
    model = dotted(receiver(eval_call))
    if model is None:
        return None
    calls = [n for n in nodes if isinstance(n, ast.Call)]
    # The evaluation lasts until the same model goes back to .train().
    end = min(
        (
            c.lineno
            for c in calls
            if method(c) == "train" and c.lineno > eval_call.lineno and dotted(receiver(c)) == model
        ),
        default=sys.maxsize,
    )
    region = [n for n in nodes if eval_call.lineno < getattr(n, "lineno", 0) < end]
    if any(method(n) == "backward" for n in region):
        return None  # training in eval mode (frozen batch norm): it needs the graph
    forwards = [
        n
        for n in region
        if isinstance(n, ast.Call)
        and dotted(n.func) in {model, f"{model}.forward", f"{model}.generate"}
    ]
    return min(forwards, key=lambda n: (n.lineno, n.col_offset), default=None)
