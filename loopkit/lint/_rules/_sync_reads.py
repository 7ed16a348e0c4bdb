"""What the sync rules ask of a read or a test: is the value on the device, is it needed on
the host anyway (an environment's input, a per-sample loop), is a truth a tensor's."""

from __future__ import annotations

import ast

from .._script import Loop, Script
from .._syntax import (
    assigned_names,
    callee,
    dotted,
    method,
    receiver,
    root_name,
    walk_scope,
    walk_stmts,
)

# The tensor methods that copy to the host and wait for the device.
SYNCS = frozenset({"item", "cpu", "numpy", "tolist"})
# What waits for the device: ``.numpy()`` raises on a device tensor, so the tensor it runs on
# is on the host already (a batch before its move; the ``.cpu()`` before it, if any, is the read).
DEVICE_READS = SYNCS - {"numpy"}


def reads_device(call: ast.Call) -> bool:
    """``x.item()``, ``x.cpu()``, ``x.tolist()`` (no arguments: numpy's take some), and
    ``x.numpy(force=True)``, which copies a device tensor instead of raising."""
    name = method(call)
    if name == "numpy":
        return any(
            k.arg == "force" and not (isinstance(k.value, ast.Constant) and not k.value.value)
            for k in call.keywords
        )
    return name in DEVICE_READS and not call.args


def straight_from_loader(call: ast.Call, loop: ast.For | ast.AsyncFor) -> bool:
    """True for ``y.numpy()`` on a batch the loop gets from the loader (host memory): not
    rebound on a line before the read (``labels = f(labels.numpy())`` reads the loader's)."""
    root = root_name(receiver(call))
    targets = {n.id for n in ast.walk(loop.target) if isinstance(n, ast.Name)}
    if root is None or root not in targets:
        return False
    return not any(
        name == root and getattr(node, "lineno", call.lineno) < call.lineno
        for node in walk_stmts(loop.body)
        for name, _ in assigned_names(node)
    )


_HOST_TYPES = frozenset({"Tensor", "FloatTensor", "LongTensor", "IntTensor", "DoubleTensor"})


def host_built(script: Script, call: ast.Call) -> bool:
    """A read of a tensor the same expression builds on the host (``torch.ones(3).cpu()``,
    ``torch.Tensor([a, b]).cpu()``): nothing is on the device to wait for."""
    node: ast.AST | None = receiver(call)
    while isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        name = dotted(node.func) or ""
        head, _, last = name.rpartition(".")
        if head in script.torch_names:
            return (last in _HOST_FACTORIES or last in _HOST_TYPES) and not any(
                k.arg in {"device", None} for k in node.keywords
            )
        node = node.func.value
    return False


_HOST_FACTORIES = frozenset(
    {"zeros", "ones", "full", "empty", "arange", "eye", "linspace", "tensor", "rand", "randn"}
)


def feeds_an_environment(script: Script, call: ast.Call) -> bool:
    """A read whose value steps a host environment (``envs.step(actions)`` after
    ``actions = q.argmax(1).cpu().numpy()``): the transfer is the algorithm's input."""
    stmt: ast.AST | None = call
    while stmt is not None and not isinstance(stmt, ast.stmt):
        stmt = script.parents.get(stmt)
    bound = {n for n, _ in assigned_names(stmt)} if stmt is not None else set()
    regions: list[ast.AST] = [*script.loops_of(call)] or [script.scope_of(call)]
    for region in regions:
        for node in walk_scope(region):
            if not (isinstance(node, ast.Call) and method(node) == "step"):
                continue
            if "env" not in (dotted(receiver(node)) or "").lower():
                continue
            if any(within(call, a) for a in node.args) or bound & names_in(node):
                return True
    return False


def feeds_per_sample_loop(script: Script, call: ast.Call, loops: list[Loop]) -> bool:
    """Whether the read serves a per-sample Python loop (printing each mistake, writing each
    prediction): the read is in that loop, or in its iterable, or its result is what a later
    loop of the batch iterates. There the values are needed on the host, one by one."""
    batch_loop = next((loop for loop in loops if script.evaluates(loop)), None)
    if batch_loop is None:
        return False
    inner = loops[: loops.index(batch_loop)]
    # The read sits in a loop nested in the batch loop that loads no batch of its own: it
    # runs over the batch's samples (zip(preds, labels), range(len(preds))).
    if any(not _calls_a_model(loop) for loop in inner):
        return True
    parent = script.parents.get(call)
    while parent is not None and parent is not batch_loop:
        if isinstance(parent, ast.For | ast.AsyncFor | ast.comprehension) and within(
            call, parent.iter
        ):
            return True  # for p, t in zip(pred.tolist(), y.tolist()):
        parent = script.parents.get(parent)
    stmt: ast.AST | None = call
    while stmt is not None and not isinstance(stmt, ast.stmt):
        stmt = script.parents.get(stmt)
    if not isinstance(stmt, ast.Assign):
        return False
    bound = {n.id for t in stmt.targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    for later in script.following(stmt):
        for node in ast.walk(later):
            if isinstance(node, ast.For | ast.AsyncFor | ast.comprehension) and bound & names_in(
                node.iter
            ):
                return True
    return False


def _calls_a_model(loop: ast.AST) -> bool:
    """Whether a loop loads or computes a batch: it calls something other than builtins and
    tensor methods (a model, a loader's next, get_batch)."""
    plain = {"range", "len", "zip", "enumerate", "print", "int", "float", "str", "min", "max"}
    for node in ast.walk(loop):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id not in plain
        ):
            return True
    return False


def within(node: ast.AST, root: ast.AST) -> bool:
    return any(n is node for n in ast.walk(root))


def names_in(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


# torch functions (and tensor methods) whose result Python turns into a bool with a sync.
_TRUTHY = frozenset(
    {"isnan", "isinf", "isfinite", "any", "all", "equal", "allclose", "isclose", "is_nonzero"}
)


_HOST_LIBS = ("np.", "numpy.", "math.")


def reads_explicitly(test: ast.AST) -> bool:
    return any(
        isinstance(n, ast.Call) and (method(n) in SYNCS or callee(n) in {"float", "int", "bool"})
        for n in ast.walk(test)
    )


def from_loader_only(test: ast.AST, loop: ast.For | ast.AsyncFor) -> bool:
    names = names_in(test) - {"torch"}
    targets = {n.id for n in ast.walk(loop.target) if isinstance(n, ast.Name)}
    rebound = {n for node in walk_stmts(loop.body) for n, _ in assigned_names(node)}
    return bool(names) and names <= targets - rebound


def tensor_truth(expr: ast.AST, tensors: frozenset[str] = frozenset()) -> bool:
    """Whether Python takes the truth of a tensor here: ``torch.isnan(x)``, ``t.any()``,
    ``(x > 0).all()``, ``torch.norm(g) > 10``, ``coef < 1`` with ``coef`` one of
    ``tensors``; not numpy's, math's or the builtin any()."""
    if isinstance(expr, ast.BoolOp):
        return any(tensor_truth(v, tensors) for v in expr.values)
    if isinstance(expr, ast.UnaryOp) and isinstance(expr.op, ast.Not):
        return tensor_truth(expr.operand, tensors)
    if isinstance(expr, ast.Compare):
        parts = [expr.left, *expr.comparators]
        return any(_torch_rooted(p) or (isinstance(p, ast.Name) and p.id in tensors) for p in parts)
    if not isinstance(expr, ast.Call):
        return False
    if (
        isinstance(expr.func, ast.Name)
        and expr.func.id in {"any", "all"}
        and len(expr.args) == 1
        and isinstance(expr.args[0], ast.GeneratorExp | ast.ListComp)
    ):
        return tensor_truth(expr.args[0].elt)  # any(not th.isfinite(p.grad).all() for p ...)
    if any((dotted(c.func) or "").startswith(_HOST_LIBS) for c in _calls_in(expr)):
        return False
    if isinstance(expr.func, ast.Attribute) and expr.func.attr in _TRUTHY:
        base = dotted(expr.func.value)
        return base not in {"np", "numpy", "math"}
    return False


def _torch_rooted(expr: ast.AST) -> bool:
    """A call chain that starts at a ``torch.`` function: a tensor, whatever follows."""
    node = expr
    while isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        name = dotted(node.func) or ""
        if name.startswith("torch.") or name.startswith("th."):
            return True
        node = node.func.value
    return False


def _calls_in(expr: ast.AST) -> list[ast.Call]:
    return [n for n in ast.walk(expr) if isinstance(n, ast.Call)]


def tensor_branch_never_taken(script: Script, call: ast.Call) -> bool:
    """A read under ``if isinstance(v, torch.Tensor):`` in a function whose every call site
    (in the files checked) passes only host values (``loss=loss.item()``, ``float(x)``, a
    number, an optimizer's ``param_groups[0]["lr"]``, a name bound only to one): the branch
    never runs. A call site with ``*args``/``**kwargs`` or any other value keeps the read."""
    root = root_name(receiver(call))
    func = script.scope_of(call)
    if root is None or not _under_tensor_check(script, call, root, func):
        return False
    if not isinstance(func, ast.FunctionDef | ast.AsyncFunctionDef):
        return False
    sites = script.callers(func)
    return bool(sites) and all(_passes_host_values(where, site) for where, site in sites)


def _under_tensor_check(script: Script, node: ast.AST, name: str, stop: ast.AST) -> bool:
    child, parent = node, script.parents.get(node)
    while parent is not None and parent is not stop:
        if isinstance(parent, ast.If) and any(s is child for s in parent.body):
            test = parent.test
            if (
                isinstance(test, ast.Call)
                and callee(test) == "isinstance"
                and len(test.args) == 2
                and isinstance(test.args[0], ast.Name)
                and test.args[0].id == name
                and (dotted(test.args[1]) or "").endswith("Tensor")
            ):
                return True
        child, parent = parent, script.parents.get(parent)
    return False


def _passes_host_values(script: Script, call: ast.Call) -> bool:
    values = [*call.args, *(k.value for k in call.keywords)]
    if any(isinstance(a, ast.Starred) for a in call.args) or any(
        k.arg is None for k in call.keywords
    ):
        return False  # **losses: whatever the dict holds
    scope = script.scope_of(call)
    return all(_host_value(script, v, scope, 0) for v in values)


def _host_value(script: Script, value: ast.AST | None, scope: ast.AST, depth: int) -> bool:
    """A Python number or string, not a tensor: a constant, ``x.item()``, ``x.tolist()``,
    ``float(...)``/``int(...)``/``len(...)``, ``optimizer.param_groups[i][key]``, arithmetic of
    such, or a name every binding of which in its function is one."""
    if isinstance(value, ast.Constant):
        return True
    if isinstance(value, ast.BinOp):
        return all(_host_value(script, v, scope, depth) for v in (value.left, value.right))
    if isinstance(value, ast.UnaryOp):
        return _host_value(script, value.operand, scope, depth)
    if isinstance(value, ast.Call):
        if isinstance(value.func, ast.Name):
            return value.func.id in {"float", "int", "round", "len", "bool", "str"}
        return method(value) in {"item", "tolist"}
    if isinstance(value, ast.Subscript):
        inner = value.value
        return (
            isinstance(inner, ast.Subscript)
            and isinstance(inner.value, ast.Attribute)
            and inner.value.attr == "param_groups"
        )
    if isinstance(value, ast.Name) and depth < 3:
        bound = [v for n in walk_scope(scope) for b, v in assigned_names(n) if b == value.id]
        return bool(bound) and all(_host_value(script, v, scope, depth + 1) for v in bound)
    return False


def gradient_tensors(func: ast.AST) -> frozenset[str]:
    """Names a function binds, every time, to a tensor computed from a gradient
    (``norm = p.grad.data.norm(2)``) or from such a name by arithmetic
    (``coef = clip / (norm + 1e-6)``): device tensors, whose truth is a sync."""
    found: set[str] = set()
    stmts = sorted(
        (n for n in walk_scope(func) if isinstance(n, ast.Assign)),
        key=lambda n: (n.lineno, n.col_offset),
    )
    for stmt in stmts:
        for name, value in assigned_names(stmt):
            if value is not None and _from_gradient(value, found):
                found.add(name)
            else:
                found.discard(name)
    return frozenset(found)


def _from_gradient(value: ast.AST, tensors: set[str]) -> bool:
    if isinstance(value, ast.Name):
        return value.id in tensors
    if isinstance(value, ast.BinOp):
        parts = [value.left, value.right]
        if not any(_from_gradient(p, tensors) for p in parts):
            return False
        return all(isinstance(p, ast.Constant | ast.Name | ast.BinOp) for p in parts)
    if isinstance(value, ast.Call) and method(value) in {"norm", "abs", "max", "sum", "mean"}:
        base = receiver(value)
        while isinstance(base, ast.Attribute | ast.Call):  # p.grad.data.norm(2)
            if isinstance(base, ast.Call):
                base = receiver(base)
            elif base.attr == "grad":
                return isinstance(base.value, ast.Name)
            else:
                base = base.value
    return False
