"""Which expressions of a script build a tensor in host memory (LK004's question): torch's
factories without ``device=``, tensor types and their aliases, numpy-made data, and names
bound to such a tensor earlier in the same function."""

from __future__ import annotations

import ast

from .._script import Script
from .._syntax import (
    FUNCS,
    assigned_names,
    callee,
    device_move,
    dotted,
    method,
    receiver,
    walk_scope,
)
from ._factories import data_arg, no_elements

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


_ON_HOST = frozenset(
    {
        "fill_",
        "zero_",
        "normal_",
        "uniform_",
        "random_",
        "float",
        "long",
        "int",
        "half",
        "double",
        "bool",
        "unsqueeze",
        "view",
        "reshape",
        "expand",
        "repeat",
        "contiguous",
        "requires_grad_",
    }
)
_TENSOR_TYPES = frozenset(
    {
        "Tensor",
        "FloatTensor",
        "DoubleTensor",
        "HalfTensor",
        "LongTensor",
        "IntTensor",
        "ByteTensor",
        "BoolTensor",
    }
)


def _tensor_type_aliases(script: Script) -> dict[str, str]:
    """Names bound to a tensor type: 'host' (``torch.FloatTensor``, ``from torch import
    Tensor``) or 'cuda' (``torch.cuda.FloatTensor``, or ``torch.cuda.FloatTensor if cuda else
    torch.FloatTensor``: on a GPU run it builds on the device directly)."""
    aliases: dict[str, str] = {}
    for node in script.nodes:
        if isinstance(node, ast.ImportFrom) and node.module == "torch":
            for alias in node.names:
                if alias.name in _TENSOR_TYPES:
                    aliases[alias.asname or alias.name] = "host"
        for name, value in assigned_names(node):
            kinds = {_tensor_type(v) for v in _branches(value)}
            if kinds == {"host"}:
                aliases[name] = "host"
            elif "cuda" in kinds and kinds <= {"cuda", "host"}:
                aliases[name] = "cuda"
    return aliases


def _branches(value: ast.expr | None) -> list[ast.expr | None]:
    if isinstance(value, ast.IfExp):
        return [*_branches(value.body), *_branches(value.orelse)]
    return [value]


def _tensor_type(value: ast.expr | None) -> str | None:
    name = dotted(value) or ""
    if name.rsplit(".", 1)[-1] not in _TENSOR_TYPES or not name.startswith("torch."):
        return None
    return "cuda" if name.startswith("torch.cuda.") else "host"


class HostTensors:
    """Which expressions of a script build a tensor in host memory."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.aliases = _tensor_type_aliases(script)

    def type_of_call(self, call: ast.Call) -> str | None:
        """'host'/'cuda' for a call of a tensor type (``torch.FloatTensor(...)``, ``Tensor``)."""
        if isinstance(call.func, ast.Name):
            return self.aliases.get(call.func.id)
        return _tensor_type(call.func)

    def built(self, value: ast.expr | None) -> str | None:
        """``torch.ones(...)`` for a tensor that an expression builds fresh on the host
        (through ``Variable(...)`` and in-place fills); None for anything else (a batch, a
        model output, an environment's observation)."""
        while isinstance(value, ast.Call):
            if isinstance(value.func, ast.Name) and value.func.id == "Variable" and value.args:
                value = value.args[0]
            elif method(value) in _ON_HOST:
                value = receiver(value)
            else:
                break
        if not isinstance(value, ast.Call) or any(
            k.arg in {"device", None} for k in value.keywords
        ):
            return None
        func = value.func
        factory = (
            isinstance(func, ast.Attribute)
            and dotted(func.value) in self.script.torch_names
            and func.attr in _FACTORIES
        )
        if factory and no_elements(value):
            return None  # torch.empty(0).to(device): a placeholder, no bytes cross
        if (
            isinstance(func, ast.Attribute)
            and dotted(func.value) in self.script.torch_names
            and func.attr in {"from_numpy", "as_tensor"}
            and value.args
        ):
            # torch.from_numpy(np.ones(...)): numpy data the script makes (not a batch's).
            made = self.made_by_numpy(value.args[0], value)
            return f"{ast.unparse(func)}(...)" if made else None
        if factory or self.type_of_call(value) == "host":
            # Data from a variable (an observation, a batch) has to cross anyway: only data
            # the script makes itself on the host (numpy) could be made on the device instead.
            data = data_arg(value, legacy=not factory)
            if data is not None and not self.made_by_numpy(data, value):
                return None
            return f"{ast.unparse(func)}(...)"
        return None

    def copies_host_data(self, call: ast.Call) -> bool:
        """A CUDA tensor type called on data the script builds on the host
        (``Tensor(np.random.normal(...))`` with ``Tensor = torch.cuda.FloatTensor``): the data
        is copied over. Called on sizes (``Tensor(b, 1)``) it allocates on the device: no copy,
        no finding; on a variable (an observation) the copy is the data's way in."""
        kind = self.type_of_call(call)
        if kind != "cuda":
            # torch.set_default_device("cuda") in the program: torch.Tensor([...]) and
            # torch.tensor([...]) build on the device from host data, a copy each call.
            built = kind == "host" or (
                callee(call) in {"tensor", "as_tensor"}
                and (dotted(call.func) or "").split(".")[0] in self.script.torch_names
            )
            if not (built and self.script.default_on_device):
                return False
        data = data_arg(call, legacy=True)
        return data is not None and self.made_by_numpy(data, call)

    def made_by_numpy(self, data: ast.expr, at: ast.AST) -> bool:
        """Literal data (a list), a numpy call, or a name bound to one in the same function."""
        if isinstance(data, ast.List | ast.Tuple | ast.ListComp):
            return True
        if isinstance(data, ast.Call):
            return (dotted(data.func) or "").startswith(("np.", "numpy."))
        if isinstance(data, ast.Name):
            scope = self.script.scope_of(at)
            values = [
                v
                for n in walk_scope(scope)
                for name, v in assigned_names(n)
                if name == data.id and v is not None
            ]
            return bool(values) and all(
                isinstance(v, ast.Call) and (dotted(v.func) or "").startswith(("np.", "numpy."))
                for v in values
            )
        return False

    def moves_of_named(self) -> dict[ast.Call, str]:
        """Moves of a name bound, earlier in the same function, to a tensor built on the host
        (``labels = torch.cat([torch.arange(b)] * 2); ...; labels = labels.to(device)``)."""
        found: dict[ast.Call, str] = {}
        scopes: list[ast.AST] = [self.script.tree]
        scopes += [n for n in ast.walk(self.script.tree) if isinstance(n, FUNCS)]
        for scope in scopes:
            stmts = sorted(
                (n for n in walk_scope(scope) if isinstance(n, ast.stmt)),
                key=lambda n: (n.lineno, n.col_offset),
            )
            host: dict[str, int] = {}
            for stmt in stmts:
                for node in _own_expressions(stmt):
                    if (
                        isinstance(node, ast.Call)
                        and device_move(node) == "device"
                        and isinstance(receiver(node), ast.Name)
                    ):
                        name = receiver(node).id  # type: ignore[union-attr]
                        if name in host:
                            found[node] = (
                                f"`{name}` built on the CPU (line {host[name]}), then moved"
                            )
                for name, value in assigned_names(stmt):
                    if value is not None and self.host_expr(value, host):
                        host[name] = stmt.lineno
                    else:
                        host.pop(name, None)
        return found

    def host_expr(self, value: ast.expr, host: dict[str, int]) -> bool:
        """Whether an expression is a host tensor: built fresh, or computed from such."""
        if isinstance(value, ast.Name):
            return value.id in host
        if isinstance(value, ast.Compare | ast.BinOp):
            parts = (
                [value.left, *value.comparators]
                if isinstance(value, ast.Compare)
                else [value.left, value.right]
            )
            tensors = [p for p in parts if not isinstance(p, ast.Constant)]
            return bool(tensors) and all(self.host_expr(p, host) for p in tensors)
        if not isinstance(value, ast.Call):
            return False
        if self.built(value) is not None:
            return True
        func = dotted(value.func) or ""
        head, _, last = func.rpartition(".")
        if head in self.script.torch_names and last in {"cat", "stack"} and value.args:
            seq = value.args[0]
            items = [seq.elt] if isinstance(seq, ast.ListComp) else getattr(seq, "elts", [])
            return bool(items) and all(self.host_expr(i, host) for i in items)
        if method(value) in _ON_HOST:
            base = receiver(value)
            return base is not None and self.host_expr(base, host)
        return False


def _own_expressions(stmt: ast.stmt) -> list[ast.AST]:
    """The nodes a statement evaluates itself (a compound one: its header only)."""
    if isinstance(stmt, ast.If | ast.While):
        return list(ast.walk(stmt.test))
    if isinstance(stmt, ast.For | ast.AsyncFor):
        return list(ast.walk(stmt.iter))
    if isinstance(stmt, ast.With | ast.AsyncWith):
        return [n for item in stmt.items for n in ast.walk(item.context_expr)]
    if isinstance(stmt, ast.Try | ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return []
    return list(ast.walk(stmt))
