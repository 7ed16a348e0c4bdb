"""Which loops and functions of a script train: found together from its backward calls and
optimizer steps."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ._syntax import FUNCS, assigned_names, dotted, walk_stmts

if TYPE_CHECKING:
    from ._parsed import SourceFile


@dataclass(frozen=True)
class TrainingShape:
    """Which loops and functions of a script train, found together from its backward calls."""

    training: frozenset[ast.AST]  # loops with a backward call in them
    step_loops: frozenset[ast.AST]  # loops whose every iteration is a training step
    called_step_funcs: frozenset[ast.AST]  # one-step functions some loop calls


def training_shape(script: SourceFile) -> TrainingShape:
    """Find the training loops (they contain backward) and the per-step ones among them."""
    training: set[ast.AST] = set()
    step_loops: set[ast.AST] = set()
    backward = [*script.method_calls("backward"), *_scaler_steps(script)]
    for call in backward:
        loops = script.loops_of(call)
        training.update(loops)
        if loops:
            step_loops.add(loops[0])
    # nanoGPT's shape: backward in an inner micro-batch loop, the update in the outer one.
    for call in script.optimizer_steps:
        loops = script.loops_of(call)
        if loops and loops[0] in training:
            step_loops.add(loops[0])
    # A function that back-propagates or steps the optimizer outside any loop of its own
    # is one training step; so is one that calls such a function outside its loops
    # (improved-diffusion: run_loop -> run_step -> forward_backward + optimize). One that
    # trains in a loop of its own (an epoch) is not, even if it steps once after it.
    trains_in_loop = {script.scope_of(loop) for loop in training}
    step_funcs: dict[str, ast.AST] = {}
    for call in [*backward, *script.optimizer_steps]:
        scope = script.scope_of(call)
        if isinstance(scope, FUNCS) and not script.loops_of(call) and scope not in trains_in_loop:
            step_funcs[scope.name] = scope
    grew = True
    while grew:
        grew = False
        for call in script.calls:
            scope = script.scope_of(call)
            if not isinstance(scope, FUNCS) or scope in step_funcs.values():
                continue
            if scope in trains_in_loop or script.loops_of(call):
                continue
            if _step_func_called(script, call, step_funcs) is not None:
                step_funcs[scope.name] = scope
                grew = True
    called: set[ast.AST] = set()
    for call in script.calls:
        func = _step_func_called(script, call, step_funcs)
        loops = script.loops_of(call)
        if func is not None and loops:
            called.add(func)
            step_loops.add(loops[0])
    return TrainingShape(frozenset(training), frozenset(step_loops), frozenset(called))


def _step_func_called(
    script: SourceFile, call: ast.Call, step_funcs: dict[str, ast.AST]
) -> ast.AST | None:
    """The one-step function a call runs: by its name, or a method through ``self.``."""
    if isinstance(call.func, ast.Name):
        return step_funcs.get(call.func.id)
    if isinstance(call.func, ast.Attribute) and dotted(call.func.value) in {"self", "cls"}:
        func = step_funcs.get(call.func.attr)
        if func is not None and isinstance(script.parents.get(func), ast.ClassDef):
            return func
    return None


def _scaler_steps(script: SourceFile) -> list[ast.Call]:
    """Calls that back-propagate and step in one: ``loss_scaler(loss, optimizer, ...)``
    (timm's NativeScaler), a callable given first a loss computed in the same loop (not a
    loss function passed in: ``train_epoch(loss_fn, optimizer)``) and an optimizer."""
    found: list[ast.Call] = []
    for call in script.calls:
        if not call.args or not isinstance(call.args[0], ast.Name):
            continue
        loss = call.args[0].id
        loops = script.loops_of(call)
        if "loss" not in loss.lower() or not loops:
            continue
        if not any(
            name == loss for n in walk_stmts(loops[0].body) for name, _ in assigned_names(n)
        ):
            continue  # not computed in the loop: a loss function, a per-epoch value
        rest = [*call.args[1:], *(k.value for k in call.keywords)]
        if any("optim" in (dotted(v) or "").lower() for v in rest):
            found.append(call)
    return found
