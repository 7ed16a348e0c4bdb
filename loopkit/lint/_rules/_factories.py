"""What a tensor factory call builds: the data it copies, or no elements at all."""

from __future__ import annotations

import ast

from .._syntax import callee, method


def no_elements(call: ast.Call) -> bool:
    """A factory call that builds a tensor of no elements: ``torch.empty(0)``,
    ``torch.zeros(0, 3)``, ``torch.zeros((0,))``, ``torch.tensor([])``."""
    if callee(call) in {"tensor", "as_tensor"}:
        data = call.args[0] if call.args else None
        return isinstance(data, ast.List | ast.Tuple) and not data.elts
    if callee(call) not in {"zeros", "ones", "empty", "randn", "rand", "full"} or not call.args:
        return False
    sizes = call.args[:1] if callee(call) == "full" else call.args
    if len(sizes) == 1 and isinstance(sizes[0], ast.List | ast.Tuple):
        sizes = sizes[0].elts
    return any(isinstance(a, ast.Constant) and a.value == 0 for a in sizes)


def data_arg(call: ast.Call, *, legacy: bool) -> ast.expr | None:
    """The data a constructor copies (``torch.tensor(x)``, a legacy ``Tensor(x)`` with one
    argument that is not a size); None when it is called on sizes (``torch.zeros(n)``)."""
    if callee(call) in {"tensor", "as_tensor"}:
        return call.args[0] if call.args else None
    if legacy and len(call.args) == 1 and not isinstance(call.args[0], ast.Constant):
        arg = call.args[0]
        if isinstance(arg, ast.Call) and method(arg) == "size":
            return None  # Tensor(x.size()): a size
        if isinstance(arg, ast.Attribute) and arg.attr == "shape":
            return None
        return arg
    return None
