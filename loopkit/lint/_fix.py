"""``--fix``: rewrite the findings whose fix is mechanical and keeps the script's results.

Two rewrites, each applied only at a finding (so only where the rule saw the cost) that no
``# loopkit: ignore`` silences:

- LK004: ``torch.ones(...).to(device)`` -> ``torch.ones(..., device=device)`` (and
  ``.cuda()`` -> ``device="cuda"``), for the deterministic factories only (``zeros``,
  ``ones``, ``full``, ``empty``, ``arange``, ``eye``, ``linspace``, ``tensor``): a random one
  built on the device draws from the device's generator, so its values would change. Only
  when the factory has no ``device=`` yet, and the ``.to`` has one positional argument that
  names a device (no dtype, no keywords: ``.to(x)`` of a tensor converts the dtype too).
- LK010: ``zero_grad(set_to_none=False)`` -> ``zero_grad(set_to_none=True)`` (LK010 already
  leaves alone the scripts that add into ``.grad`` by hand, which need the zeros).
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterable

from ._calls import Project
from ._check import parse
from ._findings import ignored_codes
from ._registry import REGISTRY
from ._syntax import dotted, is_const, keyword, method, receiver

Edit = tuple[int, int, str]  # start and end offsets in the source text, the replacement
_SAFE_FACTORIES = frozenset(
    {"zeros", "ones", "full", "empty", "arange", "eye", "linspace", "tensor"}
)


def fixable_codes() -> tuple[str, ...]:
    """The rules ``--fix`` can rewrite."""
    return tuple(sorted(_FIXERS))


def fix_source(source: str, select: Iterable[str] | None = None, path: str = "<string>") -> str:
    """``source`` with every fixable finding rewritten (``select``: the codes to fix; None,
    the fixable rules that are on by default). Raises SyntaxError if it does not parse."""
    codes = [
        c
        for c in (_FIXERS if select is None else select)
        if c in _FIXERS and (select is not None or REGISTRY[c].default)
    ]
    # A rewrite can uncover another (a fixed inner call inside a moved outer one): repeat
    # until nothing changes; each pass only shortens the list of findings, so this ends.
    for _ in range(8):
        edits = _edits(source, path, codes)
        if not edits:
            return source
        source = _apply(source, edits)
    return source


def _edits(source: str, path: str, codes: list[str]) -> list[Edit]:
    script = parse(source, path)
    Project([script])
    ignored = ignored_codes(source)
    lines = source.splitlines(keepends=True)
    edits: list[Edit] = []
    for code in codes:
        for node, _ in REGISTRY[code].check(script):
            line = getattr(node, "lineno", 0)
            silenced = ignored.get(line, frozenset())
            if silenced is None or code in silenced:
                continue
            edit = _FIXERS[code](node, source, lines)
            if edit is not None:
                edits.append(edit)
    return edits


def _apply(source: str, edits: list[Edit]) -> str:
    """The edits that do not overlap an earlier one, applied from the end."""
    kept: list[Edit] = []
    for edit in sorted(set(edits)):
        if not kept or edit[0] >= kept[-1][1]:
            kept.append(edit)
    for start, end, text in reversed(kept):
        source = source[:start] + text + source[end:]
    return source


def _offset(lines: list[str], lineno: int, col: int) -> int:
    """The text offset of an ast position (its column counts UTF-8 bytes)."""
    before = sum(len(line) for line in lines[: lineno - 1])
    return before + len(lines[lineno - 1].encode()[:col].decode(errors="ignore"))


def _span(node: ast.AST, lines: list[str]) -> tuple[int, int] | None:
    end_line, end_col = getattr(node, "end_lineno", None), getattr(node, "end_col_offset", None)
    if end_line is None or end_col is None:
        return None
    start = _offset(lines, getattr(node, "lineno", 1), getattr(node, "col_offset", 0))
    return start, _offset(lines, end_line, end_col)


def _looks_like_device(node: ast.expr) -> bool:
    """``device``, ``x.device``, ``args.device``, ``local_rank``, ``'cuda:0'``,
    ``torch.device(...)``: not a tensor or a dtype (``.to(t)`` converts the dtype too)."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str) and node.value.split(":")[0] in {"cuda", "cpu", "mps"}
    if isinstance(node, ast.Call):
        return (dotted(node.func) or "").endswith("device") and not node.keywords
    name = (dotted(node) or "").rsplit(".", 1)[-1].lower()
    return bool(name) and any(w in name for w in ("device", "dev", "rank", "gpu"))


def _fix_host_factory(node: ast.AST, source: str, lines: list[str]) -> Edit | None:
    """``torch.ones(3).to(device)`` -> ``torch.ones(3, device=device)``."""
    if not isinstance(node, ast.Call) or node.keywords:
        return None
    factory = receiver(node)
    if (
        not isinstance(factory, ast.Call)
        or not isinstance(factory.func, ast.Attribute)
        or dotted(factory.func.value) != "torch"
        or factory.func.attr not in _SAFE_FACTORIES
        or any(k.arg in {"device", None} for k in factory.keywords)
        or any(isinstance(a, ast.Starred) for a in factory.args)
    ):
        return None
    if method(node) == "cuda" and not node.args:
        device = '"cuda"'
    elif method(node) == "to" and len(node.args) == 1 and _looks_like_device(node.args[0]):
        device = ast.get_source_segment(source, node.args[0]) or ""
    else:
        return None
    whole, built = _span(node, lines), _span(factory, lines)
    if whole is None or built is None or not device:
        return None
    inner = source[built[0] : built[1] - 1].rstrip()  # up to the closing parenthesis
    if inner.endswith(","):
        inner += " "
    elif not inner.endswith("("):
        inner += ", "
    return whole[0], whole[1], f"{inner}device={device})"


def _fix_set_to_none(node: ast.AST, source: str, lines: list[str]) -> Edit | None:
    """``zero_grad(set_to_none=False)`` / ``zero_grad(False)`` -> ``set_to_none=True``."""
    if not isinstance(node, ast.Call) or method(node) != "zero_grad":
        return None
    flag = keyword(node, "set_to_none")
    value = flag.value if flag is not None else node.args[0] if node.args else None
    span = _span(value, lines) if value is not None and is_const(value, False) else None
    if span is None:
        return None
    if flag is None and len(node.args) == 1:  # zero_grad(False): say what True means
        return span[0], span[1], "set_to_none=True"
    return span[0], span[1], "True"


_FIXERS: dict[str, Callable[[ast.AST, str, list[str]], Edit | None]] = {
    "LK004": _fix_host_factory,
    "LK010": _fix_set_to_none,
}
