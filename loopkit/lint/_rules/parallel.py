"""Rules about using several devices."""

from __future__ import annotations

import ast
from collections.abc import Iterator

from .._declaration import Hit, rule
from .._script import Script
from .._syntax import callee, dotted, method, receiver

# What wraps a model for several processes: DDP, FSDP1, loopkit's wrap (torch.compile of
# the result compiles around the wrapper's hooks).
# What wraps a model for several processes with hooks that a compile around it breaks at:
# DDP, FSDP2's fully_shard, loopkit's wrap. (FSDP1 is left out: PyTorch's FSDP1 recipe
# compiles the wrapped model, with use_orig_params=True.)
_WRAPPERS = frozenset({"DistributedDataParallel", "DDP", "fully_shard"})


@rule(
    "LK006",
    theme="parallel",
    flags="`nn.DataParallel(...)`",
    why="nn.DataParallel is one process that replicates the model on every step and whose "
    "threads contend for the GIL",
    fix="model = loopkit.distributed.wrap(model)  # DDP, under torchrun",
)
def data_parallel(script: Script) -> Iterator[Hit]:
    for call in script.calls_to("DataParallel"):
        yield call, "`nn.DataParallel` wraps the model"


def _wraps(value: ast.AST | None, loopkit_wrap: bool) -> bool:
    """Whether an expression builds a DDP/FSDP2-wrapped model (``DDP(m).to(device)`` too)."""
    while isinstance(value, ast.Call) and method(value) in ("to", "cuda", "cpu", "train"):
        value = receiver(value)
    if not isinstance(value, ast.Call):
        return False
    name = dotted(value.func) or ""
    return (
        callee(value) in _WRAPPERS
        or name.endswith("distributed.wrap")
        or (loopkit_wrap and name == "wrap")
    )


def _compiled_value(call: ast.Call, bare_compile: bool) -> ast.AST | None:
    """What ``torch.compile(x)`` / ``x.compile()`` compiles, else None."""
    name = dotted(call.func) or ""
    if name.endswith("torch.compile") or (bare_compile and name == "compile"):
        return call.args[0] if call.args else None
    if method(call) == "compile" and not name.startswith("torch"):
        return receiver(call)
    return None


def _imports(script: Script, module: str, name: str) -> bool:
    """Whether the script has ``from module import name``."""
    found = script.import_froms
    return any(n.module == module and any(a.name == name for a in n.names) for n in found)


class _Flow:
    """Walks one scope's statements in running order: which names hold a wrapped model."""

    def __init__(self, script: Script) -> None:
        self.loopkit_wrap = _imports(script, "loopkit.distributed", "wrap")
        self.bare_compile = _imports(script, "torch", "compile")
        self.hits: list[ast.Call] = []

    def block(self, stmts: list[ast.stmt], wrapped: set[str]) -> set[str]:
        for stmt in stmts:
            wrapped = self.statement(stmt, wrapped)
        return wrapped

    def statement(self, stmt: ast.stmt, wrapped: set[str]) -> set[str]:
        if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef | ast.Lambda):
            return wrapped  # its own scope
        if isinstance(stmt, ast.If | ast.Try):  # branches that exclude each other
            branches = [stmt.body, stmt.orelse]
            if isinstance(stmt, ast.Try):
                branches += [h.body for h in stmt.handlers] + [stmt.finalbody]
            self.calls(getattr(stmt, "test", None), wrapped)
            after = [self.block(b, set(wrapped)) for b in branches]
            return set().union(*after)
        if isinstance(stmt, ast.For | ast.AsyncFor | ast.While | ast.With | ast.AsyncWith):
            self.calls(getattr(stmt, "iter", None) or getattr(stmt, "test", None), wrapped)
            inner = self.block(stmt.body, set(wrapped))
            return wrapped | self.block(getattr(stmt, "orelse", []), inner)
        self.calls(stmt, wrapped)
        for target, value in _bindings(stmt):
            wraps = _wraps(value, self.loopkit_wrap)
            wrapped = wrapped | {target} if wraps else wrapped - {target}
        return wrapped

    def calls(self, node: ast.AST | None, wrapped: set[str]) -> None:
        if node is None:
            return
        for call in sorted((n for n in ast.walk(node) if isinstance(n, ast.Call)),
                           key=lambda c: (c.lineno, c.col_offset)):  # fmt: skip
            target = _compiled_value(call, self.bare_compile)
            if _wraps(target, self.loopkit_wrap) or dotted(target) in wrapped:
                self.hits.append(call)
            if callee(call) == "fully_shard" and call.args and dotted(call.args[0]):
                wrapped.add(str(dotted(call.args[0])))  # shards it in place


def _bindings(stmt: ast.stmt) -> list[tuple[str, ast.expr | None]]:
    """(dotted target, value) for each name or attribute (``self.model``) a statement binds."""
    if isinstance(stmt, ast.Assign):
        pairs: list[tuple[str, ast.expr | None]] = []
        for target in stmt.targets:
            whole = isinstance(target, ast.Name | ast.Attribute)
            for n in ast.walk(target):
                if isinstance(n, ast.Name | ast.Attribute) and dotted(n):
                    pairs.append((str(dotted(n)), stmt.value if whole else None))
        return pairs
    if isinstance(stmt, ast.AnnAssign | ast.AugAssign) and dotted(stmt.target):
        return [(str(dotted(stmt.target)), stmt.value)]
    return []


@rule(
    "LK020",
    theme="parallel",
    flags="`torch.compile(model)` of a model already wrapped in DDP or FSDP2 (`fully_shard`)",
    why="compiling around the wrapper breaks the forward into several graphs at the "
    "wrapper's hooks (3 graph breaks for DDP measured); compiled first, then wrapped, it has "
    "none",
    fix="model = loopkit.distributed.wrap(model, compile=True)  # DDP(torch.compile(model))",
)
def compile_around_wrapper(script: Script) -> Iterator[Hit]:
    scopes: list[ast.AST] = [script.tree]
    scopes += [n for n in script.nodes
               if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]  # fmt: skip
    for scope in scopes:
        flow = _Flow(script)
        flow.block(getattr(scope, "body", []), set())
        for call in flow.hits:
            yield call, "`torch.compile` of a DDP/FSDP-wrapped model"
