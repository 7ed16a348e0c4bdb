"""Run the rules over a source text or over files and folders."""

from __future__ import annotations

import ast
import os
import sys
import tokenize
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path

from ._declaration import Rule
from ._findings import Finding, one_per_line, unsilenced
from ._imports import MAX_FILES, local_imports
from ._registry import rules_for
from ._script import Script, whole_program


def check_source(
    source: str, path: str = "<string>", *, select: Iterable[str] | None = None
) -> list[Finding]:
    """Check one script's source; raises SyntaxError (or ValueError) if it does not parse.

    ``select``: the codes to check (only their rules run); None, every rule on by default.
    """
    script = parse(source, path)
    whole_program([script])
    return _check(script, source, rules_for(select))


def check_sources(
    sources: Mapping[str, str], *, select: Iterable[str] | None = None
) -> list[Finding]:
    """Check several scripts together, as ``check_paths`` checks a folder: ``sources`` maps
    each one's path (``pkg/train.py``) to its text, and calls are followed across them.
    ``select`` as in ``check_source``. Raises SyntaxError (or ValueError) naming the first
    that does not parse."""
    rules = rules_for(select)
    parsed = [(parse(source, path), source) for path, source in sources.items()]
    whole_program([script for script, _ in parsed])
    return [f for script, source in parsed for f in _check(script, source, rules)]


def parse(source: str, path: str) -> Script:
    """The script model of one source; raises SyntaxError (or ValueError) if it does not parse."""
    with warnings.catch_warnings():
        # Invalid escape sequences and the like are the script's business, not a finding.
        warnings.simplefilter("ignore")
        tree = ast.parse(source, filename=path)
    return Script(tree, path)


def _check(script: Script, source: str, rules: Iterable[Rule]) -> list[Finding]:
    path = script.path
    findings = (
        Finding(
            path=path,
            line=getattr(node, "lineno", 1),
            col=getattr(node, "col_offset", 0) + 1,
            code=r.code,
            message=f"{what}: {r.why}.",
            fix=r.fix,
        )
        for r in rules
        for node, what in r.check(script)
    )
    return unsilenced(one_per_line(findings), source)


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


def _report_unseen(path: str, modules: list[str]) -> None:
    listed = ", ".join(modules)
    print(
        f"{path}: imports {listed}, not checked with it (single-file mode): what runs there "
        "every step, and whether it runs on the device, is unseen",
        file=sys.stderr,
    )


def check_paths(
    paths: Iterable[str | Path],
    *,
    select: Iterable[str] | None = None,
    on_skip: Callable[[str, str], None] = _report_skip,
    follow_imports: bool = True,
    on_unseen: Callable[[str, list[str]], None] | None = None,
) -> list[Finding]:
    """Check every Python file under ``paths`` as one program; files that do not parse go to
    ``on_skip``.

    ``select``: the codes to check (only their rules run); None, every rule on by default.
    ``follow_imports``: the program's own modules that the files import (found on disk, see
    _imports) are checked with them, and their findings reported; False (single-file mode):
    only the files named, and each file's imports of modules left out go to ``on_unseen``
    (None: a line on stderr each).
    """
    rules = rules_for(select)
    parsed: list[tuple[Script, str]] = []
    named = list(iter_python_files(paths))
    seen = {_real(f) for f in named}
    queue = list(named)
    while queue:
        file = queue.pop(0)
        loaded = _load(file, on_skip)
        if loaded is None:
            continue
        parsed.append(loaded)
        local = [p for p in local_imports(loaded[0]) if _real(p) not in seen]
        if not follow_imports:
            if local:
                (on_unseen or _report_unseen)(str(file), [str(p) for p in local])
            continue
        for module in local:
            if len(seen) >= MAX_FILES:
                on_skip(str(module), f"not checked: the program has more than {MAX_FILES} files")
                continue
            seen.add(_real(module))
            queue.append(module)
    # Checked together: a call in one file is followed into the functions of the others.
    whole_program([script for script, _ in parsed])
    findings: list[Finding] = []
    for script, source in parsed:
        try:
            findings.extend(_check(script, source, rules))
        except RecursionError as exc:
            on_skip(script.path, f"cannot check: {exc}")
    return findings


def _real(path: Path) -> str:
    return os.path.normcase(os.path.realpath(path))


def _load(file: Path, on_skip: Callable[[str, str], None]) -> tuple[Script, str] | None:
    """One file parsed, or None (told to ``on_skip``)."""
    name = str(file)
    try:
        with tokenize.open(file) as handle:  # honours a PEP 263 coding line
            source = handle.read()
    except (SyntaxError, UnicodeDecodeError) as exc:
        on_skip(name, f"cannot parse: {exc}")
        return None
    except OSError as exc:
        on_skip(name, f"cannot read: {exc}")
        return None
    try:
        return parse(source, name), source
    except (SyntaxError, ValueError, RecursionError) as exc:
        on_skip(name, f"cannot parse: {exc}")
        return None
