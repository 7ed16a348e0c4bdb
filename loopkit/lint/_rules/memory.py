"""Rules about memory: a graph kept in a list, the cache emptied, tensors built on the host."""

from __future__ import annotations

import ast
from collections.abc import Iterator

from .._declaration import Hit, rule
from .._program import qualname
from .._script import Script
from .._syntax import (
    FUNCS,
    assigned_names,
    backwarded,
    callee,
    device_move,
    dotted,
    method,
    receiver,
    walk_scope,
)
from ._host_tensors import HostTensors


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
    flags="`torch.cuda.empty_cache()` inside a loop (not under `if step % N`)",
    why="it synchronizes the device and hands back cached blocks that the allocator must "
    "then get again with slow cudaMalloc calls",
    fix="remove it: the caching allocator reuses its blocks",
)
def empty_cache_in_loop(script: Script) -> Iterator[Hit]:
    for call in script.calls_to("empty_cache"):
        # Not where an out-of-memory is caught and retried with less: there it is the fix;
        # not under `if step % N == 0:` (once per N steps: a rare release, not a habit).
        loops = script.loops_of(call)
        if loops and not script.in_try(call) and not script.guarded_by_mod(call, loops[-1]):
            name = dotted(call.func) or "empty_cache"
            yield call, f"`{name}()` inside a loop"


@rule(
    "LK004",
    theme="memory",
    flags="a tensor built on the host and moved to the device every step or in `forward()`: "
    "`torch.ones(...).to(device)`, `Tensor(b, 1).fill_(1.0).cuda()`, `torch.FloatTensor(...)`, "
    "a CUDA tensor type built from numpy or a list (also in functions a training step or a "
    "`forward()` calls; not a zero-element placeholder)",
    why="the tensor is built in host memory and copied to the device on every step",
    fix="build it on the device: torch.ones(..., device=device) (torch.randn(..., "
    "device=device) for np.random), or once, outside the loop (a buffer for forward())",
)
def host_factory_moved(script: Script) -> Iterator[Hit]:
    yield from host_indexed(script)
    host = HostTensors(script)
    named = host.moves_of_named()
    for call in script.calls:
        what = None
        if device_move(call) == "device":
            fill = _cache_fill(script, call)
            built = host.built(receiver(call))
            if fill == "misses":
                what = (
                    "a cache tested under one key and filled under another: it never hits, so "
                    "this move runs at every call"
                )
            elif fill == "hits":
                continue  # a cache filled once per key: the move runs once
            elif built is not None:
                what = f"`{built}` built on the CPU, then moved"
            elif call in named:
                what = named[call]
        elif host.copies_host_data(call):
            what = f"`{ast.unparse(call.func)}(...)` of host data copied to the device"
        if what is None:
            continue
        scope = script.scope_of(call)
        in_forward = isinstance(scope, FUNCS) and scope.name == "forward"
        # Every step: in a training step loop (a per-epoch loop builds it once an epoch), in a
        # one-step function a loop calls, or in a function a training step calls.
        per_step = any(loop in script.shape.step_loops for loop in script.loops_of(call))
        stepping = scope in script.shape.called_step_funcs and not script.guarded_by_mod(
            call, scope
        )
        reach = None if per_step or stepping else script.reach_of(call)
        if per_step or stepping:
            yield call, f"{what}, in a training loop"
        elif reach is not None:
            yield call, f"{what}, every step in `{qualname(script, scope)}`, {reach.describe()}"
        elif in_forward and not script.in_flag_branch(call, scope):
            yield call, f"{what}, in forward()"
        elif isinstance(scope, FUNCS) and not script.guarded_by_mod(call, scope):
            caller = _called_in_forward(script, scope)
            if caller is not None:
                yield call, f"{what}, in `{scope.name}`, called from forward() at {caller}"


# numpy calls that make an index array (a scalar index, np.random.randint(n), copies nothing).
_INDEX_ARRAYS = {"arange", "array", "asarray", "where", "nonzero", "flatnonzero", "permutation",
                 "argsort", "concatenate", "unique"}  # fmt: skip


def host_indexed(script: Script) -> Iterator[Hit]:
    """``emb[idx]`` in a training step, ``emb`` a device tensor (bound to a ``.to(device)``
    or ``.cuda()`` in the same function) and ``idx`` a numpy array made in the step
    (``np.random.choice(n, k)``, ``np.arange``): the index array is copied to the device."""
    for loop in script.shape.step_loops:
        scope = script.scope_of(loop)
        on_device = {
            name
            for node in walk_scope(scope)
            for name, value in assigned_names(node)
            if isinstance(value, ast.Call) and device_move(value) == "device"
        }
        body = script.loop_body(loop)
        arrays = {
            name
            for node in body
            for name, value in assigned_names(node)
            if isinstance(value, ast.Call) and _index_array(value)
        }
        for node in body:
            if (
                isinstance(node, ast.Subscript)
                and isinstance(node.ctx, ast.Load)
                and isinstance(node.value, ast.Name)
                and node.value.id in on_device
                and isinstance(node.slice, ast.Name)
                and node.slice.id in arrays
                and not script.guarded_by_mod(node, loop)
            ):
                yield (
                    node,
                    f"`{ast.unparse(node)}`: a device tensor indexed with a numpy array, copied "
                    "to the device every step, in a training loop",
                )


def _index_array(call: ast.Call) -> bool:
    name = dotted(call.func) or ""
    if not name.startswith(("np.", "numpy.")):
        return False
    last = name.rsplit(".", 1)[-1]
    if last in {"choice", "randint"}:  # an array only with a size
        size = len(call.args) >= (2 if last == "choice" else 3)
        return size or any(k.arg == "size" for k in call.keywords)
    return last in _INDEX_ARRAYS


def _cache_fill(script: Script, call: ast.Call) -> str | None:
    """Whether ``call`` fills a cache: under ``if key not in cache:``, "hits" when the body
    stores under the key tested (the fill runs once per key), "misses" when it stores only
    under other keys (``cache[str(fmax) + "_" + str(device)] = ...`` after testing ``fmax``:
    the test never finds what was stored, so the body runs at every call); else None."""
    child: ast.AST = call
    parent = script.parents.get(call)
    while parent is not None and not isinstance(parent, FUNCS):
        if isinstance(parent, ast.If) and any(stmt is child for stmt in parent.body):
            test = parent.test
            if isinstance(test, ast.Compare) and [type(op) for op in test.ops] == [ast.NotIn]:
                cache: ast.expr = test.comparators[0]
                if isinstance(cache, ast.Call) and method(cache) == "keys":
                    cache = receiver(cache) or cache
                name = dotted(cache)
                stored = [
                    target.slice
                    for node in ast.walk(parent)
                    if isinstance(node, ast.Assign)
                    for target in node.targets
                    if isinstance(target, ast.Subscript) and name and dotted(target.value) == name
                ]
                if stored:
                    return _hit_or_miss(test.left, stored)
        child, parent = parent, script.parents.get(parent)
    return None


def _hit_or_miss(tested: ast.expr, stored: list[ast.expr]) -> str:
    """ "misses" when every store builds a string key (``str(fmax) + "_" + ...``, an
    f-string) and the key tested is no string (a number never equals a string); else "hits":
    the same key, or another spelling of it (``key = (n, d)``, ``int(n)``) taken on trust."""
    if any(ast.unparse(key) == ast.unparse(tested) for key in stored) or _builds_str(tested):
        return "hits"
    return "misses" if all(_builds_str(key) for key in stored) else "hits"


def _builds_str(key: ast.expr) -> bool:
    if isinstance(key, ast.JoinedStr) or (
        isinstance(key, ast.Constant) and isinstance(key.value, str)
    ):
        return True
    if isinstance(key, ast.Call) and callee(key) == "str":
        return True
    return (
        isinstance(key, ast.BinOp)
        and isinstance(key.op, ast.Add)
        and (_builds_str(key.left) or _builds_str(key.right))
    )


def _called_in_forward(script: Script, func: ast.FunctionDef | ast.AsyncFunctionDef) -> str | None:
    """``models.py:495``: where a module's forward() calls ``func`` on every forward (not
    under ``% N`` nor in a branch only inference takes), if it does; else None."""
    for where, call in script.callers(func):
        forward = where.scope_of(call)
        if not isinstance(forward, FUNCS) or forward.name != "forward":
            continue
        if where.guarded_by_mod(call, forward) or where.in_flag_branch(call, forward):
            continue
        return f"{where.path}:{call.lineno}"
    return None


# What a fresh host tensor goes through before its move, still on the host.
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
