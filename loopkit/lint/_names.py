"""Names a file binds: what each name is bound to, what it imports, what it calls torch."""

from __future__ import annotations

import ast
from functools import cached_property

from ._syntax import FUNCS, SCOPES, assigned_names, dotted, walk_scope


class FileNames:
    """A parsed file's scopes and names: what encloses a node, what each scope defines, what
    names are bound to, what the file imports (what a call can be resolved to)."""

    def __init__(self, tree: ast.Module, path: str) -> None:
        self.tree = tree
        self.path = path
        # Every node once, in ast.walk's order: the rules scan the file many times.
        self.nodes: list[ast.AST] = list(ast.walk(tree))
        self.parents: dict[ast.AST, ast.AST] = {}
        for node in self.nodes:
            for child in ast.iter_child_nodes(node):
                self.parents[child] = node
        self._scope_bindings: dict[ast.AST, list[tuple[str, ast.expr | None]]] = {}

    def scope_bindings(self, scope: ast.AST) -> list[tuple[str, ast.expr | None]]:
        """(name, value) of each plain-name binding that runs with ``scope`` (nested defs
        left out), in the order walked; computed once per scope (rules ask it per name)."""
        found = self._scope_bindings.get(scope)
        if found is None:
            found = [b for n in walk_scope(scope) for b in assigned_names(n)]
            self._scope_bindings[scope] = found
        return found

    @cached_property
    def import_froms(self) -> list[ast.ImportFrom]:
        """Every ``from module import ...`` of the file, any scope."""
        return [n for n in self.nodes if isinstance(n, ast.ImportFrom)]

    def scope_of(self, node: ast.AST) -> ast.AST:
        parent = self.parents.get(node)
        while parent is not None and not isinstance(parent, SCOPES):
            parent = self.parents.get(parent)
        return parent if parent is not None else self.tree

    @cached_property
    def defs(self) -> dict[ast.AST, dict[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
        """Scope (module, function, class) -> the functions defined directly in it, by name."""
        found: dict[ast.AST, dict[str, ast.FunctionDef | ast.AsyncFunctionDef]] = {}
        for node in self.nodes:
            if isinstance(node, FUNCS):
                found.setdefault(self.scope_of(node), {})[node.name] = node  # the last wins
        return found

    @cached_property
    def classes(self) -> dict[str, ast.ClassDef]:
        """The classes of this file by name."""
        return {n.name: n for n in self.nodes if isinstance(n, ast.ClassDef)}

    @cached_property
    def bindings(self) -> dict[str, list[ast.expr | None]]:
        """Every value a name (``x``, ``self.x``) is bound to in this file, any scope."""
        return bindings(self.tree)

    @cached_property
    def torch_names(self) -> frozenset[str]:
        """What this file calls torch: ``torch``, and ``th`` after ``import torch as th``."""
        return torch_names(self.tree)

    @cached_property
    def imported_names(self) -> dict[str, tuple[str, str, int]]:
        """Local name -> (module, name, level) for each ``from module import name [as local]``."""
        return imported_names(self.tree)

    @cached_property
    def imported_modules(self) -> dict[str, tuple[str, int]]:
        """Local name -> (module, level) for ``import a.b as m`` and ``from . import m``."""
        return imported_modules(self.tree)


def bindings(tree: ast.Module) -> dict[str, list[ast.expr | None]]:
    """Every value a name (``x``, ``self.x``) is bound to in this file, any scope."""
    found: dict[str, list[ast.expr | None]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                name = dotted(target)
                if name is not None:
                    found.setdefault(name, []).append(node.value)
                else:
                    for n in ast.walk(target):
                        if isinstance(n, ast.Name | ast.Attribute) and dotted(n):
                            found.setdefault(str(dotted(n)), []).append(None)
        elif isinstance(node, ast.For | ast.AsyncFor | ast.With | ast.AsyncWith):
            bound = (
                [node.target]
                if isinstance(node, ast.For | ast.AsyncFor)
                else [i.optional_vars for i in node.items if i.optional_vars is not None]
            )
            for target in bound:
                for n in ast.walk(target):
                    if isinstance(n, ast.Name | ast.Attribute) and dotted(n):
                        found.setdefault(str(dotted(n)), []).append(None)
        elif isinstance(node, FUNCS):
            for arg in [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]:
                found.setdefault(arg.arg, []).append(None)
    return found


def torch_names(tree: ast.Module) -> frozenset[str]:
    """What this file calls torch: ``torch``, and ``th`` after ``import torch as th``."""
    names = {"torch"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.asname for a in node.names if a.name == "torch" and a.asname)
    return frozenset(names)


def imported_names(tree: ast.Module) -> dict[str, tuple[str, str, int]]:
    """Local name -> (module, name, level) for each ``from module import name [as local]``."""
    found: dict[str, tuple[str, str, int]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                found[alias.asname or alias.name] = (node.module or "", alias.name, node.level)
    return found


def imported_modules(tree: ast.Module) -> dict[str, tuple[str, int]]:
    """Local name -> (module, level) for ``import a.b as m`` and ``from . import m``."""
    found: dict[str, tuple[str, int]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    found[alias.asname] = (alias.name, 0)
                elif "." not in alias.name:
                    found[alias.name] = (alias.name, 0)
        elif isinstance(node, ast.ImportFrom):
            for alias in node.names:
                module = f"{node.module}.{alias.name}" if node.module else alias.name
                found[alias.asname or alias.name] = (module, node.level)
    return found
