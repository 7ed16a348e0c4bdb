"""Branches of a function that the training step never takes: a flag parameter that defaults
to False/None (``forward(x, reverse=False)``) and that only calls off the step set."""

from __future__ import annotations

import ast

from ._program import F, Func, Program
from ._syntax import FUNCS, dotted, receiver
from ._syntax import method as method_name


def in_flag_branch(project: Program[F], script: F, node: ast.AST, func: ast.AST) -> bool:
    """Whether ``node`` runs only when a parameter of ``func`` that defaults to
    False/None is set (``if reverse:``, the ``else`` of ``if not reverse:``), and every
    call that may run ``func`` and sets it is off the training step (in no ``forward``,
    reached by no step: ``infer()``). Called with it unset, the branch never runs."""
    if not isinstance(func, FUNCS):
        return False
    flags = _false_defaults(func)
    child, parent = node, script.parents.get(node)
    while parent is not None and parent is not func:
        if isinstance(parent, ast.If):
            test, taken = parent.test, parent.body
            if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
                test, taken = test.operand, parent.orelse
            if (
                isinstance(test, ast.Name)
                and test.id in flags
                and any(s is child for s in taken)
                and _set_off_step(project, script, func, test.id, flags[test.id])
            ):
                return True
        child, parent = parent, script.parents.get(parent)
    return False


def _set_off_step(project: Program[F], script: F, func: Func, flag: str, index: int) -> bool:
    sites = _possible_callers(project, script, func)
    if not sites:
        return False  # nothing visible calls it: undecided, keep the finding
    method = isinstance(script.parents.get(func), ast.ClassDef)
    for where, call in sites:
        if any(isinstance(a, ast.Starred) for a in call.args):
            return False
        given = [k.value for k in call.keywords if k.arg in {flag, None}]
        position = index - 1 if method else index
        if 0 <= position < len(call.args):
            given.append(call.args[position])
        if all(isinstance(v, ast.Constant) and not v.value for v in given):
            continue  # left unset here: the branch does not run from this call
        scope = where.scope_of(call)
        if not isinstance(scope, FUNCS) or scope.name == "forward" or scope in project.per_step:
            return False
    return True


def _possible_callers(project: Program[F], script: F, func: Func) -> list[tuple[F, ast.Call]]:
    """The calls that run ``func``, and, for a method, the calls on an object one of
    whose bindings is its class (``project.dp = A(...)`` or ``B(...)``: ``project.dp(x)``)."""
    sites = list(project.callers(script, func))
    owner = script.parents.get(func)
    if not isinstance(owner, ast.ClassDef):
        return sites
    for where in project.scripts:
        for call in where.calls:
            if func.name in {"forward", "__call__"}:
                obj: ast.expr | None = call.func  # criterion(out, y): its forward
            elif method_name(call) == func.name:
                obj = receiver(call)
            else:
                continue
            name = dotted(obj)
            values = where.bindings.get(name, []) if name else []
            if any(
                isinstance(v, ast.Call) and project._class(where, v.func) == (script, owner)
                for v in values
            ) and not any(site is call for _, site in sites):
                sites.append((where, call))
    return sites


def _false_defaults(func: Func) -> dict[str, int]:
    """Parameters that default to False or None, with their position (-1: keyword-only)."""
    args = func.args
    positional = [*args.posonlyargs, *args.args]
    found: dict[str, int] = {}
    for i, default in enumerate(args.defaults, start=len(positional) - len(args.defaults)):
        if isinstance(default, ast.Constant) and default.value in (False, None):
            found[positional[i].arg] = i
    for arg, kw_default in zip(args.kwonlyargs, args.kw_defaults, strict=True):
        if isinstance(kw_default, ast.Constant) and kw_default.value in (False, None):
            found[arg.arg] = -1
    return found
