"""A source text's positions: ast's (line, UTF-8 byte column) and its tokens, as offsets."""

from __future__ import annotations

import ast
import re
import tokenize
from dataclasses import dataclass
from functools import cached_property

# The line breaks ast and tokenize count (str.splitlines also splits at \f, \v, \x1c...).
_BREAK = re.compile(r"(?<=\n)|(?<=\r)(?!\n)")


@dataclass(frozen=True)
class Token:
    """One token: its type, text, row (1-based) and start and end offsets in the source."""

    type: int
    string: str
    row: int
    start: int
    end: int


class Text:
    """Offsets into ``source`` for ast nodes and tokens."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.lines = _BREAK.split(source)
        self.starts = [0]
        for line in self.lines:
            self.starts.append(self.starts[-1] + len(line))

    def offset(self, lineno: int, col: int, *, in_bytes: bool = True) -> int:
        """The offset of a position (ast's columns count UTF-8 bytes, tokenize's characters)."""
        line = self.lines[lineno - 1] if lineno - 1 < len(self.lines) else ""
        if in_bytes:
            col = len(line.encode()[:col].decode(errors="ignore"))
        return self.starts[lineno - 1] + col

    def span(self, node: ast.AST) -> tuple[int, int] | None:
        """``node``'s start and end offsets, or None if ast gave it no position."""
        end_line, end_col = getattr(node, "end_lineno", None), getattr(node, "end_col_offset", None)
        if end_line is None or end_col is None:
            return None
        start = self.offset(getattr(node, "lineno", 1), getattr(node, "col_offset", 0))
        return start, self.offset(end_line, end_col)

    def segment(self, node: ast.AST) -> str | None:
        """The text of ``node`` (not of the parentheses around it)."""
        span = self.span(node)
        return None if span is None else self.source[span[0] : span[1]]

    def tokens(self) -> list[Token] | None:
        """Every token, in order; None where the tokenizer refuses a text ast parses."""
        return self._tokens

    @cached_property
    def _tokens(self) -> list[Token] | None:
        lines = iter(self.lines)
        found: list[Token] = []
        try:
            for tok in tokenize.generate_tokens(lambda: next(lines, "")):
                if tok.type == tokenize.ENDMARKER:
                    break
                start = self.offset(*tok.start, in_bytes=False)
                found.append(
                    Token(tok.type, tok.string, tok.start[0], start, start + len(tok.string))
                )
        except (tokenize.TokenError, SyntaxError):
            return None
        return found
