"""Rules about the update: accumulation windows and resetting gradients."""

from __future__ import annotations

import ast
from collections.abc import Iterator

from .._declaration import Hit, rule
from .._script import Script
from .._syntax import (
    LOOPS,
    assigned_names,
    backwarded,
    callee,
    dotted,
    is_const,
    keyword,
    method,
    receiver,
    walk_scope,
    walk_stmts,
)


@rule(
    "LK009",
    theme="accumulation",
    flags="loss divided by N, optimizer stepped on `% N` only (the ragged window is lost)",
    why="the ragged last window (len(loader) % N micro-batches) is never stepped: it leaks "
    "into the next epoch's gradients, divided by N instead of its own size",
    fix="acc = loopkit.accumulate(model, optimizer, every=N); for batch in acc.iterate(loader):",
)
def ragged_window(script: Script) -> Iterator[Hit]:
    steps = script.optimizer_steps
    for loop in script.shape.step_loops:
        if not isinstance(loop, LOOPS):
            continue
        body = list(walk_stmts(loop.body))
        divisors = _loss_divisors(body)
        if not divisors:
            continue
        definitions = {
            name: value
            for node in body
            for name, value in assigned_names(node)
            if value is not None
        }
        if _skips_the_tail(loop):
            continue
        after = script.following(loop) + list(loop.orelse)
        if any(n in steps and not _in_loop(script, n, loop) for n in walk_stmts(after)):
            continue  # the tail window is flushed after the loop (not by a later loop)
        for node in body:
            if not isinstance(node, ast.If) or not any(n in steps for n in walk_stmts(node.body)):
                continue
            k = _steps_on_mod_only(node.test, divisors, definitions)
            if k is not None:
                yield node, f"loss divided by {k} but the optimizer stepped on `% {k}` only"


def _skips_the_tail(loop: ast.For | ast.AsyncFor | ast.While) -> bool:
    """``if step >= steps_per_epoch: continue`` (or ``break``) at the top of the body:
    the batches past the last whole window never reach the forward (ConvNeXt's engine)."""
    for stmt in loop.body:
        if (
            isinstance(stmt, ast.If)
            and len(stmt.body) == 1
            and isinstance(stmt.body[0], ast.Continue | ast.Break)
            and any(
                isinstance(op, ast.GtE | ast.Gt)
                for n in ast.walk(stmt.test)
                if isinstance(n, ast.Compare)
                for op in n.ops
            )
        ):
            return True
        if any(isinstance(n, ast.Call) and method(n) == "backward" for n in ast.walk(stmt)):
            return False
    return False


def _in_loop(script: Script, node: ast.AST, outside: ast.AST) -> bool:
    """Whether ``node`` runs in a loop that is not one of ``outside``'s enclosing loops."""
    return bool(set(script.loops_of(node)) - {outside, *script.loops_of(outside)})


def _loss_divisors(body: list[ast.AST]) -> dict[str, ast.expr]:
    """What the loss is divided by in a loop body (names and int constants), by their dump."""
    divisors: dict[str, ast.expr] = {}
    names: set[str] = set()
    for node in body:
        if isinstance(node, ast.Call) and method(node) == "backward":
            names |= backwarded(node)
            for part in ast.walk(node):
                if isinstance(part, ast.BinOp) and isinstance(part.op, ast.Div):
                    divisors[ast.dump(part.right)] = part.right
    for node in body:
        target: ast.expr
        value: ast.expr
        if isinstance(node, ast.AugAssign) and isinstance(node.op, ast.Div):
            target, value = node.target, node.value
        elif (
            isinstance(node, ast.Assign)
            and len(node.targets) == 1
            and isinstance(node.value, ast.BinOp)
            and isinstance(node.value.op, ast.Div)
        ):
            target, value = node.targets[0], node.value.right
        else:
            continue
        if isinstance(target, ast.Name) and ("loss" in target.id.lower() or target.id in names):
            divisors[ast.dump(value)] = value
    return {
        k: v
        for k, v in divisors.items()
        if isinstance(v, ast.Name | ast.Attribute)
        or (isinstance(v, ast.Constant) and isinstance(v.value, int))
    }


def _steps_on_mod_only(
    test: ast.expr, divisors: dict[str, ast.expr], definitions: dict[str, ast.expr]
) -> str | None:
    """K when ``test`` is ``i % K`` (maybe through a flag) with no last-batch clause."""

    def mod_k(expr: ast.AST) -> str | None:
        for n in ast.walk(expr):
            if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Mod):
                divisor = divisors.get(ast.dump(n.right))
                if divisor is not None:
                    return ast.unparse(divisor)
        return None

    parts: list[ast.AST] = [test]
    names: set[str] = set()
    found = mod_k(test)
    for n in ast.walk(test):
        if not isinstance(n, ast.Name):
            continue
        value = definitions.get(n.id)
        via_flag = mod_k(value) if value is not None else None
        if via_flag is not None:
            found = found or via_flag  # last = (i + 1) % N == 0; if last: ...
        else:
            names.add(n.id)  # its own name may say "last": is_last_batch
        if value is not None:
            parts.append(value)
    if found is None:
        return None
    # A clause for the final batch (len(loader), is_last, last_step) closes the tail.
    for part in parts:
        for n in ast.walk(part):
            if isinstance(n, ast.Call) and callee(n) == "len":
                return None
            if isinstance(n, ast.Attribute) and "last" in n.attr.lower():
                return None
            if isinstance(n, ast.Name) and "last" in n.id.lower() and n.id in names:
                return None
    return found


@rule(
    "LK010",
    theme="accumulation",
    flags="`zero_grad(set_to_none=False)`, or no `zero_grad` at all",
    why="gradients must be reset every update: set_to_none=False writes zeros into every "
    "gradient each step, and no zero_grad at all lets them pile up",
    fix="optimizer.zero_grad(set_to_none=True)  # loopkit.accumulate does it for you",
)
def zero_grad(script: Script) -> Iterator[Hit]:
    resets = False
    for call in script.method_calls("zero_grad"):
        resets = True
        flag = keyword(call, "set_to_none")
        value = flag.value if flag is not None else call.args[0] if call.args else None
        if is_const(value, False) and not script.sums_grads_by_hand:
            yield call, "`zero_grad(set_to_none=False)`"
    if resets or script.uses_rpc or _resets_elsewhere(script):
        return  # dist_autograd keeps each iteration's gradients in its own context
    for call in script.optimizer_steps:
        loops = script.loops_of(call)
        if loops and loops[0] in script.shape.training:
            yield call, "an optimizer step with no zero_grad anywhere in the file"


def _resets_elsewhere(script: Script) -> bool:
    """True when gradients are reset without zero_grad: p.grad = None, loopkit's step."""
    loopkit_names = {"loopkit"}
    for node in script.nodes:
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("loopkit"):
            loopkit_names.update(
                a.asname or a.name for a in node.names if a.name in {"accumulate", "step"}
            )
        elif (isinstance(node, ast.Attribute) and node.attr == "zero_grad") or (
            isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Attribute) and t.attr == "grad" for t in node.targets)
        ):
            return True  # optimizer.zero_grad, or p.grad = None
        elif isinstance(node, ast.Call) and method(node) == "zero_":
            grad = receiver(node)
            if isinstance(grad, ast.Attribute) and grad.attr == "grad":
                return True  # p.grad.zero_()
    for call in script.calls:
        name = dotted(call.func) or ""
        if name in {"loopkit.accumulate", "loopkit.step"} or (
            isinstance(call.func, ast.Name) and call.func.id in loopkit_names
        ):
            return True
    return False


@rule(
    "LK012",
    theme="accumulation",
    flags="`clip_grad_norm_` on GradScaler-scaled gradients, with no `scaler.unscale_` first",
    why="the gradients are still multiplied by the loss scale (65536 at the start), so the clip "
    "threshold applies to the scaled norm and clips far too hard, or never",
    fix="step = loopkit.step(model, optimizer, precision='fp16', clip_grad_norm=1.0)  # unscales "
    "first",
)
def clip_before_unscale(script: Script) -> Iterator[Hit]:
    for call in script.calls:
        if callee(call) not in {"clip_grad_norm_", "clip_grad_value_"}:
            continue
        scope = script.scope_of(call)
        calls = [n for n in walk_scope(scope) if isinstance(n, ast.Call)]
        before = [n for stmt in script.preceding(call) for n in ast.walk(stmt)]
        scaled = any(
            isinstance(n, ast.Call)
            and method(n) == "scale"
            and "scal" in (dotted(receiver(n)) or "").lower()
            for n in before
        )  # on this path: an `else:` branch without the scaler is not scaled
        if scaled and not any(method(n) == "unscale_" for n in calls):
            yield call, f"`{callee(call)}` on scaled gradients (no unscale_ in this function)"


@rule(
    "LK018",
    theme="accumulation",
    flags="`zero_grad()` on every micro-step of a loop that steps the optimizer on `% N`",
    why="the gradients of the window's earlier micro-batches are dropped before the update, "
    "so each update uses one micro-batch: accumulation silently does nothing",
    fix="step = loopkit.step(model, optimizer, accumulate=N)  # clears once per window",
)
def zero_grad_every_micro_step(script: Script) -> Iterator[Hit]:
    steps = script.optimizer_steps
    for loop in script.shape.step_loops:
        body = script.loop_body(loop)
        stepped = [n for n in body if n in steps]
        if not stepped or not all(script.guarded_by_mod(n, loop) for n in stepped):
            continue
        for node in body:
            if (
                isinstance(node, ast.Call)
                and method(node) == "zero_grad"
                and not script.guarded_by_mod(node, loop)
            ):
                yield node, "`zero_grad()` every micro-step, the update only on `% N`"


@rule(
    "LK019",
    theme="accumulation",
    flags="`for batch in loader:` around `with step:` of a loopkit step that accumulates",
    why="the windows span the epoch boundary and, at the end, the last micro-steps never "
    "become an update: only step.iterate marks each pass's last batch",
    fix="for batch in step.iterate(loader):  # closes the ragged last window of every pass",
)
def loop_around_step(script: Script) -> Iterator[Hit]:
    accumulating: set[str] = set()
    for node in script.nodes:
        for name, value in assigned_names(node):
            if isinstance(value, ast.Call) and (dotted(value.func) or "").split(".")[-1] in {
                "step",
                "accumulate",
            }:
                count = keyword(value, "accumulate") or keyword(value, "every")
                n = count.value if count is not None else (
                    value.args[2] if len(value.args) > 2 else None
                )  # fmt: skip
                if n is not None and not is_const(n, 1):
                    accumulating.add(name)
    if not accumulating:
        return
    for node in script.nodes:
        if not isinstance(node, ast.With):
            continue
        names = {dotted(item.context_expr) for item in node.items}
        entered = names & accumulating
        loops = script.loops_of(node)
        if not entered or not loops or not isinstance(loops[0], ast.For | ast.AsyncFor):
            continue
        it = loops[0].iter
        if isinstance(it, ast.Call) and method(it) == "iterate":
            continue
        yield loops[0], f"`for ... in {ast.unparse(it)}:` around `with {entered.pop()}:`"
