"""Where an evaluation's per-batch reads cost (LK014's questions): which loop evaluates once
per batch, what read back is a metric, and a copy to the host that nothing uses."""

from __future__ import annotations

import ast

from .._script import Script
from .._syntax import callee, receiver, walk_scope

_METRIC_WORDS = ("loss", "acc", "correct", "err", "metric", "top", "prec", "nll", "ppl", "score")


def of_a_metric(script: Script, call: ast.Call) -> bool:
    """Whether the value read back is a metric: a loss, an accuracy, a count of correct..."""
    parts: list[ast.AST] = [call.args[0] if callee(call) == "float" else receiver(call) or call]
    stmt: ast.AST | None = call
    while stmt is not None and not isinstance(stmt, ast.stmt):
        stmt = script.parents.get(stmt)
    if isinstance(stmt, ast.Assign):
        parts.extend(stmt.targets)
    elif isinstance(stmt, ast.AugAssign | ast.AnnAssign):
        parts.append(stmt.target)
    words = {
        (n.id if isinstance(n, ast.Name) else n.attr).lower()
        for part in parts
        for n in ast.walk(part)
        if isinstance(n, ast.Name | ast.Attribute)
    }
    return any(w in word for word in words for w in _METRIC_WORDS)


def never_used(script: Script, call: ast.Call) -> bool:
    """``preds = out.argmax(1).cpu()`` whose name nothing in its function reads again: the
    copy (and its wait) is made for nothing."""
    stmt = script.parents.get(call)
    if not (
        isinstance(stmt, ast.Assign)
        and len(stmt.targets) == 1
        and isinstance(stmt.targets[0], ast.Name)
        and stmt.value is call
    ):
        return False
    name = stmt.targets[0].id
    return not any(
        isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Load)
        for n in walk_scope(script.scope_of(call))
    )


def eval_batch_loop(script: Script, node: ast.AST) -> ast.AST | None:
    """The evaluation loop ``node`` runs in once per batch, where that costs: not a training
    step's (LK002's), not under ``% N`` in it, not a one-off pass of a script that trains.
    An evaluation loop inside the training loop under ``if step % N == 0:`` counts: each of
    its batches is read, every N steps (LK002 leaves what runs once per N steps)."""
    loops = script.loops_of(node)
    step = next((loop for loop in loops if loop in script.shape.step_loops), None)
    if not loops or step is loops[0]:
        return None  # in a training step: LK002's
    if step is not None and not script.guarded_by_mod(node, step):
        return None  # an inner loop run every step: LK002's too
    loop = loops[0]
    if loop in script.shape.training or not script.evaluates(loop):
        return None
    if script.guarded_by_mod(node, loop):
        return None
    # A one-off evaluation (before or after training, not inside its loop) costs its syncs
    # once per run; a script that does not train at all is there to evaluate: it counts.
    if script.shape.training and script.runs_once(loop):
        return None
    return loop
