"""What the linter reports (``Finding``), and the ``# loopkit: ignore`` comments that silence it."""

from __future__ import annotations

import io
import re
import tokenize
from collections.abc import Iterable
from dataclasses import dataclass

_IGNORE = re.compile(r"#\s*loopkit:\s*ignore(?:\[(?P<codes>[^\]]*)\])?")


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


def one_per_line(findings: Iterable[Finding]) -> list[Finding]:
    """Sorted by place, one per code and line: a chain such as x.cpu().numpy() is one habit."""
    seen: set[tuple[int, str]] = set()
    unique: list[Finding] = []
    for f in sorted(findings, key=lambda f: (f.line, f.col, f.code)):
        if (f.line, f.code) not in seen:
            seen.add((f.line, f.code))
            unique.append(f)
    return unique


def unsilenced(findings: Iterable[Finding], source: str) -> list[Finding]:
    """The findings that no ``# loopkit: ignore`` comment on their line silences."""
    ignored = ignored_codes(source)
    kept: list[Finding] = []
    for f in findings:
        codes = ignored.get(f.line, frozenset())
        if codes is not None and f.code not in codes:
            kept.append(f)
    return kept


def ignored_codes(source: str) -> dict[int, frozenset[str] | None]:
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
