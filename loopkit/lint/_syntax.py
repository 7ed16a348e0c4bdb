"""Pure questions about one piece of syntax: what a call calls, what a statement binds."""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator

LOOPS = (ast.For, ast.AsyncFor, ast.While)
FUNCS = (ast.FunctionDef, ast.AsyncFunctionDef)
# Bodies that do not run where they are written: a loop around a def does not loop its body.
SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef, ast.Module)
LOOP_OR_SCOPE = (*LOOPS, *SCOPES)
GRAD_OFF = frozenset({"no_grad", "inference_mode", "set_grad_enabled"})
# Results that carry no autograd graph (a Python number, or a tensor cut from the graph).
_DETACHING = frozenset({"item", "detach", "tolist", "numpy"})
_DTYPES = frozenset(
    {
        "float",
        "float16",
        "half",
        "bfloat16",
        "float32",
        "float64",
        "double",
        "int",
        "int8",
        "int16",
        "int32",
        "int64",
        "long",
        "short",
        "uint8",
        "bool",
        "complex64",
        "complex128",
        "cfloat",
        "cdouble",
    }
)


def dotted(node: ast.AST | None) -> str | None:
    """``a.b.c`` for a chain of names and attributes, else None."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = dotted(node.value)
        return None if base is None else f"{base}.{node.attr}"
    return None


def method(node: ast.AST) -> str | None:
    """The method name of a call ``x.name(...)``, else None."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        return node.func.attr
    return None


def callee(node: ast.Call) -> str:
    """The last name of what a call calls: ``DataLoader`` for ``torch.utils.data.DataLoader``."""
    if isinstance(node.func, ast.Name):
        return node.func.id
    if isinstance(node.func, ast.Attribute):
        return node.func.attr
    return ""


def receiver(call: ast.Call) -> ast.expr | None:
    """``x`` in ``x.method(...)``."""
    return call.func.value if isinstance(call.func, ast.Attribute) else None


def chain(node: ast.AST) -> list[ast.Call]:
    """The method calls of ``a.f().g().h()``, outermost first."""
    calls: list[ast.Call] = []
    while isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        calls.append(node)
        node = node.func.value
    return calls


def root_name(node: ast.AST | None) -> str | None:
    """The name an expression such as ``x[0].float().cpu()`` starts from."""
    while True:
        if isinstance(node, ast.Name):
            return node.id
        if isinstance(node, ast.Attribute | ast.Subscript):
            node = node.value
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            node = node.func.value
        else:
            return None


def keyword(call: ast.Call, name: str) -> ast.keyword | None:
    return next((k for k in call.keywords if k.arg == name), None)


def is_const(node: ast.AST | None, value: object) -> bool:
    return (
        isinstance(node, ast.Constant) and type(node.value) is type(value) and node.value == value
    )


def has_mod(test: ast.AST) -> bool:
    return any(isinstance(n, ast.BinOp) and isinstance(n.op, ast.Mod) for n in ast.walk(test))


def names_grad_off(node: ast.AST) -> bool:
    """True for the node itself being the name no_grad, inference_mode or set_grad_enabled."""
    return (isinstance(node, ast.Attribute) and node.attr in GRAD_OFF) or (
        isinstance(node, ast.Name) and node.id in GRAD_OFF
    )


def mentions_grad_off(node: ast.AST) -> bool:
    """True when an expression names no_grad, inference_mode or set_grad_enabled."""
    return any(names_grad_off(n) for n in ast.walk(node))


def walk_scope(root: ast.AST) -> Iterator[ast.AST]:
    """Every node under ``root`` that runs with it: nested defs, classes, lambdas skipped."""
    stack = list(ast.iter_child_nodes(root))
    while stack:
        node = stack.pop()
        if isinstance(node, SCOPES):
            continue
        yield node
        stack.extend(ast.iter_child_nodes(node))


def walk_stmts(stmts: Iterable[ast.stmt]) -> Iterator[ast.AST]:
    for stmt in stmts:
        if isinstance(stmt, SCOPES):
            continue
        yield stmt
        yield from walk_scope(stmt)


def assigned_names(node: ast.AST) -> Iterator[tuple[str, ast.expr | None]]:
    """(name, value) for each plain-name binding a statement or expression makes."""
    if isinstance(node, ast.Assign):
        for target in node.targets:
            for n in ast.walk(target):
                if isinstance(n, ast.Name):
                    yield n.id, node.value if isinstance(target, ast.Name) else None
    elif isinstance(node, ast.AugAssign | ast.AnnAssign | ast.NamedExpr):
        if isinstance(node.target, ast.Name):
            yield node.target.id, node.value
    elif isinstance(node, ast.For | ast.AsyncFor):
        for n in ast.walk(node.target):
            if isinstance(n, ast.Name):
                yield n.id, None


def is_detached(value: ast.AST | None) -> bool:
    """True for a value that holds no autograd graph: ``.item()``, ``.detach()``, float(...)."""
    if isinstance(value, ast.Constant):
        return True
    if not isinstance(value, ast.Call):
        return False
    if isinstance(value.func, ast.Name) and value.func.id in {"float", "int", "round", "bool"}:
        return True
    return any(c.func.attr in _DETACHING for c in chain(value) if isinstance(c.func, ast.Attribute))


def device_move(call: ast.Call) -> str | None:
    """'cpu' or 'device' when the call moves a tensor (``.cpu()``, ``.cuda()``, ``.to(dev)``)."""
    name = method(call)
    if name == "cpu":
        return "cpu"
    if name == "cuda":
        return "device"
    if name != "to" or any(k.arg is None for k in call.keywords):
        return None
    device = keyword(call, "device")
    target = device.value if device is not None else call.args[0] if call.args else None
    if target is None:
        return None  # .to(dtype=...) only: a conversion, not a move
    if is_const(target, "cpu"):
        return "cpu"
    name = dotted(target)
    if device is None and name is not None and name.rsplit(".", 1)[-1] in _DTYPES:
        return None  # .to(torch.float16)
    return "device"


def backward_tensor(call: ast.Call) -> ast.expr | None:
    """The tensor a ``.backward`` call back-propagates: ``loss`` in ``loss.backward()``,
    ``accelerator.backward(loss)``, ``scaler.scale(loss).backward()`` and
    ``dist_autograd.backward(context_id, [loss])``."""
    if call.args:
        dist = (dotted(receiver(call)) or "").endswith("dist_autograd")
        tensor: ast.expr | None = call.args[1] if dist and len(call.args) > 1 else call.args[0]
    else:
        tensor = receiver(call)
    if isinstance(tensor, ast.Call) and method(tensor) == "scale" and tensor.args:
        tensor = tensor.args[0]  # scaler.scale(loss): the loss, not the scaler
    return tensor


def backwarded(call: ast.Call) -> set[str]:
    """Names in the tensor a backward call back-propagates: ``loss`` in
    ``scaler.scale(loss).backward()``, ``accelerator.backward(loss)``,
    ``torch.autograd.backward(loss)``, ``(loss / n).backward()``; never the object whose
    method it is (``accelerator`` is an engine, not a loss) nor a function's name."""
    tensor = backward_tensor(call)
    if tensor is None:
        return set()
    callees = {
        id(n)
        for c in ast.walk(tensor)
        if isinstance(c, ast.Call)
        for n in ast.walk(c.func)
        if not isinstance(c.func, ast.Attribute) or n is not c.func.value
    }
    return {n.id for n in ast.walk(tensor) if isinstance(n, ast.Name) and id(n) not in callees}
