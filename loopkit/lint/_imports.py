"""The program's own modules a file imports, found on disk as Python would find them: relative
imports from the file's package, absolute ones from the file's folder (``sys.path[0]`` of a
script run as ``python train.py``) and the packages it sits in. Library imports (torch, numpy,
anything installed) are not files there, so they are never followed."""

from __future__ import annotations

import os
from pathlib import Path

from ._names import FileNames

# A program of more local modules than this is checked as far as this many: the rest unseen.
MAX_FILES = 500


def imported_modules(file: FileNames) -> list[tuple[str, int]]:
    """``(module, level)`` of every import: ``import x.y``, ``from .a import b`` (``a`` and
    ``a.b``: ``b`` may be a module of package ``a``)."""
    wanted = list(file.imported_modules.values())
    for module, name, level in file.imported_names.values():
        wanted.append((module, level))
        wanted.append((f"{module}.{name}" if module else name, level))
    return wanted


def local_imports(file: FileNames) -> list[Path]:
    """The ``.py`` files on disk that ``file``'s imports name (each once, in import order)."""
    if file.path.startswith("<"):
        return []
    here = Path(os.path.abspath(file.path)).parent
    found: list[Path] = []
    for module, level in imported_modules(file):
        for candidate in _candidates(here, module, level):
            if candidate.is_file() and candidate not in found:
                found.append(candidate)
                break
    return found


def _candidates(here: Path, module: str, level: int) -> list[Path]:
    parts = module.split(".") if module else []
    if level:
        base = here
        for _ in range(level - 1):
            base = base.parent
        bases = [base]
    else:
        # The script's folder, then each package it is inside (``from pkg.x import f`` in
        # pkg/sub/train.py run as a module finds pkg from the folder above the top package).
        bases = [here]
        folder = here
        while (folder / "__init__.py").is_file() and folder.parent != folder:
            folder = folder.parent
            bases.append(folder)
    out: list[Path] = []
    # Installed libraries are not the program's: a script inside a package that sits in
    # site-packages would otherwise pull torch (and whatever else is installed) in.
    bases = [b for b in bases if not _installed(b)]
    for base in bases:
        if not parts:
            out.append(base / "__init__.py")
            continue
        stem = base.joinpath(*parts)
        out += [stem.with_name(stem.name + ".py"), stem / "__init__.py"]
    return out


def _installed(folder: Path) -> bool:
    """A folder of installed packages (``site-packages``, ``dist-packages``) or one inside it."""
    return any(part in {"site-packages", "dist-packages"} for part in folder.parts)
