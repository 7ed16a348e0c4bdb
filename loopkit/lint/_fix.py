"""``--fix``: rewrite the findings whose fix keeps what every program computes, bit for bit;
show the others as suggestions, with the reason they are not applied.

Applied (``_rewrites.host_factory``), at an LK004 finding no ``# loopkit: ignore`` silences:
``torch.ones(...).to(device)`` -> ``torch.ones(..., device=device)`` (``.cuda()``:
``device="cuda"``), for the factories whose values do not depend on where they are computed
(``zeros``, ``ones``, ``full``, ``eye``, ``tensor``: Python values are converted on the
host either way; ``empty``: undefined either way; ``arange`` on integer literals and an
integer or inferred dtype: whole numbers, exact on any device), when the ``.to`` names a
device by what it is and converts nothing else. Suggested only, with the reason:

- LK004 of a random factory (the device's generator draws other numbers), ``linspace`` or
  a fractional ``arange`` (the device rounds differently), a ``.to()`` whose argument is not
  known to be a device (of a dtype or a tensor it converts the dtype too) or that also
  converts the dtype (rounded twice, not once), ``requires_grad=True`` (a leaf on the
  device, not a moved non-leaf) or ``pin_memory=True`` (raises on the device);
- LK010's ``zero_grad(set_to_none=True)``: a parameter that gets no gradient on a step
  keeps None, which optimizers skip where weight decay or momentum move a zero gradient.

Every pass checks that the text it wrote parses to exactly the intended tree (the original
with each rewritten node replaced): any other outcome is a bug of the fixer, raised as one.
"""

from __future__ import annotations

import ast
import warnings
from collections.abc import Callable, Iterable

from ._check import parse
from ._findings import Finding, ignored_codes
from ._registry import REGISTRY
from ._rewrites import Declined, Edit, Rewrite, host_factory, set_to_none
from ._script import Script, whole_program
from ._text import Text

Rewriter = Callable[[ast.AST, Script, Text], Rewrite | Declined | None]
_REWRITERS: dict[str, Rewriter] = {"LK004": host_factory, "LK010": set_to_none}


def fixable_codes() -> tuple[str, ...]:
    """The rules ``--fix`` rewrites or suggests a rewrite for."""
    return tuple(sorted(_REWRITERS))


def fix_source(
    source: str,
    select: Iterable[str] | None = None,
    path: str = "<string>",
    *,
    suggestions: list[Finding] | None = None,
) -> str:
    """``source`` with every finding whose rewrite keeps every result rewritten.

    ``select``: the codes to fix (None: the fixable rules that are on by default). Raises
    SyntaxError (or ValueError) if ``source`` does not parse. ``suggestions``: a list that
    gets one ``Finding`` per rewrite not applied because it could change what some program
    computes (its ``message`` says why, its ``fix`` is the rewritten code).
    """
    codes = [
        c
        for c in (_REWRITERS if select is None else select)
        if c in _REWRITERS and (select is not None or REGISTRY[c].default)
    ]
    # A rewrite can uncover another (a fixed inner call inside a moved outer one): repeat
    # until nothing changes; each pass only shortens the list of findings, so this ends.
    for attempt in range(8):
        script, rewrites, declined = _findings(source, path, codes)
        if attempt == 0 and suggestions is not None:
            suggestions.extend(declined)
        if not rewrites:
            break
        source = _apply(source, script, rewrites)
    return source


def _findings(
    source: str, path: str, codes: list[str]
) -> tuple[Script, list[Rewrite], list[Finding]]:
    """The rewrites of one pass, and the suggestions, at the findings no comment silences."""
    script = parse(source, path)
    whole_program([script])
    ignored = ignored_codes(source)
    text = Text(source)
    rewrites: list[Rewrite] = []
    declined: list[Finding] = []
    seen: set[int] = set()
    for code in codes:
        for node, _ in REGISTRY[code].check(script):
            line = getattr(node, "lineno", 0)
            silenced = ignored.get(line, frozenset())
            if silenced is None or code in silenced or id(node) in seen:
                continue
            seen.add(id(node))
            answer = _REWRITERS[code](node, script, text)
            if isinstance(answer, Rewrite):
                rewrites.append(answer)
            elif isinstance(answer, Declined):
                before = ast.unparse(node)
                declined.append(
                    Finding(
                        path=path,
                        line=line,
                        col=getattr(node, "col_offset", 0) + 1,
                        code=code,
                        message=f"`{before}` not rewritten by --fix: {answer.reason}",
                        fix=answer.after,
                    )
                )
    return script, rewrites, declined


def _apply(source: str, script: Script, rewrites: list[Rewrite]) -> str:
    """The rewrites that overlap no earlier one, applied; the result checked against the
    intended tree (``script``'s, with each rewritten node replaced)."""
    kept: list[Rewrite] = []
    for rewrite in sorted(rewrites, key=lambda r: r.span):
        if not kept or rewrite.span[0] >= kept[-1].span[1]:
            kept.append(rewrite)
    edits: list[Edit] = sorted(e for r in kept for e in r.edits)
    fixed = source
    for start, end, replacement in reversed(edits):
        fixed = fixed[:start] + replacement + fixed[end:]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = _Replace({id(r.node): r.replacement for r in kept}).visit(script.tree)
        try:
            got = ast.dump(ast.parse(fixed))
        except SyntaxError as exc:
            got = f"a text that does not parse ({exc})"
    if got != ast.dump(expected):
        where = ", ".join(str(getattr(r.node, "lineno", "?")) for r in kept)
        raise RuntimeError(
            f"loopkit.lint --fix: the rewrite of {script.path} at line(s) {where} did not give the "
            f"intended code, {got[:200]}: a bug of the fixer (please report it); the file "
            "was left as it was"
        )
    return fixed


class _Replace(ast.NodeTransformer):
    """A tree with the nodes at the rewrites' positions replaced by their replacements."""

    def __init__(self, by_id: dict[int, ast.expr]) -> None:
        self.by_id = by_id

    def visit(self, node: ast.AST) -> ast.AST:
        new = self.by_id.get(id(node))
        return new if new is not None else super().visit(node)
