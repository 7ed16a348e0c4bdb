"""Invariant: a script fixed by ``loopkit-lint --fix`` computes what the original computes.

Hypothesis writes small training scripts holding the habits the fixer knows (LK004: a tensor
factory built on the host and moved; LK010: ``zero_grad(set_to_none=False)``) in many
shapes: single-line and multi-line calls, comments on any line, trailing commas, grouping
parentheses, a chain across lines, backslash continuations, ``.to(device=...)``,
``non_blocking=``, ``import torch as th``; in the training loop, in a function it calls
and in ``forward()``; moved to devices spelled in several ways, and to names that hold a
dtype or a tensor. The models have one head per task and train one task per step, so some
parameters get no gradient on some steps (a set_to_none rewrite would change their
updates). Each habit must be found by the linter; ``fix_source`` must rewrite exactly the
ones that keep every result and list the others as suggestions; the fixed text must parse;
and the original and the fixed script, each run in a fresh namespace with the same seed,
must print the same losses and final weights, bit for bit.
"""

from __future__ import annotations

import contextlib
import io
import warnings
from dataclasses import dataclass
from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from inv_budget import prop, where

from loopkit import lint

# (factory text with {T} for torch's name, whether --fix rewrites it automatically)
FACTORIES = [
    ("{T}.ones(B, 1)", True),
    ("{T}.zeros((B, 1), dtype={T}.float64)", True),
    ("{T}.full((B, 1), 0.5)", True),
    ("{T}.full((2,), 3)", True),
    ("{T}.eye(4)", True),
    ("{T}.tensor([0.1, 0.2, 1 / 3])", True),
    ("{T}.tensor([1, 2, 3])", True),
    ("{T}.tensor([True, False])", True),
    ("{T}.tensor([[0.5, 1.5], [2.5, 3.5]], dtype={T}.float64)", True),
    ("{T}.tensor([[1, 2], [3, 4]])", True),
    ("{T}.arange(B)", True),
    ("{T}.arange(1, 5)", True),
    ("{T}.empty(B, 1)", True),
    ("{T}.full(size=(B, 1), fill_value=0.5)", True),
    ("{T}.zeros({T}.ones(2, 3).to(device).shape, dtype={T}.float64)", True),
    ("{T}.arange(0, 1, 0.25)", False),
    ("{T}.arange(6, dtype={T}.float32)", False),
    ("{T}.linspace(0, 1, 5)", False),
    ("{T}.randn(B, 1)", False),
    ("{T}.rand(3)", False),
    ("{T}.tensor([0.5], requires_grad=True)", False),
]
# (how the move names its target, kept automatically; x is the step's batch, a tensor)
TARGETS = [
    ("device", True),
    ("dev", True),  # dev = "cpu" if ... else "cpu": every binding a device
    ("x.device", True),
    ('"cpu:0"', True),
    ("torch.device('cpu')", True),
    ("dev_dtype", False),  # a dtype: .to() converts, device= would raise
    ("gpu_ref", False),  # a float64 tensor: .to() converts the dtype too
    ("device, torch.float64", False),  # a second rounding
]
LAYOUTS = [
    "inline",
    "args_each_line",
    "comment_last_no_comma",
    "comment_before_close",
    "backslash",
    "chain_lines",
    "grouped",
    "keyword_device",
    "non_blocking",
]
ZERO_GRADS = [
    "opt.zero_grad(set_to_none=False)",
    "model.zero_grad(False)",
    "opt.zero_grad(\n        set_to_none=False,  # keep the zeros\n    )",
    "opt.zero_grad()",
]
OPTIMIZERS = [
    "torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)",
    "torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)",
    "torch.optim.Adam(model.parameters(), lr=1e-2)",
    "torch.optim.RMSprop(model.parameters(), lr=1e-2, weight_decay=0.01)",
]
HEADER = """\
import torch
import torch as th
from torch import nn

torch.manual_seed({seed})
device = torch.device("cpu")
dev = "cpu" if torch.cuda.is_available() else "cpu"
dev_dtype = torch.float64
gpu_ref = torch.zeros(1, dtype=torch.float64)
B = 4


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(3, 4)
        self.heads = nn.ModuleList([nn.Linear(4, 1) for _ in range({heads})])

    def forward(self, x, task):
        extra = x.new_zeros((), dtype=torch.float64)
"""
MIDDLE = """\
        return self.heads[task](torch.tanh(self.trunk(x))).double().sum() + extra


def terms(x):
    extra = x.new_zeros((), dtype=torch.float64)
"""
LOOP = """\
    return extra


model = Net()
opt = {optimizer}
data = [(torch.randn(B, 3), torch.randn(B, 1)) for _ in range({steps})]
for step, (x, y) in enumerate(data):
    task = step % {heads}
    {zero_grad}
    extra = terms(x)
"""
FOOTER = """\
    loss = (model(x, task) - y.double().sum()) ** 2 + 1e-3 * extra
    loss.backward()
    opt.step()
    print(repr(loss.item()))
print([p.detach().double().flatten().tolist() for p in model.parameters()])
"""


@dataclass(frozen=True)
class Habit:
    """One host-built tensor moved to a device: what, to where, how it is laid out, where."""

    factory: int
    target: int
    layout: str
    place: str  # "forward", "helper" or "loop"
    alias: bool  # th.ones(...) instead of torch.ones(...)

    @property
    def automatic(self) -> bool:
        """Whether --fix must rewrite it (else: a suggestion)."""
        return FACTORIES[self.factory][1] and TARGETS[self.target][1] and not self._two_targets

    @property
    def rewritten(self) -> bool:
        """Whether --fix changes its text (an inner factory is rewritten on its own)."""
        return self.automatic or ".to(device)" in FACTORIES[self.factory][0]

    @property
    def _two_targets(self) -> bool:
        return "," in TARGETS[self.target][0]

    def lines(self, name: str, indent: str) -> list[str]:
        """The statements, ``name`` bound to the moved tensor and added into ``extra``."""
        factory = FACTORIES[self.factory][0].format(T="th" if self.alias else "torch")
        target = TARGETS[self.target][0]
        func, args = factory.split("(", 1)
        args = args[:-1]
        move = f".to({target})"
        if self.layout == "keyword_device" and TARGETS[self.target][1]:
            move = f".to(device={target})"
        elif self.layout == "non_blocking":
            move = f".to({target}, non_blocking=True)"
        parts = _split_args(args)
        text = f"{func}({args}){move}"
        if self.layout == "args_each_line" and parts:
            body = "".join(f"{indent}    {p},  # argument {i}\n" for i, p in enumerate(parts))
            text = f"{func}(\n{body}{indent}){move}"
        elif self.layout == "comment_last_no_comma" and parts:
            body = "".join(f"{indent}    {p},\n" for p in parts[:-1])
            text = f"{func}(\n{body}{indent}    {parts[-1]}  # the last one\n{indent}){move}"
        elif self.layout == "comment_before_close":
            text = f"{func}({args}  # (a comment, with a parenthesis)\n{indent}){move}"
        elif self.layout == "backslash":
            text = f"{func}({args}) \\\n{indent}    {move}"
        elif self.layout == "chain_lines":
            text = f"({func}({args})  # built on the host\n{indent} {move})"
        elif self.layout == "grouped":
            text = f"({func}({args})){move}"
        out = [f"{indent}{name} = {text}"]
        if "empty" in func:
            out.append(f"{indent}{name}.fill_(0.25)")  # its first values are undefined
        out.append(f"{indent}extra = extra + {name}.detach().double().sum()")
        return "\n".join(out).split("\n")


def _split_args(args: str) -> list[str]:
    """The top-level comma-separated parts of an argument list."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(args):
        if ch in "([":
            depth += 1
        elif ch in ")]":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(args[start:i].strip())
            start = i + 1
    if args[start:].strip():
        parts.append(args[start:].strip())
    return parts


habits = st.builds(
    Habit,
    factory=st.integers(0, len(FACTORIES) - 1),
    target=st.integers(0, len(TARGETS) - 1),
    layout=st.sampled_from(LAYOUTS),
    place=st.sampled_from(["loop", "helper", "forward"]),
    alias=st.booleans(),
)


@dataclass(frozen=True)
class Program:
    """A generated training script, and where its habits are."""

    source: str
    automatic: list[int]  # lines of the habits --fix must rewrite
    suggested: list[int]  # lines of the habits it must only suggest (LK004 and LK010)
    changes: bool  # whether the fixed text differs


@st.composite
def programs(draw: Any) -> Program:
    found = draw(st.lists(habits, min_size=1, max_size=6))
    heads = draw(st.integers(1, 3))
    zero_grad = draw(st.sampled_from(ZERO_GRADS))
    text = HEADER.format(seed=draw(st.integers(0, 9)), heads=heads)
    automatic: list[int] = []
    suggested: list[int] = []

    def add(place: str, indent: str) -> None:
        nonlocal text
        for i, habit in enumerate(found):
            if habit.place == place:
                line = text.count("\n") + 1
                (automatic if habit.automatic else suggested).append(line)
                text += "\n".join(habit.lines(f"t{i}", indent)) + "\n"

    add("forward", " " * 8)
    text += MIDDLE
    add("helper", " " * 4)
    text += LOOP.format(
        optimizer=draw(st.sampled_from(OPTIMIZERS)),
        steps=draw(st.integers(3, 6)),
        heads=heads,
        zero_grad=zero_grad,
    )
    if "False" in zero_grad:
        suggested.append(_line_of(text, zero_grad))
    add("loop", " " * 4)
    text += FOOTER
    changes = any(h.rewritten for h in found)
    return Program(text, sorted(automatic), sorted(suggested), changes)


def _line_of(text: str, snippet: str) -> int:
    return text[: text.index(snippet)].count("\n") + 1


def run(source: str) -> str:
    """What the script prints, run in a fresh namespace (it seeds torch itself)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exec(compile(source, "<generated>", "exec"), {"__name__": "__main__"})
    return out.getvalue()


@prop(ci=25)
@given(programs())
def test_fix_keeps_every_result_and_suggests_the_rest(program: Program) -> None:
    """Every habit is found; the fix rewrites exactly the result-keeping ones (the others
    become suggestions); the fixed text parses and prints the same losses and weights."""
    source = program.source
    found = {(f.line, f.code) for f in lint.check_source(source, select=["LK004", "LK010"])}
    habits = set(program.automatic) | set(program.suggested)
    missing = sorted(line for line in habits if not {(line, "LK004"), (line, "LK010")} & found)
    assert not missing, f"habits not found at lines {missing} ({where()}):\n{source}"
    suggestions: list[lint.Finding] = []
    fixed = lint.fix_source(source, suggestions=suggestions)
    compile(fixed, "<fixed>", "exec")
    assert sorted(s.line for s in suggestions) == program.suggested, (where(), source)
    assert all(s.message and s.fix for s in suggestions)
    left = [f for f in lint.check_source(fixed, select=["LK004"])]
    assert len(left) == len([s for s in suggestions if s.code == "LK004"]), (where(), fixed)
    assert (fixed != source) == program.changes, (where(), source, fixed)
    assert run(fixed) == run(source), f"--fix changed a result ({where()}):\n{source}\n{fixed}"
