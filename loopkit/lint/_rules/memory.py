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
        if script.loops_of(call):
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
        if script.loops_of(call) or in_forward:
            where = "in forward()" if in_forward and not script.loops_of(call) else "in a loop"
            yield call, f"`torch.{inner.func.attr}(...)` built on the CPU, then moved, {where}"
