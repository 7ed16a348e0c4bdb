"""Run the rules over a source text or over files and folders."""

from __future__ import annotations

import ast
import sys
import tokenize
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path

from ._calls import Project
from ._findings import Finding, one_per_line, unsilenced
from ._registry import rules_for
from ._rule import Rule
from ._script import Script


def check_source(
    source: str, path: str = "<string>", *, select: Iterable[str] | None = None
) -> list[Finding]:
    """Check one script's source; raises SyntaxError (or ValueError) if it does not parse.

    ``select``: the codes to check (only their rules run); None, every rule on by default.
    """
    script = parse(source, path)
    Project([script])
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
    Project([script for script, _ in parsed])
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


def check_paths(
    paths: Iterable[str | Path],
    *,
    select: Iterable[str] | None = None,
    on_skip: Callable[[str, str], None] = _report_skip,
) -> list[Finding]:
    """Check every Python file under ``paths``; files that do not parse go to ``on_skip``.

    ``select``: the codes to check (only their rules run); None, every rule on by default.
    """
    rules = rules_for(select)
    parsed: list[tuple[Script, str]] = []
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
            parsed.append((parse(source, name), source))
        except (SyntaxError, ValueError, RecursionError) as exc:
            on_skip(name, f"cannot parse: {exc}")
    # Checked together: a call in one file is followed into the functions of the others.
    Project([script for script, _ in parsed])
    findings: list[Finding] = []
    for script, source in parsed:
        try:
            findings.extend(_check(script, source, rules))
        except RecursionError as exc:
            on_skip(script.path, f"cannot check: {exc}")
    return findings
