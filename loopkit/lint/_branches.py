"""Where a node runs under a branch: a cadence (``if step % N``, or a name bound to one) or
an error path that ends the run."""

from __future__ import annotations

import ast
from typing import TYPE_CHECKING

from ._syntax import dotted, has_mod

if TYPE_CHECKING:
    from ._parsed import SourceFile


def guarded_by_mod(script: SourceFile, node: ast.AST, stop: ast.AST) -> bool:
    """True when ``node`` runs only under an ``if`` whose test has ``%`` (below ``stop``),
    directly or through a name bound to one (``reg = i % k == 0``; ``if reg:``)."""
    child, parent = node, script.parents.get(node)
    while parent is not None and parent is not stop:
        if isinstance(parent, ast.If) and any(s is child for s in parent.body):
            if _cadence(script, parent.test):
                return True
        elif (
            isinstance(parent, ast.IfExp) and child is parent.body and _cadence(script, parent.test)
        ):
            return True
        child, parent = parent, script.parents.get(parent)
    return False


def _cadence(script: SourceFile, test: ast.expr) -> bool:
    """A ``%`` in the test, or a name in it whose every binding in its function has one."""
    if has_mod(test):
        return True
    scope = script.scope_of(test)
    for name in (n.id for n in ast.walk(test) if isinstance(n, ast.Name)):
        values = [v for bound, v in script.scope_bindings(scope) if bound == name]
        if values and all(v is not None and has_mod(v) for v in values):
            return True
    return False


def _ends(script: SourceFile, branch: ast.If, stop: ast.AST) -> bool:
    """Whether ``branch``'s body ends the run or the step loop: ``raise``,
    ``sys.exit(...)``; ``return`` when ``stop`` is a loop (training ends), ``break`` of
    ``stop`` itscript. A ``return`` in a function called per step is its normal path."""
    last = branch.body[-1]
    if isinstance(last, ast.Raise):
        return True
    if isinstance(last, ast.Expr) and isinstance(last.value, ast.Call):
        return (dotted(last.value.func) or "") in {"sys.exit", "exit", "quit", "os._exit"}
    if isinstance(last, ast.Return):
        return isinstance(stop, ast.For | ast.AsyncFor | ast.While)
    if isinstance(last, ast.Break):
        return script.loops_of(branch)[:1] == [stop]
    return False


def in_error_exit(script: SourceFile, node: ast.AST, stop: ast.AST) -> bool:
    """True when ``node`` sits in the body of an ``if`` (below ``stop``) that always ends
    the step or the run (``raise``, ``sys.exit``, ``return``, ``break``): an error path
    that runs at most once, not per step. Its test still runs every step."""
    child, parent = node, script.parents.get(node)
    while parent is not None and parent is not stop:
        if (
            isinstance(parent, ast.If)
            and any(s is child for s in parent.body)
            and _ends(script, parent, stop)
        ):
            return True
        child, parent = parent, script.parents.get(parent)
    return False
