"""Rules about autograd: a graph recorded where nothing will call backward."""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator

from .._declaration import Hit, rule
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
    flags="a forward pass after `model.eval()`, or in an evaluation function called per "
    "epoch, with autograd on (reported at the forward call; not one that runs once)",
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
    covered = _called_with_grad_off(script.nodes)
    yield from _eval_functions_with_grad(script, evals, covered)
    if not evals:
        return
    for scope, eval_calls in evals.items():
        if isinstance(scope, FUNCS) and (
            scope.name in covered or any(mentions_grad_off(d) for d in scope.decorator_list)
        ):
            continue
        nodes = list(walk_scope(scope))
        if any(names_grad_off(n) for n in nodes):
            continue  # the scope turns autograd off somewhere: trust it
        if isinstance(scope, FUNCS) and _previews_only(script, scope):
            continue
        for call in eval_calls:
            forward = _first_forward(call, nodes)
            if forward is None:
                continue
            loops = script.loops_of(forward)
            if loops and script.guarded_by_mod(forward, loops[0]):
                continue  # a preview every N steps (`if i % 100 == 0:`): one graph per N
            if script.shape.training and script.runs_once(loops[0] if loops else forward):
                continue  # a model summary at start-up, one test() after training: once
            if forward is not None:
                model = dotted(receiver(call))
                what = f"`{dotted(forward.func)}(...)` after `{model}.eval()`, with autograd on"
                yield forward, what


def _eval_functions_with_grad(
    script: Script, evals: dict[ast.AST, list[ast.Call]], covered: set[str]
) -> Iterator[Hit]:
    """An evaluation function (evaluate, validate, test...) with no ``model.eval()`` of its
    own (the caller's, or none), whose loop runs a model forward with autograd on, called
    inside a loop (per epoch) and never under no_grad: each call records a graph per batch
    that nothing back-propagates. A caller that wraps the call in no_grad covers it, and a
    function nothing in the checked files calls is left alone (its caller may)."""
    for func in script.nodes:
        if not isinstance(func, FUNCS) or func in evals or func.name in covered:
            continue
        name = func.name.lower()
        if "train" in name or not any(w in name for w in ("eval", "valid", "test")):
            continue
        if any(mentions_grad_off(d) for d in func.decorator_list):
            continue
        nodes = list(walk_scope(func))
        if any(names_grad_off(n) for n in nodes) or any(method(n) == "backward" for n in nodes):
            continue
        forwards = [
            n
            for n in nodes
            if isinstance(n, ast.Call) and script.loops_of(n) and _is_model_call(script, n)
        ]
        callers = script.callers(func)
        if not forwards or not callers:
            continue
        if any(where.grad_off(call) for where, call in callers):
            continue
        periodic = [(w, c) for w, c in callers if w.loops_of(c) or w.reach_of(c) is not None]
        if not periodic:
            continue  # called once: a one-off evaluation records its graphs once
        where, call = periodic[0]
        forward = min(forwards, key=lambda n: (n.lineno, n.col_offset))
        yield (
            forward,
            (
                f"`{dotted(forward.func)}(...)` in `{func.name}()`, called per epoch at "
                f"{where.path}:{call.lineno}, with autograd on"
            ),
        )


def _previews_only(script: Script, func: ast.AST) -> bool:
    """Whether every call of ``func`` runs under ``if step % N`` in a loop (sample_images
    every 100 batches): a graph once per N steps is not a per-step cost."""
    callers = script.callers(func) if isinstance(func, FUNCS) else []
    return bool(callers) and all(
        where.loops_of(call) and where.guarded_by_mod(call, where.loops_of(call)[0])
        for where, call in callers
    )


def _is_model_call(script: Script, call: ast.Call) -> bool:
    """``model(x)``, ``self.net(x)``, ``model.module(x)``: a call of a model by its name."""
    name = dotted(call.func)
    if name is None or script.project is None or script.project.resolve(script, call):
        return False
    last = name.rsplit(".", 1)[-1].lower()
    return ("model" in last or last.startswith("net") or last.endswith("net")) and not any(
        w in last for w in ("eval", "train", "get", "load", "build", "make")
    )


def _called_with_grad_off(nodes: list[ast.AST]) -> set[str]:
    """Names of the functions called under no_grad somewhere: they are covered there."""
    covered: set[str] = set()
    for node in nodes:
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
