"""Which loop counts a resumed run's epochs: the ``for NAME in range(...)`` around its first pass.

Read once, as the first pass after a relaunch starts (never per batch): the user's source around
the pass is parsed and the loop variables are read from the frames.
"""

from __future__ import annotations

import ast
import linecache
from collections.abc import Iterator
from types import FrameType

from .._step._source import function_at


def epoch_counter(
    frame: FrameType | None, epoch: int, depth: int = 4
) -> tuple[str, str, int] | None:
    """The ``for NAME in range(...)`` loop that counts the epochs around a pass started by a
    ``for`` statement (its ``file:line``, NAME and NAME's value), where NAME is behind
    ``epoch``; None where the loop is right or is no epoch loop.

    The loops around the pass are those of the innermost of ``depth`` user frames, outward,
    that has one (a pass in ``train_one_epoch(...)`` looks in its caller). Where the nearest
    loop is no ``range`` loop (``while step.updates < N``, a generator's ``while True``), the
    run is counted otherwise; a pass started by ``next(...)`` is an iteration-based loop's. Of
    the ``range`` loops nested there, one whose NAME is the loader's epoch is the epoch loop,
    in step (an inner ``for repeat in range(k)`` is not one); else the one named like an
    epoch, or the innermost."""
    if frame is None or not _for_header(frame):
        return None
    while frame is not None and depth > 0:
        loops = _loops_around(frame)
        if loops:
            return _behind(frame, loops, epoch)
        frame = frame.f_back
        depth -= 1
    return None


def _scope(frame: FrameType) -> ast.AST | None:
    try:
        tree = ast.parse("".join(linecache.getlines(frame.f_code.co_filename)))
    except (SyntaxError, ValueError):
        return None
    return function_at(tree, frame.f_code.co_firstlineno, frame.f_code.co_name)


def _own_nodes(scope: ast.AST) -> Iterator[ast.AST]:
    """The nodes of ``scope``'s own code (not of the functions and classes defined in it)."""
    for child in ast.iter_child_nodes(scope):
        if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            yield child
            yield from _own_nodes(child)


def _for_header(frame: FrameType) -> bool:
    """Whether the frame's line is a ``for`` statement's header (its iterable is the pass)."""
    scope, line = _scope(frame), frame.f_lineno
    return scope is not None and any(
        isinstance(node, (ast.For, ast.AsyncFor))
        and node.lineno <= line <= (node.iter.end_lineno or node.lineno)
        for node in _own_nodes(scope)
    )


def _loops_around(frame: FrameType) -> list[ast.For | ast.AsyncFor | ast.While]:
    """The loops whose body holds the frame's line, innermost first."""
    scope, line = _scope(frame), frame.f_lineno
    if scope is None:
        return []
    loops = [
        node for node in _own_nodes(scope)
        if isinstance(node, (ast.For, ast.AsyncFor, ast.While))
        and node.body[0].lineno <= line <= (node.end_lineno or 0)
    ]  # fmt: skip
    return sorted(loops, key=lambda node: -node.lineno)


def _behind(
    frame: FrameType, loops: list[ast.For | ast.AsyncFor | ast.While], epoch: int
) -> tuple[str, str, int] | None:
    counters: list[tuple[int, str, int]] = []
    for node in loops:  # the range loops nested around the pass, innermost first
        if not (isinstance(node, ast.For) and isinstance(node.target, ast.Name)):
            break
        value = frame.f_locals.get(node.target.id)
        if not _over_range(node.iter) or not isinstance(value, int) or isinstance(value, bool):
            break
        counters.append((node.lineno, node.target.id, value))
    if not counters or any(value == epoch for _, _, value in counters):
        return None
    line, name, value = next((c for c in counters if _epoch_like(c[1])), counters[0])
    return (f"{frame.f_code.co_filename}:{line}", name, value) if value < epoch else None


def _epoch_like(name: str) -> bool:
    name = name.lower()
    return "epoch" in name or name in ("e", "ep") or name.startswith("ep_") or name.endswith("_ep")


def _over_range(it: ast.expr) -> bool:
    """``range(...)``, ``trange(...)``, or a call wrapping one (``tqdm(range(E))``)."""
    if not isinstance(it, ast.Call):
        return False
    if isinstance(it.func, ast.Name) and it.func.id in ("range", "trange"):
        return True
    return any(_over_range(arg) for arg in it.args)
