"""One parsed file and the questions answered from its own text: where a node runs (its loops,
branches and grad-off regions), which calls step an optimizer, what the file names.

What depends on the other files of the program (calls followed, per-step reach, whether the
file runs on a device) is the program's (``_program``); the rules ask both through ``Script``.
"""

from __future__ import annotations

import ast
from functools import cached_property

from ._names import FileNames
from ._syntax import (
    FUNCS,
    LOOP_OR_SCOPE,
    SCOPES,
    callee,
    dotted,
    is_detached,
    mentions_grad_off,
    method,
    receiver,
    walk_scope,
    walk_stmts,
)

Loop = ast.For | ast.AsyncFor | ast.While
_ACCELERATORS = ("cuda", "mps", "xpu", "npu")


class SourceFile(FileNames):
    """One parsed file; what its own text says about where each node runs."""

    def __init__(self, tree: ast.Module, path: str = "<string>") -> None:
        super().__init__(tree, path)
        self.calls = [n for n in self.nodes if isinstance(n, ast.Call)]

    # ---- calls -----------------------------------------------------------------------

    def calls_to(self, name: str) -> list[ast.Call]:
        """Calls whose callee's last name is ``name``: ``torch.utils.data.DataLoader(...)``."""
        return [c for c in self.calls if callee(c) == name]

    def method_calls(self, name: str) -> list[ast.Call]:
        """Calls ``x.name(...)``."""
        return [c for c in self.calls if method(c) == name]

    # ---- where a node runs -------------------------------------------------------------

    def loops_of(self, node: ast.AST) -> list[Loop]:
        """The loops that repeat ``node``, innermost first, inside its own function."""
        loops: list[Loop] = []
        child, parent = node, self.parents.get(node)
        while parent is not None and not isinstance(parent, SCOPES):
            if isinstance(parent, ast.For | ast.AsyncFor):
                if any(s is child for s in parent.body):
                    loops.append(parent)
            elif isinstance(parent, ast.While) and (
                child is parent.test or any(s is child for s in parent.body)
            ):
                loops.append(parent)
            child, parent = parent, self.parents.get(parent)
        return loops

    def loop_body(self, loop: ast.AST) -> list[ast.AST]:
        """The nodes of ``loop`` that run once per its iteration (not in an inner loop)."""
        return [n for n in walk_scope(loop) if self.loops_of(n)[:1] == [loop]]

    def in_try(self, node: ast.AST) -> bool:
        """True when ``node`` runs in a ``try`` block or one of its handlers (in its function)."""
        parent = self.parents.get(node)
        while parent is not None and not isinstance(parent, SCOPES):
            if isinstance(parent, ast.Try):
                return True
            parent = self.parents.get(parent)
        return False

    def evaluates(self, loop: ast.AST) -> bool:
        """Whether ``loop`` is an evaluation loop: no backward in it, and autograd off around
        it or in its body, or it is in a function named for evaluation (evaluate,
        estimate_loss, validate, test_step), or ``model.eval()`` runs before it on its path."""
        if any(isinstance(n, ast.Call) and method(n) == "backward" for n in ast.walk(loop)):
            return False
        if self.grad_off(loop):
            return True
        # for batch in eval_loader: with torch.no_grad(): out = model(batch) ...
        if any(
            isinstance(n, ast.With | ast.AsyncWith)
            and any(mentions_grad_off(i.context_expr) for i in n.items)
            for n in walk_stmts(getattr(loop, "body", []))
        ):
            return True
        scope = self.scope_of(loop)
        name = scope.name.lower() if isinstance(scope, FUNCS) else ""
        if any(word in name for word in ("eval", "estimate", "valid", "test")):
            return True
        # def metrics(model, loader): model.eval(); for x, y in loader: ... (whatever its name)
        return any(
            isinstance(n, ast.Call) and method(n) == "eval" and not n.args
            for statement in self.preceding(loop)
            for n in ast.walk(statement)
        )

    def grad_off(self, node: ast.AST) -> bool:
        """True when ``node`` runs under ``with torch.no_grad()`` or a no-grad decorator."""
        parent = self.parents.get(node)
        while parent is not None:
            if isinstance(parent, ast.With | ast.AsyncWith) and any(
                mentions_grad_off(item.context_expr) for item in parent.items
            ):
                return True
            if isinstance(parent, FUNCS) and any(
                mentions_grad_off(d) for d in parent.decorator_list
            ):
                return True
            parent = self.parents.get(parent)
        return False

    def preceding(self, node: ast.AST) -> list[ast.stmt]:
        """Statements that run before ``node`` on its path, in its function (same branch)."""
        before: list[ast.stmt] = []
        while True:
            parent = self.parents.get(node)
            if parent is None or isinstance(node, SCOPES):
                return before
            for _, value in ast.iter_fields(parent):
                if isinstance(value, list) and any(v is node for v in value):
                    index = next(i for i, v in enumerate(value) if v is node)
                    before.extend(v for v in value[:index] if isinstance(v, ast.stmt))
            node = parent

    def following(self, stmt: ast.stmt) -> list[ast.stmt]:
        """Statements that run after ``stmt`` before its enclosing loop repeats or returns."""
        after: list[ast.stmt] = []
        node: ast.AST = stmt
        while True:
            parent = self.parents.get(node)
            if parent is None:
                return after
            for _, value in ast.iter_fields(parent):
                if isinstance(value, list) and any(v is node for v in value):
                    index = next(i for i, v in enumerate(value) if v is node)
                    after.extend(v for v in value[index + 1 :] if isinstance(v, ast.stmt))
            if isinstance(parent, LOOP_OR_SCOPE):
                return after
            node = parent

    # ---- what trains -------------------------------------------------------------------

    @cached_property
    def optimizer_steps(self) -> frozenset[ast.Call]:
        """``optimizer.step()``/``scaler.step(opt)`` calls; schedulers and loopkit.step not."""
        steps: set[ast.Call] = set()
        for call in self.method_calls("step"):
            name = dotted(receiver(call)) or ""
            if "sched" not in name.lower() and name != "loopkit":
                steps.add(call)
        return frozenset(steps)

    # ---- the script's context ----------------------------------------------------------

    @cached_property
    def mentions_accelerator(self) -> bool:
        """Whether this file's own text can run on an accelerator: it names cuda/mps/xpu/npu
        or an accelerator, or moves tensors to a device or rank (the program decides the rest:
        ``Program.on_device``)."""
        for node in self.nodes:
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                if any(d in node.value for d in _ACCELERATORS):
                    return True
            elif isinstance(node, ast.Call) and method(node) == "to" and node.args:
                moved_to = dotted(node.args[0]) or ""
                if "dev" in moved_to.lower() or "rank" in moved_to.lower():
                    return True  # x.to(device), x.to(local_rank)
            elif isinstance(node, ast.Attribute | ast.Name):
                name = (node.attr if isinstance(node, ast.Attribute) else node.id).lower()
                if name in {*_ACCELERATORS, "accelerator", "device_type"} or any(
                    word in name for word in ("local_rank", "gpu")
                ):
                    return True
        return False

    @cached_property
    def uses_rpc(self) -> bool:
        """Whether the script uses torch.distributed.rpc (tensors travel through the host;
        dist_autograd keeps gradients per context, so nothing needs zeroing)."""
        for node in self.nodes:
            if isinstance(node, ast.Import | ast.ImportFrom):
                names = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
                names += [a.name for a in node.names]
                if any("rpc" in n.split(".") or ("autograd" in n and "dist" in n) for n in names):
                    return True
        return False

    @cached_property
    def sums_grads_by_hand(self) -> bool:
        """Whether the script adds into ``.grad`` itself (``p.grad += g``): it needs the
        gradients zeroed in place, not set to None."""
        for node in self.nodes:
            if isinstance(node, ast.AugAssign):
                target: ast.expr = node.target
                while isinstance(target, ast.Subscript):
                    target = target.value
                if isinstance(target, ast.Attribute) and target.attr == "grad":
                    return True
            elif isinstance(node, ast.Call) and method(node) in {"add_", "copy_", "div_"}:
                grad = receiver(node)
                if isinstance(grad, ast.Attribute) and grad.attr == "grad":
                    return True
        return False

    # ---- what holds a graph ------------------------------------------------------------

    @cached_property
    def float_funcs(self) -> frozenset[str]:
        """Functions of this file whose every return value holds no graph (loss.item(), ...)."""
        names: set[str] = set()
        for func in self.nodes:
            if isinstance(func, FUNCS):
                returns = [n for n in walk_scope(func) if isinstance(n, ast.Return)]
                if returns and all(is_detached(r.value) for r in returns):
                    names.add(func.name)
        return frozenset(names)

    def holds_no_graph(self, value: ast.AST | None) -> bool:
        """True for ``loss.item()``, ``loss.detach()``, ``float(x)``, or a local float helper."""
        if isinstance(value, ast.Call) and callee(value) in self.float_funcs:
            return True
        return is_detached(value)
