"""What ``--fix`` would write at one finding, and whether that keeps every result.

Each rewriter looks at one finding's node and answers a ``Rewrite`` (applied: it keeps what
every program computes, bit for bit), a ``Declined`` (shown as a suggestion with the reason:
some program would compute something else), or None (no mechanical rewrite). Text edits
are placed by token positions, never by searching the text, so no edit lands in a comment
or a string, whatever the call's layout (comments, trailing commas, backslashes).
"""

from __future__ import annotations

import ast
import tokenize
from dataclasses import dataclass

from ._script import Script
from ._syntax import dotted, is_const, keyword, method, receiver
from ._text import Text

Edit = tuple[int, int, str]  # start and end offsets in the source text, the replacement

# Deterministic factories whose values do not depend on where they are computed: exact
# (zeros, ones, eye; full and tensor convert their Python values on the host either way),
# or undefined either way (empty). arange only on whole numbers: see _rounds_on_device.
_EXACT = frozenset({"zeros", "ones", "full", "empty", "eye", "tensor", "arange"})
_RANDOM = frozenset({"randn", "rand", "randint", "randperm", "normal", "bernoulli"})
_INT_DTYPES = frozenset(
    {"int", "int8", "int16", "int32", "int64", "long", "short", "uint8", "bool"}
)
# The factories' own arguments by name, which say what to build, not where or how.
_VALUE_KEYWORDS = frozenset(
    {
        "size",
        "fill_value",
        "data",
        "start",
        "end",
        "step",
        "n",
        "m",
        "dtype",
        "requires_grad",
        "pin_memory",
    }
)
_DEVICE_TYPES = frozenset({"cuda", "cpu", "mps", "xpu"})
# Calls a device expression may hold: none of them has a side effect that moving it before
# the factory call could reorder (the factory's own arguments are evaluated first either way).
_PURE_CALLS = frozenset({"device", "next", "parameters", "buffers"})

NOT_A_LEAF = (
    "with requires_grad=True the moved tensor is not a leaf and gets no .grad, while one "
    "built on the device is a leaf that does"
)
RANDOM = (
    "a random factory built on the device draws from the device's generator, not the host's: "
    "other numbers"
)
ROUNDING = (
    "linspace and a fractional arange compute their values where they are built, and the "
    "device rounds differently from the host (CUDA's arange works in float32, the CPU's in "
    "float64)"
)
TWO_ROUNDINGS = (
    "this `.to()` converts the dtype too: built with dtype= the values would be rounded once "
    "instead of twice"
)
SET_TO_NONE = (
    "a parameter that gets no gradient on some step (an unused head or branch, a frozen or "
    "conditional layer) would keep None instead of zeros, and optimizers skip a None gradient "
    "where a zero one still moves the weight (weight decay, momentum, Adam's moments); code "
    "that reads `.grad` would meet None. Apply it when every parameter gets a gradient on "
    "every step"
)


@dataclass(frozen=True)
class Rewrite:
    """An applied fix: text edits inside ``node``'s span, and the node the text must parse to."""

    node: ast.expr
    span: tuple[int, int]
    edits: tuple[Edit, ...]
    replacement: ast.expr


@dataclass(frozen=True)
class Declined:
    """A fix not applied: the rewrite (as code) and why it could change a result."""

    node: ast.AST
    after: str
    reason: str


def host_factory(node: ast.AST, script: Script, text: Text) -> Rewrite | Declined | None:
    """LK004: ``torch.ones(3).to(device)`` -> ``torch.ones(3, device=device)``."""
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
        return None
    factory = receiver(node)
    if (
        not isinstance(factory, ast.Call)
        or not isinstance(factory.func, ast.Attribute)
        or dotted(factory.func.value) not in script.torch_names
        or any(k.arg is None or k.arg == "device" for k in factory.keywords)
        or any(isinstance(a, ast.Starred) for a in factory.args)
        or any(isinstance(a, ast.GeneratorExp) for a in factory.args)
    ):
        return None
    name = factory.func.attr
    device, why = _target(node, script)
    if device is None:
        return None
    moved = ast.Call(
        func=factory.func,
        args=factory.args,
        keywords=[*factory.keywords, ast.keyword(arg="device", value=device)],
    )
    dtype = node.args[1] if len(node.args) == 2 else keyword(node, "dtype")
    if dtype is not None:  # converted by the move: only ever suggested
        value = dtype.value if isinstance(dtype, ast.keyword) else dtype
        moved.keywords = [k for k in moved.keywords if k.arg != "dtype"]
        moved.keywords.append(ast.keyword(arg="dtype", value=value))
    if name in _RANDOM:
        why = why or RANDOM
    elif name == "linspace" or (name == "arange" and _rounds_on_device(factory)):
        why = why or ROUNDING
    elif name not in _EXACT:
        return None
    for k in factory.keywords:
        if k.arg == "requires_grad" and not is_const(k.value, False):
            why = why or NOT_A_LEAF
        elif k.arg == "pin_memory" and not is_const(k.value, False):
            why = why or "a tensor built on the device cannot be pinned (pin_memory=True raises)"
        elif k.arg not in _VALUE_KEYWORDS:
            why = why or f"`{k.arg}=` means something else for a tensor built on the device"
    if why:
        return Declined(node, ast.unparse(moved), why)
    rewrite = _edits(node, factory, device, text)
    if rewrite is None:
        return None
    span, edits = rewrite
    return Rewrite(node, span, edits, moved)


def _target(move: ast.Call, script: Script) -> tuple[ast.expr | None, str]:
    """The device a ``.to(...)``/``.cuda()`` moves to, and why rewriting it could change a
    result ('' when it cannot); None when the call is no plain move."""
    args, keywords = move.args, {k.arg: k.value for k in move.keywords}
    if None in keywords:
        return None, ""
    why = ""
    for arg, value in keywords.items():
        if arg == "non_blocking":
            # The copy's source is the fresh host tensor, which nothing else can reach and
            # write to while the copy runs: dropping it changes nothing, unless evaluating it
            # does.
            if not isinstance(value, ast.Constant | ast.Name):
                why = why or "evaluating its non_blocking= argument could have effects"
        elif arg != "device":
            why = why or (
                TWO_ROUNDINGS if arg == "dtype" else f"`{arg}=` has no counterpart in the factory"
            )
    if method(move) == "cuda":
        if len(args) > 1 or (args and "device" in keywords):
            return None, ""
        given = args[0] if args else keywords.get("device")
        if given is None:
            return ast.Constant("cuda"), why  # the current CUDA device, as .cuda() takes it
        target = given
    elif method(move) != "to":
        return None, ""
    elif "device" in keywords and not args:
        target = keywords["device"]
    elif "device" not in keywords and len(args) in {1, 2}:
        target = args[0]
        why = why or (TWO_ROUNDINGS if len(args) == 2 else "")
    else:
        return None, ""
    if not _is_device(target, script):
        why = why or (
            f"`{ast.unparse(target)}` is not known to be a device: `.to()` of a dtype or a tensor "
            "converts the dtype too, which device= does not"
        )
    elif any(
        isinstance(n, ast.Call) and (dotted(n.func) or "").rsplit(".", 1)[-1] not in _PURE_CALLS
        for n in ast.walk(target)
    ) or any(isinstance(n, ast.NamedExpr | ast.Await) for n in ast.walk(target)):
        why = why or "the device expression would run before the factory instead of after it"
    return target, why


def _is_device(node: ast.expr, script: Script, depth: int = 0) -> bool:
    """Whether ``node`` is a device by what it is, not by a guess: ``"cuda:0"``, an int,
    ``torch.device(...)``, ``x.device``, a name ``device``, or a name every binding of which
    in the file is one of these (``dev = "cuda" if ok else "cpu"``)."""
    if depth > 4:
        return False
    if isinstance(node, ast.Constant):
        if isinstance(node.value, str):
            return node.value.split(":")[0] in _DEVICE_TYPES
        return type(node.value) is int and node.value >= 0
    if isinstance(node, ast.JoinedStr):  # f"cuda:{rank}"
        first = node.values[0] if node.values else None
        return isinstance(first, ast.Constant) and str(first.value).split(":")[0] in _DEVICE_TYPES
    if isinstance(node, ast.IfExp):
        return _is_device(node.body, script, depth + 1) and _is_device(
            node.orelse, script, depth + 1
        )
    if isinstance(node, ast.Call):
        func = dotted(node.func) or ""
        return func.rsplit(".", 1)[0] in script.torch_names and func.endswith(".device")
    if isinstance(node, ast.Attribute):
        return node.attr == "device"
    if isinstance(node, ast.Name):
        if node.id == "device":
            return True
        values = script.bindings.get(node.id, [])
        return bool(values) and all(
            v is not None and _is_device(v, script, depth + 1) for v in values
        )
    return False


def _rounds_on_device(arange: ast.Call) -> bool:
    """Whether ``torch.arange(...)`` could hold values that are not whole numbers, or a dtype
    whose rounding of them happens on the device: its start and step are not integer
    literals, or its dtype is not an integer one."""
    bounds = arange.args[:1] + arange.args[2:] if len(arange.args) > 1 else []
    bounds += [k.value for k in arange.keywords if k.arg in {"start", "step"}]
    if not all(_int_literal(b) for b in bounds):
        return True
    if any(isinstance(a, ast.Constant) and type(a.value) is float for a in arange.args):
        return True
    dtype = keyword(arange, "dtype")
    return dtype is not None and (dotted(dtype.value) or "").rsplit(".", 1)[-1] not in _INT_DTYPES


def _int_literal(node: ast.expr) -> bool:
    """``3`` or ``-3``."""
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        node = node.operand
    return isinstance(node, ast.Constant) and type(node.value) is int


def _edits(
    move: ast.Call, factory: ast.Call, device: ast.expr, text: Text
) -> tuple[tuple[int, int], tuple[Edit, ...]] | None:
    """``, device=...`` after the factory's last argument token (before any comment), and the
    move's ``.to(...)`` taken out from its dot (a comment or a parenthesis before it stays)."""
    whole, built = text.span(move), text.span(factory)
    tokens = text.tokens()
    if whole is None or built is None or tokens is None:
        return None
    inside = [t for t in tokens if built[0] <= t.start and t.end <= built[1]]
    if not inside or inside[-1].string != ")" or inside[-1].end != built[1]:
        return None
    last = next((t for t in reversed(inside[:-1]) if t.type not in _LAYOUT), None)
    # Between the factory and the dot: only layout, comments and the parentheses around it.
    dot = next(
        (t for t in tokens if t.start >= built[1] and t.type not in _LAYOUT and t.string != ")"),
        None,
    )
    if last is None or dot is None or dot.string != "." or dot.end > whole[1]:
        return None
    # A device the move only implies (``.cuda()``) is written out; one it names is copied.
    given = text.segment(device) if hasattr(device, "lineno") else '"cuda"'
    if given is None:
        return None
    if last.string == "(":
        insert = f"device={given}"
    elif last.string == "," and last.row != inside[-1].row:
        insert = f" device={given},"  # a trailing comma before a closing line stays trailing
    elif last.string == ",":
        insert = f" device={given}"
    else:
        insert = f", device={given}"
    gap = [t for t in tokens if built[1] <= t.start < dot.start and t.type != tokenize.NL]
    cut = dot.start if gap else built[1]
    return whole, ((last.end, last.end, insert), (cut, whole[1], ""))


_LAYOUT = frozenset(
    {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT}
)


def set_to_none(node: ast.AST, script: Script, text: Text) -> Rewrite | Declined | None:
    """LK010: ``zero_grad(set_to_none=False)``: always a suggestion, never applied."""
    if not isinstance(node, ast.Call) or method(node) != "zero_grad":
        return None
    flag = keyword(node, "set_to_none")
    value = flag.value if flag is not None else node.args[0] if node.args else None
    if value is None or not is_const(value, False):
        return None
    after = ast.Call(
        func=node.func,
        args=[a for a in node.args if a is not value],
        keywords=[
            *(k for k in node.keywords if k is not flag),
            ast.keyword(arg="set_to_none", value=ast.Constant(True)),
        ],
    )
    return Declined(node, ast.unparse(after), SET_TO_NONE)
