"""The package layout: a folder per capability, no import cycles, names that say one thing."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from helpers import ROOT

import loopkit

PACKAGE = ROOT / "loopkit"
# The shared foundations: modules at the top that every capability may import.
FOUNDATIONS = {
    "_types", "_errors", "_checks", "_devices", "_ranks", "_job", "_slurm", "_sync_points",
    "_blocks", "_tracing",
}  # fmt: skip
# Modules at the top that are a whole capability (a folder of one file).
SINGLE_FILE_CAPABILITIES = {"_precision"}
MAX_CLASS_LINES = 250
MAX_MODULE_LINES = 400


def _modules() -> dict[str, Path]:
    """Every module of the package, the linter's included, by dotted name."""
    out: dict[str, Path] = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(name: str, path: Path) -> Iterator[str]:
    """The loopkit modules ``name`` imports, at any depth (function-level imports included)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package.split(".")[: len(package.split(".")) - node.level + 1]
            target = ".".join([*base, *([node.module] if node.module else [])])
            if node.module is not None:
                yield target
            # `from . import _x` and `from ._pkg import _x` may name modules too
            yield from (f"{target}.{a.name}" for a in node.names)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("loopkit"):
            yield str(node.module)


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {
        name: {d for d in _imports(name, path) if d in modules and d != name}
        for name, path in modules.items()
    }


def _capability(module: str) -> str:
    """``loopkit._step._accumulate`` -> ``_step``; a top-level module is its own."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph``, or None."""
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if not state.get(nxt):
                found = visit(nxt, path)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if not state.get(start):
            found = visit(start, [])
            if found:
                return found
    return None


def test_no_module_imports_itself_through_others() -> None:
    """No import cycle between loopkit's modules (lazy imports inside functions included)."""
    graph = {k: v - {"loopkit"} for k, v in _graph().items() if k != "loopkit"}
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])


def test_capabilities_import_each_other_without_a_cycle() -> None:
    """Folder by folder the imports form a hierarchy: no two capabilities import each other."""
    between: dict[str, set[str]] = {}
    for module, deps in _graph().items():
        if module in ("loopkit", "loopkit.distributed"):
            continue  # the public namespaces only re-export
        for dep in deps:
            if _capability(dep) != _capability(module):
                between.setdefault(_capability(module), set()).add(_capability(dep))
    assert _cycle(between) is None, " -> ".join(_cycle(between) or [])


def test_foundations_import_no_capability() -> None:
    """A foundation module imports only other foundations, never a capability above it."""
    for module, deps in _graph().items():
        if _capability(module) in FOUNDATIONS:
            upward = {d for d in deps if _capability(d) not in FOUNDATIONS}
            assert not upward, f"{module} imports {sorted(upward)}"


def test_every_private_module_is_a_foundation_or_in_a_capability_folder() -> None:
    """The top of the package holds only foundations, single-file capabilities and the public."""
    top = {p.stem for p in PACKAGE.glob("*.py")}
    # python -m loopkit.preload_caches, python -m loopkit.export
    public = {"__init__", "distributed", "preload_caches", "export"}
    assert top - FOUNDATIONS - SINGLE_FILE_CAPABILITIES == public
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert folders == {
        "_step", "_parallel", "_data", "_logging", "_observe", "_checkpoint", "_control",
        "_recompute", "_ema", "_compile", "_stream", "lint",
    }  # fmt: skip


def test_public_distributed_only_re_exports() -> None:
    """loopkit/distributed.py defines nothing: each of its names lives in its capability."""
    tree = ast.parse((PACKAGE / "distributed.py").read_text())
    defined = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))]
    assert not defined, [n.name for n in defined]


def test_module_names_say_one_thing() -> None:
    """No two modules differ by a plural or a suffix; none repeats its folder's name."""
    names: dict[str, str] = {}
    for module in _modules():
        parts = module.split(".")
        if len(parts) < 2 or parts[-1] == parts[1]:
            continue
        bare = parts[-1].strip("_")
        if len(parts) == 3:
            folder = parts[1].strip("_")
            assert not bare.startswith(folder), f"{module}: drop the folder's name from it"
        names[bare] = module
    for a in names:
        for b in names:
            confusable = b == a + "s" or b.startswith(a + "_")
            assert not confusable, f"{names[a]} and {names[b]} differ only by a plural or suffix"


def _classes() -> Iterator[tuple[str, str, int]]:
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.end_lineno is not None:
                yield str(path.relative_to(ROOT)), node.name, node.end_lineno - node.lineno + 1


def test_classes_hold_one_concern() -> None:
    """No class is longer than 250 lines (split by concern, as accumulate's window is)."""
    long = [(f, c, n) for f, c, n in _classes() if n > MAX_CLASS_LINES]
    assert not long, long


def test_modules_are_at_most_400_lines() -> None:
    """No module of loopkit/ is longer than 400 lines (split it along a seam it names)."""
    long = {
        str(p.relative_to(ROOT)): n
        for p in PACKAGE.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert not long, long


def test_every_public_name_resolves_and_import_loopkit_loads_no_torch() -> None:
    """Each name of loopkit.__all__ loads; a bare `import loopkit` imports no torch."""
    for name in loopkit.__all__:
        assert getattr(loopkit, name) is not None
    code = "import sys, loopkit; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
