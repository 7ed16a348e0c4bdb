"""A static checker for PyTorch training scripts: find what slows the loop, line by line.

``python -m loopkit.lint PATH...`` reads each script with :mod:`ast` (it never imports or
runs it) and reports the anti-patterns the PyTorch performance guides warn about: a host
sync every step, a loss kept in a list, tensors built on the CPU and copied every step,
``nn.DataParallel``, a DataLoader that loads in the main process, evaluation that records a
graph, a ragged accumulation window that is never stepped, and more. Each finding names
why it costs and the loopkit line that fixes it.

The heuristics prefer silence to noise: a rule fires only on a pattern it can see whole in
one file. ``# loopkit: ignore`` (or ``# loopkit: ignore[LK002,LK007]``) on a line silences
it.
"""

from __future__ import annotations

import argparse
import ast
import io
import itertools
import json
import re
import sys
import tokenize
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

__all__ = ["RULES", "Finding", "check_paths", "check_source", "iter_python_files", "main"]

# code -> (why it costs, the loopkit one-liner that fixes it)
RULES: dict[str, tuple[str, str]] = {
    "LK001": (
        "a loss tensor kept in a list keeps its whole autograd graph and activations alive, "
        "so memory grows with every step",
        "log = loopkit.detach_logging(every=N); log(loss=loss)",
    ),
    "LK002": (
        "each one is a host-device sync that stalls the host until the GPU has caught up, "
        "every step",
        "log = loopkit.detach_logging(every=N); log(loss=loss)  # one sync per N steps",
    ),
    "LK003": (
        "it synchronizes the device and hands back cached blocks that the allocator must "
        "then get again with slow cudaMalloc calls",
        "remove it: the caching allocator reuses its blocks",
    ),
    "LK004": (
        "the tensor is built in host memory and copied to the device on every step",
        "create it on the device: torch.zeros(..., device=device), or register a buffer",
    ),
    "LK005": (
        "moving a tensor to the host and back costs two copies and a sync for nothing",
        "keep it on one device: batch = loopkit.to_device(batch, device) once per step",
    ),
    "LK006": (
        "nn.DataParallel is one process that replicates the model on every step and whose "
        "threads contend for the GIL",
        "model = loopkit.distributed.wrap(model)  # DDP, under torchrun",
    ),
    "LK007": (
        "the main process loads every batch while the device waits, and copies it from "
        "pageable memory",
        "loader = loopkit.distributed.loader(dataset, batch_size=...)",
    ),
    "LK008": (
        "autograd records a graph for a forward pass that never calls backward",
        "with torch.inference_mode():",
    ),
    "LK009": (
        "the ragged last window (len(loader) % N micro-batches) is never stepped: it leaks "
        "into the next epoch's gradients, divided by N instead of its own size",
        "acc = loopkit.accumulate(model, optimizer, every=N); for batch in acc.iterate(loader):",
    ),
    "LK010": (
        "gradients must be reset every update: set_to_none=False writes zeros into every "
        "gradient each step, and no zero_grad at all lets them pile up",
        "optimizer.zero_grad(set_to_none=True)  # loopkit.accumulate does it for you",
    ),
    "LK011": (
        "the workers' seeds and the shuffle order are drawn from the global torch RNG that "
        "training also consumes, so the data stream cannot be reproduced or resumed",
        "loader = loopkit.distributed.loader(dataset, batch_size=..., seed=0)",
    ),
}


@dataclass(frozen=True)
class Finding:
    """One problem: where it is, which rule, what was seen and why it costs, and the fix."""

    path: str
    line: int
    col: int  # 1-based, like the line
    code: str
    message: str
    fix: str

    def format(self) -> str:
        """The text-output line: ``path:line:col: CODE message Fix: fix``."""
        return f"{self.path}:{self.line}:{self.col}: {self.code} {self.message} Fix: {self.fix}"


_LOOPS = (ast.For, ast.AsyncFor, ast.While)
_FUNCS = (ast.FunctionDef, ast.AsyncFunctionDef)
# Bodies that do not run where they are written: a loop around a def does not loop its body.
_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef, ast.Module)
_LOOP_OR_SCOPE = (*_LOOPS, *_SCOPES)
_SYNCS = frozenset({"item", "cpu", "numpy", "tolist"})
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
_GRAD_OFF = frozenset({"no_grad", "inference_mode", "set_grad_enabled"})
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
# DataLoader's positional parameters, for calls that pass them without keywords.
_LOADER_POS = {"num_workers": 5, "pin_memory": 7, "worker_init_fn": 10, "generator": 12}
_IGNORE = re.compile(r"#\s*loopkit:\s*ignore(?:\[(?P<codes>[^\]]*)\])?")


def _dotted(node: ast.AST) -> str | None:
    """``a.b.c`` for a chain of names and attributes, else None."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return None if base is None else f"{base}.{node.attr}"
    return None


def _method(node: ast.AST) -> str | None:
    """The method name of a call ``x.name(...)``, else None."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        return node.func.attr
    return None


def _callee(node: ast.Call) -> str:
    """The last name of what a call calls: ``DataLoader`` for ``torch.utils.data.DataLoader``."""
    if isinstance(node.func, ast.Name):
        return node.func.id
    if isinstance(node.func, ast.Attribute):
        return node.func.attr
    return ""


def _receiver(call: ast.Call) -> ast.expr | None:
    """``x`` in ``x.method(...)``."""
    return call.func.value if isinstance(call.func, ast.Attribute) else None


def _chain(node: ast.AST) -> list[ast.Call]:
    """The method calls of ``a.f().g().h()``, outermost first."""
    calls: list[ast.Call] = []
    while isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        calls.append(node)
        node = node.func.value
    return calls


def _root_name(node: ast.AST) -> str | None:
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


def _keyword(call: ast.Call, name: str) -> ast.keyword | None:
    return next((k for k in call.keywords if k.arg == name), None)


def _is_const(node: ast.AST | None, value: object) -> bool:
    return (
        isinstance(node, ast.Constant) and type(node.value) is type(value) and node.value == value
    )


def _has_mod(test: ast.AST) -> bool:
    return any(isinstance(n, ast.BinOp) and isinstance(n.op, ast.Mod) for n in ast.walk(test))


def _mentions_grad_off(node: ast.AST) -> bool:
    """True when an expression names no_grad, inference_mode or set_grad_enabled."""
    for n in ast.walk(node):
        name = n.attr if isinstance(n, ast.Attribute) else n.id if isinstance(n, ast.Name) else ""
        if name in _GRAD_OFF:
            return True
    return False


def _walk_scope(root: ast.AST) -> Iterator[ast.AST]:
    """Every node under ``root`` that runs with it: nested defs, classes, lambdas skipped."""
    stack = list(ast.iter_child_nodes(root))
    while stack:
        node = stack.pop()
        if isinstance(node, _SCOPES):
            continue
        yield node
        stack.extend(ast.iter_child_nodes(node))


def _walk_stmts(stmts: Iterable[ast.stmt]) -> Iterator[ast.AST]:
    for stmt in stmts:
        if isinstance(stmt, _SCOPES):
            continue
        yield stmt
        yield from _walk_scope(stmt)


def _assigned_names(node: ast.AST) -> Iterator[tuple[str, ast.expr | None]]:
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


def _is_detached(value: ast.AST | None) -> bool:
    """True for a value that holds no autograd graph: ``.item()``, ``.detach()``, float(...)."""
    if isinstance(value, ast.Constant):
        return True
    if not isinstance(value, ast.Call):
        return False
    if isinstance(value.func, ast.Name) and value.func.id in {"float", "int", "round", "bool"}:
        return True
    return any(
        c.func.attr in _DETACHING for c in _chain(value) if isinstance(c.func, ast.Attribute)
    )


def _device_move(call: ast.Call) -> str | None:
    """'cpu' or 'device' when the call moves a tensor (``.cpu()``, ``.cuda()``, ``.to(dev)``)."""
    name = _method(call)
    if name == "cpu":
        return "cpu"
    if name == "cuda":
        return "device"
    if name != "to" or any(k.arg is None for k in call.keywords):
        return None
    device = _keyword(call, "device")
    target = device.value if device is not None else call.args[0] if call.args else None
    if target is None:
        return None  # .to(dtype=...) only: a conversion, not a move
    if _is_const(target, "cpu"):
        return "cpu"
    dotted = _dotted(target)
    if device is None and dotted is not None and dotted.rsplit(".", 1)[-1] in _DTYPES:
        return None  # .to(torch.float16)
    return "device"


def _moves(node: ast.AST) -> list[str]:
    """The device moves along one expression, outermost first."""
    moves: list[str] = []
    while isinstance(node, ast.Call):
        if _callee(node) in {"from_numpy", "as_tensor", "tensor"} and node.args:
            node = node.args[0]  # torch.from_numpy(x.cpu().numpy()): the copy goes on
        elif isinstance(node.func, ast.Attribute):
            move = _device_move(node)
            if move is not None:
                moves.append(move)
            node = node.func.value
        else:
            break
    return moves


def _backwarded(call: ast.Call) -> set[str]:
    """Names in a backward call: ``loss`` in ``scaler.scale(loss).backward()``."""
    return {n.id for n in ast.walk(call) if isinstance(n, ast.Name)}


def _loader_arg(call: ast.Call, name: str) -> ast.expr | None:
    """A DataLoader argument given by keyword or by position; None if absent or None."""
    kw = _keyword(call, name)
    pos = _LOADER_POS[name]
    value = kw.value if kw is not None else call.args[pos] if len(call.args) > pos else None
    return None if _is_const(value, None) else value


def _ignored_codes(source: str) -> dict[int, frozenset[str] | None]:
    """Line -> codes silenced there by a ``# loopkit: ignore`` comment (None: every code)."""
    if "loopkit:" not in source:
        return {}  # most files have none; tokenizing costs as much as all the rules
    comments: list[tuple[int, str]] = []
    try:
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.type == tokenize.COMMENT:
                comments.append((tok.start[0], tok.string))
    except (tokenize.TokenError, SyntaxError):
        # The parse succeeded, so this is a tokenizer corner case: fall back to a line scan.
        comments = [(i, line) for i, line in enumerate(source.splitlines(), 1) if "#" in line]
    ignored: dict[int, frozenset[str] | None] = {}
    for line, text in comments:
        match = _IGNORE.search(text)
        if match is None:
            continue
        codes = match.group("codes")
        if codes is None:
            ignored[line] = None
        else:
            ignored[line] = frozenset(c.strip().upper() for c in codes.split(",") if c.strip())
    return ignored


class _Checker:
    """All rules over one parsed module; ``run`` returns the findings, unsilenced."""

    def __init__(self, tree: ast.Module, path: str) -> None:
        self.tree = tree
        self.path = path
        self.parents: dict[ast.AST, ast.AST] = {}
        for node in ast.walk(tree):
            for child in ast.iter_child_nodes(node):
                self.parents[child] = node
        self.calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)]
        self.findings: list[Finding] = []
        self.steps = set(self._optimizer_steps())
        self.training: set[ast.AST] = set()  # loops with a backward call in them
        self.step_loops: set[ast.AST] = set()  # loops whose every iteration is a step
        self.step_funcs: dict[str, ast.FunctionDef | ast.AsyncFunctionDef] = {}
        self.called_step_funcs: set[ast.AST] = set()
        self._classify_loops()
        # Functions of this file whose every return value holds no graph (loss.item(), ...).
        self.float_funcs: set[str] = set()
        for func in ast.walk(tree):
            if isinstance(func, _FUNCS):
                returns = [n for n in _walk_scope(func) if isinstance(n, ast.Return)]
                if returns and all(_is_detached(r.value) for r in returns):
                    self.float_funcs.add(func.name)

    # ---- structure -------------------------------------------------------------------

    def loops_of(self, node: ast.AST) -> list[ast.For | ast.AsyncFor | ast.While]:
        """The loops that repeat ``node``, innermost first, inside its own function."""
        loops: list[ast.For | ast.AsyncFor | ast.While] = []
        child, parent = node, self.parents.get(node)
        while parent is not None and not isinstance(parent, _SCOPES):
            if isinstance(parent, ast.For | ast.AsyncFor):
                if any(s is child for s in parent.body):
                    loops.append(parent)
            elif isinstance(parent, ast.While) and (
                child is parent.test or any(s is child for s in parent.body)
            ):
                loops.append(parent)
            child, parent = parent, self.parents.get(parent)
        return loops

    def scope_of(self, node: ast.AST) -> ast.AST:
        parent = self.parents.get(node)
        while parent is not None and not isinstance(parent, _SCOPES):
            parent = self.parents.get(parent)
        return parent if parent is not None else self.tree

    def guarded_by_mod(self, node: ast.AST, stop: ast.AST) -> bool:
        """True when ``node`` runs only under an ``if`` whose test has ``%`` (below ``stop``)."""
        child, parent = node, self.parents.get(node)
        while parent is not None and parent is not stop:
            if isinstance(parent, ast.If) and any(s is child for s in parent.body):
                if _has_mod(parent.test):
                    return True
            elif isinstance(parent, ast.IfExp) and child is parent.body and _has_mod(parent.test):
                return True
            child, parent = parent, self.parents.get(parent)
        return False

    def grad_off(self, node: ast.AST) -> bool:
        """True when ``node`` runs under ``with torch.no_grad()`` or a no-grad decorator."""
        parent = self.parents.get(node)
        while parent is not None:
            if isinstance(parent, ast.With | ast.AsyncWith) and any(
                _mentions_grad_off(item.context_expr) for item in parent.items
            ):
                return True
            if isinstance(parent, _FUNCS) and any(
                _mentions_grad_off(d) for d in parent.decorator_list
            ):
                return True
            parent = self.parents.get(parent)
        return False

    def _classify_loops(self) -> None:
        """Find the training loops (they contain backward) and the per-step ones among them."""
        backward = [c for c in self.calls if _method(c) == "backward"]
        for call in backward:
            loops = self.loops_of(call)
            self.training.update(loops)
            if loops:
                self.step_loops.add(loops[0])
        # nanoGPT's shape: backward in an inner micro-batch loop, the update in the outer one.
        for call in self.steps:
            loops = self.loops_of(call)
            if loops and loops[0] in self.training:
                self.step_loops.add(loops[0])
        # A function that back-propagates outside any loop of its own is one training step.
        for call in backward:
            scope = self.scope_of(call)
            if isinstance(scope, _FUNCS) and not self.loops_of(call):
                self.step_funcs[scope.name] = scope
        for call in self.calls:
            func = self.step_funcs.get(_callee(call))
            loops = self.loops_of(call)
            if func is not None and loops:
                self.called_step_funcs.add(func)
                self.step_loops.add(loops[0])

    def _optimizer_steps(self) -> Iterator[ast.Call]:
        """``optimizer.step()``/``scaler.step(opt)`` calls; schedulers and loopkit.step not."""
        for call in self.calls:
            if _method(call) != "step":
                continue
            receiver = _dotted(_receiver(call) or ast.Constant(None)) or ""
            if "sched" in receiver.lower() or receiver == "loopkit":
                continue
            yield call

    def holds_no_graph(self, value: ast.AST | None) -> bool:
        """True for ``loss.item()``, ``loss.detach()``, ``float(x)``, or a local float helper."""
        if isinstance(value, ast.Call) and _callee(value) in self.float_funcs:
            return True
        return _is_detached(value)

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
            if isinstance(parent, _LOOP_OR_SCOPE):
                return after
            node = parent

    def add(self, node: ast.AST, code: str, what: str) -> None:
        why, fix = RULES[code]
        self.findings.append(
            Finding(
                path=self.path,
                line=getattr(node, "lineno", 1),
                col=getattr(node, "col_offset", 0) + 1,
                code=code,
                message=f"{what}: {why}.",
                fix=fix,
            )
        )

    # ---- rules -----------------------------------------------------------------------

    def run(self) -> list[Finding]:
        for rule in (
            self.lk001_loss_in_list,
            self.lk002_sync_every_step,
            self.lk003_empty_cache,
            self.lk004_cpu_factory_moved,
            self.lk005_ping_pong,
            self.lk006_data_parallel,
            self.lk007_lk011_loader,
            self.lk008_eval_with_grad,
            self.lk009_ragged_window,
            self.lk010_zero_grad,
        ):
            rule()
        seen: set[tuple[int, str]] = set()
        unique: list[Finding] = []
        # One finding per code and line: a chain such as x.cpu().numpy() is one habit.
        for f in sorted(self.findings, key=lambda f: (f.line, f.col, f.code)):
            if (f.line, f.code) not in seen:
                seen.add((f.line, f.code))
                unique.append(f)
        return unique

    def lk001_loss_in_list(self) -> None:
        for call in self.calls:
            if _method(call) != "append" or len(call.args) != 1 or call.keywords:
                continue
            arg = call.args[0]
            loops = self.loops_of(call)
            if not isinstance(arg, ast.Name) or not loops or self.grad_off(call):
                continue
            outer = loops[-1]
            backwarded: set[str] = set()
            for c in _walk_scope(outer):
                if isinstance(c, ast.Call) and _method(c) == "backward":
                    backwarded |= _backwarded(c)
            lower = arg.id.lower()
            lossy = "loss" in lower and not lower.endswith(("fn", "func", "function", "fns"))
            if arg.id not in backwarded and not lossy:
                continue
            # loss = loss.item() (or .detach(), or a local helper that returns a float) in the
            # loop: the list holds no graph.
            if any(
                name == arg.id and self.holds_no_graph(value)
                for node in _walk_scope(outer)
                for name, value in _assigned_names(node)
            ):
                continue
            self.add(call, "LK001", f"`{arg.id}` appended to a list inside a loop")

    def lk002_sync_every_step(self) -> None:
        for call in self.calls:
            name = _method(call)
            if name not in _SYNCS or call.args:
                continue  # numpy's arr.item(0) and friends take arguments; torch's do not
            loops = self.loops_of(call)
            step_loop = next((loop for loop in loops if loop in self.step_loops), None)
            if step_loop is not None:
                stop: ast.AST = step_loop
            else:
                scope = self.scope_of(call)
                if scope not in self.called_step_funcs:
                    continue
                stop = scope
            if self.guarded_by_mod(call, stop):
                continue
            if isinstance(step_loop, ast.For | ast.AsyncFor) and self._straight_from_loader(
                call, step_loop
            ):
                continue
            where = "a training loop" if step_loop is not None else "a per-step training function"
            self.add(call, "LK002", f"`.{name}()` every step in {where}")

    def _straight_from_loader(self, call: ast.Call, loop: ast.For | ast.AsyncFor) -> bool:
        """True for ``y.numpy()`` on a batch the loop gets from the loader (host memory)."""
        root = _root_name(_receiver(call) or ast.Constant(None))
        targets = {n.id for n in ast.walk(loop.target) if isinstance(n, ast.Name)}
        if root is None or root not in targets:
            return False
        return not any(
            name == root for node in _walk_stmts(loop.body) for name, _ in _assigned_names(node)
        )

    def lk003_empty_cache(self) -> None:
        for call in self.calls:
            if _callee(call) == "empty_cache" and self.loops_of(call):
                name = _dotted(call.func) or "empty_cache"
                self.add(call, "LK003", f"`{name}()` inside a loop")

    def lk004_cpu_factory_moved(self) -> None:
        for call in self.calls:
            if _device_move(call) != "device":
                continue
            inner = _receiver(call)
            if not isinstance(inner, ast.Call) or not isinstance(inner.func, ast.Attribute):
                continue
            if _dotted(inner.func.value) != "torch" or inner.func.attr not in _FACTORIES:
                continue
            if any(k.arg in {"device", None} for k in inner.keywords):
                continue
            scope = self.scope_of(call)
            in_forward = isinstance(scope, _FUNCS) and scope.name == "forward"
            if self.loops_of(call) or in_forward:
                where = "in forward()" if in_forward and not self.loops_of(call) else "in a loop"
                self.add(
                    call,
                    "LK004",
                    f"`torch.{inner.func.attr}(...)` built on the CPU, then moved, {where}",
                )

    def lk005_ping_pong(self) -> None:
        # An expression that goes to the host and back: x.cpu().cuda(), from_numpy(..).cuda().
        for call in self.calls:
            parent = self.parents.get(call)
            if isinstance(parent, ast.Attribute) and isinstance(self.parents.get(parent), ast.Call):
                continue  # not the outermost call of its chain
            moves = _moves(call)
            if any(a != b for a, b in itertools.pairwise(moves)):
                self.add(call, "LK005", "a tensor moved between the host and the device and back")
        # In one loop body the same tensor goes x.cpu() ... x.cuda() (or the other way).
        per_loop: dict[tuple[ast.AST, str], list[tuple[int, int, str, ast.Call]]] = {}
        for call in self.calls:
            move = _method(call)
            receiver = _dotted(_receiver(call) or ast.Constant(None))
            loops = self.loops_of(call)
            # A move under `if step % N == 0:` (a periodic snapshot) is rare enough to be fine.
            if move in {"cpu", "cuda"} and receiver and loops:
                if self.guarded_by_mod(call, loops[0]):
                    continue
                key = (loops[0], receiver)
                per_loop.setdefault(key, []).append(
                    (call.lineno, call.col_offset, move or "", call)
                )
        for (_, receiver), moves_seen in per_loop.items():
            moves_seen.sort(key=lambda m: (m[0], m[1]))
            for (_, _, before, _), (_, _, now, call) in itertools.pairwise(moves_seen):
                if before != now:
                    self.add(call, "LK005", f"`{receiver}` moved with both .cpu() and .cuda()")

    def lk006_data_parallel(self) -> None:
        for call in self.calls:
            if _callee(call) == "DataParallel":
                self.add(call, "LK006", "`nn.DataParallel` wraps the model")

    def _targets_cuda(self) -> bool:
        """True when the script mentions CUDA anywhere (only then does pinning pay off)."""
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                if "cuda" in node.value:
                    return True
            elif (isinstance(node, ast.Attribute) and node.attr in {"cuda", "accelerator"}) or (
                isinstance(node, ast.Name) and node.id == "cuda"
            ):
                return True
        return False

    def lk007_lk011_loader(self) -> None:
        loaders = [c for c in self.calls if _callee(c) == "DataLoader"]
        if not loaders:
            return
        cuda = self._targets_cuda()
        in_memory = {
            name
            for n in ast.walk(self.tree)
            for name, value in _assigned_names(n)
            if isinstance(value, ast.Call) and _callee(value) == "TensorDataset"
        }
        for call in loaders:
            if any(k.arg is None for k in call.keywords):
                continue  # **kwargs: the settings are not visible here
            workers = _loader_arg(call, "num_workers")
            dataset_kw = _keyword(call, "dataset")
            dataset = call.args[0] if call.args else dataset_kw.value if dataset_kw else None
            problems: list[str] = []
            # Indexing in-memory tensors costs less than shipping batches back from workers.
            tensors = (isinstance(dataset, ast.Call) and _callee(dataset) == "TensorDataset") or (
                isinstance(dataset, ast.Name) and dataset.id in in_memory
            )
            if (workers is None or _is_const(workers, 0)) and not tensors:
                problems.append(
                    "with num_workers=0" if workers is not None else "without num_workers"
                )
            if _loader_arg(call, "pin_memory") is None and cuda:
                problems.append("without pin_memory")
            if problems:
                self.add(call, "LK007", "DataLoader " + " and ".join(problems))
            if (
                workers is not None
                and not _is_const(workers, 0)
                and _loader_arg(call, "worker_init_fn") is None
                and _loader_arg(call, "generator") is None
            ):
                self.add(call, "LK011", "DataLoader with workers but no worker_init_fn/generator")

    def lk008_eval_with_grad(self) -> None:
        evals: dict[ast.AST, list[ast.Call]] = {}
        for call in self.calls:
            if _method(call) == "eval" and not call.args and not call.keywords:
                scope = self.scope_of(call)
                if isinstance(scope, ast.Module | ast.FunctionDef | ast.AsyncFunctionDef):
                    evals.setdefault(scope, []).append(call)
        if not evals:
            return
        # Functions called under no_grad somewhere in the file are already covered there.
        covered: set[str] = set()
        for node in ast.walk(self.tree):
            if isinstance(node, ast.With | ast.AsyncWith) and any(
                _mentions_grad_off(i.context_expr) for i in node.items
            ):
                covered.update(
                    _callee(c) for c in _walk_stmts(node.body) if isinstance(c, ast.Call)
                )
        for scope, eval_calls in evals.items():
            if isinstance(scope, _FUNCS) and (
                scope.name in covered or any(_mentions_grad_off(d) for d in scope.decorator_list)
            ):
                continue
            nodes = list(_walk_scope(scope))
            if any(
                (isinstance(n, ast.Attribute) and n.attr in _GRAD_OFF)
                or (isinstance(n, ast.Name) and n.id in _GRAD_OFF)
                for n in nodes
            ):
                continue  # the scope turns autograd off somewhere: trust it
            calls = [n for n in nodes if isinstance(n, ast.Call)]
            for call in eval_calls:
                model = _dotted(_receiver(call) or ast.Constant(None))
                # The evaluation lasts until the same model goes back to .train().
                end = min(
                    (
                        c.lineno
                        for c in calls
                        if _method(c) == "train"
                        and c.lineno > call.lineno
                        and _dotted(_receiver(c) or ast.Constant(None)) == model
                    ),
                    default=sys.maxsize,
                )
                region = [n for n in nodes if call.lineno < getattr(n, "lineno", 0) < end]
                if any(_method(n) == "backward" for n in region):
                    continue  # training in eval mode (frozen batch norm): it needs the graph
                forward = model is not None and any(
                    isinstance(n, ast.Call)
                    and _dotted(n.func) in {model, f"{model}.forward", f"{model}.generate"}
                    for n in region
                )
                if forward:
                    what = f"`{model}.eval()` then a forward pass with autograd on"
                    self.add(call, "LK008", what)

    def lk009_ragged_window(self) -> None:
        for loop in self.step_loops:
            if not isinstance(loop, _LOOPS):
                continue
            body = list(_walk_stmts(loop.body))
            divisors: dict[str, ast.expr] = {}
            backwarded: set[str] = set()
            for node in body:
                if isinstance(node, ast.Call) and _method(node) == "backward":
                    backwarded |= _backwarded(node)
                    for part in ast.walk(node):
                        if isinstance(part, ast.BinOp) and isinstance(part.op, ast.Div):
                            divisors[ast.dump(part.right)] = part.right
            for node in body:
                target: ast.expr
                value: ast.expr
                if isinstance(node, ast.AugAssign) and isinstance(node.op, ast.Div):
                    target, value = node.target, node.value
                elif (
                    isinstance(node, ast.Assign)
                    and len(node.targets) == 1
                    and isinstance(node.value, ast.BinOp)
                    and isinstance(node.value.op, ast.Div)
                ):
                    target, value = node.targets[0], node.value.right
                else:
                    continue
                if isinstance(target, ast.Name) and (
                    "loss" in target.id.lower() or target.id in backwarded
                ):
                    divisors[ast.dump(value)] = value
            divisors = {
                k: v
                for k, v in divisors.items()
                if isinstance(v, ast.Name | ast.Attribute)
                or (isinstance(v, ast.Constant) and isinstance(v.value, int))
            }
            if not divisors:
                continue
            definitions = {
                name: value
                for node in body
                for name, value in _assigned_names(node)
                if value is not None
            }
            after = self.following(loop) + list(loop.orelse)
            if any(n in self.steps for n in _walk_stmts(after)):
                continue  # the tail window is flushed after the loop
            for node in body:
                if not isinstance(node, ast.If) or not any(
                    n in self.steps for n in _walk_stmts(node.body)
                ):
                    continue
                k = self._steps_on_mod_only(node.test, divisors, definitions)
                if k is not None:
                    what = f"loss divided by {k} but the optimizer stepped on `% {k}` only"
                    self.add(node, "LK009", what)

    def _steps_on_mod_only(
        self, test: ast.expr, divisors: dict[str, ast.expr], definitions: dict[str, ast.expr]
    ) -> str | None:
        """K when ``test`` is ``i % K`` (maybe through a flag) with no last-batch clause."""

        def mod_k(expr: ast.AST) -> str | None:
            for n in ast.walk(expr):
                if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Mod):
                    divisor = divisors.get(ast.dump(n.right))
                    if divisor is not None:
                        return ast.unparse(divisor)
            return None

        parts: list[ast.AST] = [test]
        names: set[str] = set()
        found = mod_k(test)
        for n in ast.walk(test):
            if not isinstance(n, ast.Name):
                continue
            value = definitions.get(n.id)
            via_flag = mod_k(value) if value is not None else None
            if via_flag is not None:
                found = found or via_flag  # last = (i + 1) % N == 0; if last: ...
            else:
                names.add(n.id)  # its own name may say "last": is_last_batch
            if value is not None:
                parts.append(value)
        if found is None:
            return None
        # A clause for the final batch (len(loader), is_last, last_step) closes the tail.
        for part in parts:
            for n in ast.walk(part):
                if isinstance(n, ast.Call) and _callee(n) == "len":
                    return None
                if isinstance(n, ast.Attribute) and "last" in n.attr.lower():
                    return None
                if isinstance(n, ast.Name) and "last" in n.id.lower() and n.id in names:
                    return None
        return found

    def lk010_zero_grad(self) -> None:
        resets = False
        for call in self.calls:
            if _method(call) != "zero_grad":
                continue
            resets = True
            flag = _keyword(call, "set_to_none")
            value = flag.value if flag is not None else call.args[0] if call.args else None
            if _is_const(value, False):
                self.add(call, "LK010", "`zero_grad(set_to_none=False)`")
        if resets or self._resets_elsewhere():
            return
        for call in self.steps:
            loops = self.loops_of(call)
            if loops and loops[0] in self.training:
                self.add(call, "LK010", "an optimizer step with no zero_grad anywhere in the file")

    def _resets_elsewhere(self) -> bool:
        """True when gradients are reset without zero_grad: p.grad = None, loopkit's step."""
        loopkit_names = {"loopkit"}
        for node in ast.walk(self.tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("loopkit"):
                loopkit_names.update(
                    a.asname or a.name for a in node.names if a.name in {"accumulate", "step"}
                )
            elif (isinstance(node, ast.Attribute) and node.attr == "zero_grad") or (
                isinstance(node, ast.Assign)
                and any(isinstance(t, ast.Attribute) and t.attr == "grad" for t in node.targets)
            ):
                return True  # optimizer.zero_grad, or p.grad = None
            elif isinstance(node, ast.Call) and _method(node) == "zero_":
                receiver = _receiver(node)
                if isinstance(receiver, ast.Attribute) and receiver.attr == "grad":
                    return True  # p.grad.zero_()
        for call in self.calls:
            dotted = _dotted(call.func) or ""
            if dotted in {"loopkit.accumulate", "loopkit.step"} or (
                isinstance(call.func, ast.Name) and call.func.id in loopkit_names
            ):
                return True
        return False


def check_source(source: str, path: str = "<string>") -> list[Finding]:
    """Check one script's source; raises SyntaxError (or ValueError) if it does not parse."""
    with warnings.catch_warnings():
        # Invalid escape sequences and the like are the script's business, not a finding.
        warnings.simplefilter("ignore")
        tree = ast.parse(source, filename=path)
    findings = _Checker(tree, path).run()
    ignored = _ignored_codes(source)
    kept: list[Finding] = []
    for f in findings:
        codes = ignored.get(f.line, frozenset())
        if codes is None or f.code in codes:
            continue
        kept.append(f)
    return kept


def iter_python_files(paths: Iterable[str | Path]) -> Iterator[Path]:
    """The ``.py`` files named or found (recursively, hidden folders skipped) under ``paths``."""
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            for file in sorted(path.rglob("*.py")):
                parts = file.relative_to(path).parts
                if any(p.startswith(".") or p == "__pycache__" for p in parts[:-1]):
                    continue
                if file.is_file():
                    yield file
        else:
            yield path


def _report_skip(path: str, reason: str) -> None:
    print(f"{path}: skipped, {reason}", file=sys.stderr)


def check_paths(
    paths: Iterable[str | Path],
    *,
    select: Iterable[str] | None = None,
    on_skip: Callable[[str, str], None] = _report_skip,
) -> list[Finding]:
    """Check every Python file under ``paths``; files that do not parse go to ``on_skip``."""
    wanted = None if select is None else frozenset(select)
    findings: list[Finding] = []
    for file in iter_python_files(paths):
        name = str(file)
        try:
            with tokenize.open(file) as handle:  # honours a PEP 263 coding line
                source = handle.read()
        except (SyntaxError, UnicodeDecodeError) as exc:
            on_skip(name, f"cannot parse: {exc}")
            continue
        except OSError as exc:
            on_skip(name, f"cannot read: {exc}")
            continue
        try:
            found = check_source(source, name)
        except (SyntaxError, ValueError, RecursionError) as exc:
            on_skip(name, f"cannot parse: {exc}")
            continue
        findings.extend(f for f in found if wanted is None or f.code in wanted)
    return findings


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: print the findings; 1 if any, 0 if clean, 2 on a usage error."""
    parser = argparse.ArgumentParser(
        prog="python -m loopkit.lint",
        description="Find the training-loop habits that slow PyTorch down, without running them.",
    )
    parser.add_argument("paths", nargs="+", metavar="PATH", help="files or folders (*.py)")
    parser.add_argument("--format", choices=["text", "json"], default="text")
    parser.add_argument("--select", help="comma-separated codes to report, e.g. LK001,LK002")
    args = parser.parse_args(argv)

    select: list[str] | None = None
    if args.select is not None:
        select = [c.strip().upper() for c in args.select.split(",") if c.strip()]
        unknown = sorted(set(select) - set(RULES))
        if unknown or not select:
            parser.error(
                f"unknown code(s) in --select: {', '.join(unknown) or '(none given)'}; "
                f"known: {', '.join(RULES)}"
            )
    missing = [p for p in args.paths if not Path(p).exists()]
    if missing:
        parser.error(f"no such file or directory: {', '.join(missing)}")

    findings = check_paths(args.paths, select=select)
    if args.format == "json":
        print(json.dumps([asdict(f) for f in findings], indent=2))
    else:
        for f in findings:
            print(f.format())
        files = len({f.path for f in findings})
        if findings:
            print(f"Found {len(findings)} problem(s) in {files} file(s).")
        else:
            print("No problems found.")
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
