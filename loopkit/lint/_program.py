"""The whole program: the files checked together, the calls followed between them, which
functions and methods run every training step (and by which chain of calls), which run once
(after training, say) or per epoch, and which files run on an accelerator.

This is the layer that knows the program; the rules ask it through ``Script`` (``_script``),
and it asks each file only what its own text says (``_parsed``), so nothing below imports back.

A call is resolved only to a definition the linter can see: a function of the same file (a
module-level one, or one nested in an enclosing function), a method through ``self.m()``
(the class or a base class of the same file), a method of an object every binding of which
is ``Class(...)`` of a visible class (``meter = Meter(); meter.update(x)``; ``criterion(x)``
runs its ``forward``), or a function or class imported from another checked file
(``from .x import f``, ``from pkg.x import f``, ``import x``; ``x.f()``). Anything else (a
library call, a method of an object of unknown type) is not followed: silence, not a guess.
"""

from __future__ import annotations

import ast
import os
from dataclasses import dataclass
from functools import cached_property
from typing import Generic, TypeVar

from ._branches import guarded_by_mod
from ._imports import imported_modules
from ._parsed import SourceFile
from ._shape import TrainingShape, training_shape
from ._syntax import FUNCS, dotted, walk_scope, walk_stmts

Func = ast.FunctionDef | ast.AsyncFunctionDef
# The file type the program holds (the rules' Script): what it hands back is of that type.
F = TypeVar("F", bound=SourceFile)
# Deeper chains than this are rare and their findings hard to act on; the bound also keeps the
# search linear (each function is entered once, by its shortest chain).
MAX_DEPTH = 6


@dataclass(frozen=True)
class Reach:
    """How a function is reached every step: the loop's file, line and function, then callees."""

    root: SourceFile  # the file whose training loop starts the chain
    line: int  # the first call, in that loop (or per-step function)
    names: tuple[str, ...]  # the loop's function, then each function entered

    def describe(self) -> str:
        """``reached from train.py:120 train_one_epoch -> log_metrics``."""
        return f"reached from {self.root.path}:{self.line} {' -> '.join(self.names)}"


def qualname(script: SourceFile, func: ast.AST) -> str:
    """``f``, or ``Class.method`` for a method."""
    if not isinstance(func, FUNCS):
        return "<module>"
    owner = script.parents.get(func)
    return f"{owner.name}.{func.name}" if isinstance(owner, ast.ClassDef) else func.name


class Program(Generic[F]):
    """The files checked together: calls resolved across them, per-step reach computed once."""

    def __init__(self, scripts: list[F]) -> None:
        self.scripts = scripts
        self.by_file = {_norm(s.path): s for s in scripts}
        self._shapes: dict[int, TrainingShape] = {}

    def shape(self, script: SourceFile) -> TrainingShape:
        """The training loops of ``script`` and the per-step ones among them (see _shape)."""
        found = self._shapes.get(id(script))
        if found is None:
            found = self._shapes[id(script)] = training_shape(script)
        return found

    # ---- resolving one call ---------------------------------------------------------------

    def resolve(self, script: F, call: ast.Call) -> tuple[F, Func] | None:
        """The definition a call runs, where the linter can see it; else None."""
        func = call.func
        if isinstance(func, ast.Name):
            local = _enclosing_def(script, call, func.id)
            if local is not None:
                return script, local
            instance = self._instance_class(script, func)
            if instance is not None:  # criterion(out, y): the module's forward (or __call__)
                for name in ("forward", "__call__"):
                    found_method = _method(instance[0], instance[1], name, set())
                    if found_method is not None:
                        return instance[0], found_method
                return None
            imported = script.imported_names.get(func.id)
            if imported is not None:
                target = self._module(script, imported[0], imported[2])
                if target is not None:
                    found = target.defs.get(target.tree, {}).get(imported[1])
                    if found is not None:
                        return target, found
            return None
        if not isinstance(func, ast.Attribute):
            return None
        instance = self._instance_class(script, func.value)
        if instance is not None:  # obj.method() for obj = Class(...) of the checked files
            found_method = _method(instance[0], instance[1], func.attr, set())
            return (instance[0], found_method) if found_method is not None else None
        if not isinstance(func.value, ast.Name):
            return None
        owner = func.value.id
        if owner in {"self", "cls"}:
            cls = _enclosing_class(script, call)
            method = _method(script, cls, func.attr, set()) if cls is not None else None
            return (script, method) if method is not None else None
        module = script.imported_modules.get(owner)
        if module is not None:
            target = self._module(script, module[0], module[1])
            if target is not None:
                found = target.defs.get(target.tree, {}).get(func.attr)
                if found is not None:
                    return target, found
        return None

    def resolve_reference(self, script: F, ref: ast.Name | ast.Attribute) -> tuple[F, Func] | None:
        """The function a name refers to without calling it (``collate_fn=utils.collate``),
        resolved as a call of it would be (this file, or a file checked with it)."""
        probe = ast.Call(func=ref, args=[], keywords=[])
        script.parents[probe] = script.parents.get(ref, script.tree)
        try:
            return self.resolve(script, probe)
        finally:
            del script.parents[probe]

    def _class(self, script: F, value: ast.expr) -> tuple[F, ast.ClassDef] | None:
        """The class a constructor call names: ``Logger``, ``utils.MetricLogger``."""
        target: F | None = None
        name = ""
        if isinstance(value, ast.Name):
            local = script.classes.get(value.id)
            if local is not None and script.scope_of(local) is script.tree:
                return script, local
            imported = script.imported_names.get(value.id)
            if imported is not None:
                target, name = self._module(script, imported[0], imported[2]), imported[1]
        elif isinstance(value, ast.Attribute) and isinstance(value.value, ast.Name):
            module = script.imported_modules.get(value.value.id)
            if module is not None:
                target, name = self._module(script, module[0], module[1]), value.attr
        found = target.classes.get(name) if target is not None else None
        return (target, found) if target is not None and found is not None else None

    def _instance_class(self, script: F, node: ast.expr) -> tuple[F, ast.ClassDef] | None:
        """The class of ``obj`` (or ``self.obj``) when every binding of it in the file is
        ``Class(...)`` of a class the linter can see; else None (a type it cannot tell)."""
        name = dotted(node)
        if (
            name is None
            or name in {"self", "cls"}
            or ("." in name and not name.startswith("self."))
        ):
            return None
        values = script.bindings.get(name, [])
        if not values or not all(isinstance(v, ast.Call) for v in values):
            return None
        classes = {self._class(script, v.func) for v in values}  # type: ignore[union-attr]
        if len(classes) != 1:
            return None
        return classes.pop()

    def _module(self, script: F, module: str, level: int) -> F | None:
        """The checked file a module name points at, seen from ``script``'s folder."""
        if script.path.startswith("<") or not self.by_file:
            return None
        here = os.path.dirname(_norm(script.path))
        parts = module.split(".") if module else []
        if level:
            base = here
            for _ in range(level - 1):
                base = os.path.dirname(base)
            bases = [base]
        else:
            bases, base = [], here
            while True:  # absolute: from the file's folder up to the filesystem root
                bases.append(base)
                parent = os.path.dirname(base)
                if parent == base:
                    break
                base = parent
        for base in bases:
            stem = os.path.join(base, *parts) if parts else base
            for candidate in (stem + ".py", os.path.join(stem, "__init__.py")):
                found = self.by_file.get(candidate)
                if found is not None and found is not script:
                    return found
        return None

    def callers(self, script: F, func: Func) -> list[tuple[F, ast.Call]]:
        """Every call in the checked files that resolves to ``func``."""
        return self._callers.get(func, [])

    @cached_property
    def _callers(self) -> dict[ast.AST, list[tuple[F, ast.Call]]]:
        found: dict[ast.AST, list[tuple[F, ast.Call]]] = {}
        for script in self.scripts:
            for call in script.calls:
                target = self.resolve(script, call)
                if target is not None:
                    found.setdefault(target[1], []).append((script, call))
        return found

    # ---- what runs every step --------------------------------------------------------------

    @cached_property
    def per_step(self) -> dict[ast.AST, Reach]:
        """function -> how it is reached every training step (shortest chain, each once).

        Roots: the calls of each training step loop's body and of each one-step function, not
        under ``if step % N`` (a periodic call costs once per N steps). A breadth-first search
        follows them, at most MAX_DEPTH calls deep; a function already reached is not entered
        again, so cycles end and the work is linear in the calls."""
        reached: dict[ast.AST, Reach] = {}
        frontier: list[tuple[F, Func, Reach]] = []
        for script in self.scripts:
            shape = self.shape(script)
            roots: list[tuple[ast.AST, list[ast.AST]]] = []
            for loop in shape.step_loops:
                body = list(walk_stmts(getattr(loop, "body", [])))
                if isinstance(loop, ast.While):
                    body.extend(ast.walk(loop.test))
                roots.append((loop, body))
            for func in shape.called_step_funcs:
                roots.append((func, list(walk_scope(func))))
            for stop, nodes in roots:
                scope = stop if isinstance(stop, FUNCS) else script.scope_of(stop)
                name = qualname(script, scope)
                for node in nodes:
                    if not isinstance(node, ast.Call) or guarded_by_mod(script, node, stop):
                        continue
                    target = self.resolve(script, node)
                    if target is None or target[1] in reached:
                        continue
                    if target[1] is scope or target[1] in shape.called_step_funcs:
                        continue  # recursion into itself, or a step function (its own root)
                    reach = Reach(script, node.lineno, (name, qualname(*target)))
                    reached[target[1]] = reach
                    frontier.append((target[0], target[1], reach))
        while frontier:
            deeper: list[tuple[F, Func, Reach]] = []
            for script, func, reach in frontier:
                if len(reach.names) > MAX_DEPTH:
                    continue
                for node in walk_scope(func):
                    if not isinstance(node, ast.Call) or guarded_by_mod(script, node, func):
                        continue
                    target = self.resolve(script, node)
                    if target is None or target[1] in reached:
                        continue
                    if target[1] in self.shape(target[0]).called_step_funcs:
                        continue
                    longer = Reach(reach.root, reach.line, (*reach.names, qualname(*target)))
                    reached[target[1]] = longer
                    deeper.append((target[0], target[1], longer))
            frontier = deeper
        return reached

    # ---- what runs on a device ---------------------------------------------------------------

    def on_device(self, script: SourceFile) -> bool:
        """Whether ``script`` runs on an accelerator in this program: its own text says so
        (``mentions_accelerator``), or a file that does imports it, at any depth. A helper
        module that never names CUDA runs on the GPU of the script that imports it."""
        return id(script) in self._device_files

    @cached_property
    def _device_files(self) -> frozenset[int]:
        return self.imported_from([s for s in self.scripts if s.mentions_accelerator])

    def imported_from(self, roots: list[F]) -> frozenset[int]:
        """``id()`` of ``roots`` and of every checked file they import, at any depth."""
        found = {id(s) for s in roots}
        frontier = list(roots)
        while frontier:
            deeper: list[F] = []
            for script in frontier:
                for imported in self.imports_of(script):
                    if id(imported) not in found:
                        found.add(id(imported))
                        deeper.append(imported)
            frontier = deeper
        return frozenset(found)

    def imports_of(self, script: F) -> list[F]:
        """The checked files ``script`` imports (``import x``, ``from .x import f``, ``from
        pkg import module``)."""
        found: list[F] = []
        for module, level in imported_modules(script):
            target = self._module(script, module, level)
            if target is not None and target not in found:
                found.append(target)
        return found

    # ---- what runs once ----------------------------------------------------------------------

    def runs_once(self, script: F, node: ast.AST) -> bool:
        """Whether ``node`` runs once per run: in no loop of its function, and its function
        called (through every caller) only outside loops, up to the module or a
        ``main``/training function nothing calls. An uncalled helper is
        unknown, not once (a library's ``evaluate`` may be called per epoch elsewhere)."""
        return _once(self, script, node, set())


def _once(program: Program[F], script: F, node: ast.AST, seen: set[int]) -> bool:
    if script.loops_of(node):
        return False  # in a loop of its function: per epoch, per stage, per model...
    scope = script.scope_of(node)
    if isinstance(scope, ast.Module):
        return True
    if not isinstance(scope, FUNCS) or id(scope) in seen:
        return False  # a lambda or class body; a cycle: not provably once
    seen = seen | {id(scope)}
    calls = program.callers(script, scope)
    if not calls:
        trains = any(script.scope_of(loop) is scope for loop in program.shape(script).training)
        return scope.name == "main" or trains
    return all(_once(program, caller, call, seen) for caller, call in calls)


def _norm(path: str) -> str:
    return os.path.normcase(os.path.abspath(path))


def _enclosing_def(script: SourceFile, node: ast.AST, name: str) -> Func | None:
    """A function ``name`` defined in a scope enclosing ``node`` (nested defs, then the module)."""
    scope: ast.AST | None = script.scope_of(node)
    while scope is not None:
        if not isinstance(scope, ast.ClassDef):  # a class body's names are not in scope
            found = script.defs.get(scope, {}).get(name)
            if found is not None:
                return found
        if isinstance(scope, ast.Module):
            return None
        scope = script.scope_of(scope)
    return None


def _enclosing_class(script: SourceFile, node: ast.AST) -> ast.ClassDef | None:
    scope = script.scope_of(node)
    while isinstance(scope, FUNCS):
        owner = script.parents.get(scope)
        if isinstance(owner, ast.ClassDef):
            return owner
        scope = script.scope_of(scope)
    return None


def _method(script: SourceFile, cls: ast.ClassDef, name: str, seen: set[int]) -> Func | None:
    """Method ``name`` of ``cls`` or of a base class defined in the same file."""
    if id(cls) in seen:
        return None
    seen.add(id(cls))
    found = script.defs.get(cls, {}).get(name)
    if found is not None:
        return found
    for base in cls.bases:
        if isinstance(base, ast.Name):
            parent = script.classes.get(base.id)
            if parent is not None:
                inherited = _method(script, parent, name, seen)
                if inherited is not None:
                    return inherited
    return None
