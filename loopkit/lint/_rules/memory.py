"""Rules about memory: a graph kept in a list, the cache emptied, tensors built on the host."""

from __future__ import annotations

import ast
from collections.abc import Iterator

from .._rule import Hit, rule
from .._script import Script
from .._syntax import (
    FUNCS,
    assigned_names,
    backwarded,
    device_move,
    dotted,
    method,
    receiver,
    walk_scope,
)

# torch's tensor factories: without device= they build on the host.
_FACTORIES = frozenset(
    {
        "zeros",
        "ones",
        "randn",
        "rand",
        "randint",
        "empty",
        "arange",
        "full",
        "tensor",
        "eye",
        "linspace",
    }
)


@rule(
    "LK001",
    theme="memory",
    flags="a loss tensor appended to a list in a loop (keeps its graph alive)",
    why="a loss tensor kept in a list keeps its whole autograd graph and activations alive, "
    "so memory grows with every step",
    fix="log = loopkit.detach_logging(every=N); log(loss=loss)",
)
def loss_in_list(script: Script) -> Iterator[Hit]:
    for call in script.method_calls("append"):
        if len(call.args) != 1 or call.keywords:
            continue
        arg = call.args[0]
        loops = script.loops_of(call)
        if not isinstance(arg, ast.Name) or not loops or script.grad_off(call):
            continue
        outer = loops[-1]
        names: set[str] = set()
        for c in walk_scope(outer):
            if isinstance(c, ast.Call) and method(c) == "backward":
                names |= backwarded(c)
        lower = arg.id.lower()
        lossy = "loss" in lower and not lower.endswith(("fn", "func", "function", "fns"))
        if arg.id not in names and not lossy:
            continue
        # loss = loss.item() (or .detach(), or a local helper that returns a float) in the
        # loop: the list holds no graph.
        if any(
            name == arg.id and script.holds_no_graph(value)
            for node in walk_scope(outer)
            for name, value in assigned_names(node)
        ):
            continue
        yield call, f"`{arg.id}` appended to a list inside a loop"


@rule(
    "LK003",
    theme="memory",
    flags="`torch.cuda.empty_cache()` inside a loop",
    why="it synchronizes the device and hands back cached blocks that the allocator must "
    "then get again with slow cudaMalloc calls",
    fix="remove it: the caching allocator reuses its blocks",
)
def empty_cache_in_loop(script: Script) -> Iterator[Hit]:
    for call in script.calls_to("empty_cache"):
        # Not where an out-of-memory is caught and retried with less: there it is the fix.
        if script.loops_of(call) and not script.in_try(call):
            name = dotted(call.func) or "empty_cache"
            yield call, f"`{name}()` inside a loop"


@rule(
    "LK004",
    theme="memory",
    flags="`torch.zeros(...).cuda()` in a loop or `forward()`",
    why="the tensor is built in host memory and copied to the device on every step",
    fix="create it on the device: torch.zeros(..., device=device), or register a buffer",
)
def host_factory_moved(script: Script) -> Iterator[Hit]:
    for call in script.calls:
        if device_move(call) != "device":
            continue
        inner = receiver(call)
        if not isinstance(inner, ast.Call) or not isinstance(inner.func, ast.Attribute):
            continue
        if dotted(inner.func.value) != "torch" or inner.func.attr not in _FACTORIES:
            continue
        if any(k.arg in {"device", None} for k in inner.keywords):
            continue
        scope = script.scope_of(call)
        in_forward = isinstance(scope, FUNCS) and scope.name == "forward"
        # Every step: in a training step loop (a per-epoch loop builds it once an epoch).
        per_step = any(loop in script.shape.step_loops for loop in script.loops_of(call))
        if per_step or in_forward:
            where = "in forward()" if in_forward and not per_step else "in a training loop"
            yield call, f"`torch.{inner.func.attr}(...)` built on the CPU, then moved, {where}"


@rule(
    "LK015",
    theme="memory",
    flags="a loss tensor summed across steps (`total_loss += loss`)",
    why="the running sum is a tensor that holds every step's autograd graph and activations, "
    "so memory grows with every step until the loop ends",
    fix="total_loss += loss.detach()  # or log = loopkit.detach_logging(every=N); log(loss=loss)",
)
def loss_summed_across_steps(script: Script) -> Iterator[Hit]:
    for loop in script.shape.step_loops:
        body = script.loop_body(loop)
        losses: set[str] = set()
        for node in body:
            if isinstance(node, ast.Call) and method(node) == "backward":
                losses |= backwarded(node)
        for node in body:
            if not (isinstance(node, ast.AugAssign) and isinstance(node.op, ast.Add)):
                continue
            value, target = node.value, node.target
            if not isinstance(target, ast.Name) or script.grad_off(node):
                continue
            if isinstance(value, ast.Name) and value.id in losses:
                assigned_in_loop = {n for x in body for n, _ in assigned_names(x)}
                if target.id not in assigned_in_loop - {target.id} and not any(
                    n == value.id and script.holds_no_graph(v)
                    for x in body
                    for n, v in assigned_names(x)
                ):
                    yield node, f"`{target.id} += {value.id}` sums the loss tensor across steps"
