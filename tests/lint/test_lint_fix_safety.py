"""loopkit.lint --fix (issue 41): rewrites placed by tokens in every call layout, the fixer's
check of what it writes, and the rewrites that could change a result kept as suggestions."""

from __future__ import annotations

import ast
import contextlib
import io
import io as _io
import tokenize
import warnings
from pathlib import Path

import pytest
from test_lint import _cli

from loopkit import lint
from loopkit.lint import _fix, _rewrites

HEAD = 'import torch\ndevice = torch.device("cpu")\nfor x, y in data:\n'
TAIL = "    loss = f(x, w)\n    loss.backward()\n    opt.step()\n"

# (the statement in the loop, what --fix must make of it)
LAYOUTS = {
    "trailing comment after a trailing comma (issue 41's)": (
        "    w = torch.tensor(\n        [1.0, 2.0],  # per-class weights\n    ).to(device)\n",
        "    w = torch.tensor(\n        [1.0, 2.0], device=device,  # per-class weights\n    )\n",
    ),
    "trailing comment, no trailing comma": (
        "    w = torch.full(\n        (2,),  # size\n        0.5  # value )\n    ).to(device)\n",
        "    w = torch.full(\n        (2,),  # size\n"
        "        0.5, device=device  # value )\n    )\n",
    ),
    "comment on the closing line": (
        "    w = torch.ones(2, 3  # ) .to(x) 'quoted'\n    ).to(device)  # moved\n",
        "    w = torch.ones(2, 3, device=device  # ) .to(x) 'quoted'\n    )  # moved\n",
    ),
    "a chain across lines, with a comment": (
        "    w = (torch.zeros(2)  # on the host\n         .to(device))\n",
        "    w = (torch.zeros(2, device=device)  # on the host\n         )\n",
    ),
    "a backslash continuation": (
        "    w = torch.zeros(2, 3) \\\n        .to(device)\n",
        "    w = torch.zeros(2, 3, device=device)\n",
    ),
    "parentheses around the factory": (
        "    w = (torch.eye(3)).to(device)\n",
        "    w = (torch.eye(3, device=device))\n",
    ),
    "nested calls and keyword arguments": (
        "    w = torch.zeros(\n        torch.ones(2).to(device).shape,\n"
        "        dtype=torch.float16,  # half\n    ).to(device=device, non_blocking=True)\n",
        "    w = torch.zeros(\n        torch.ones(2, device=device).shape,\n"
        "        dtype=torch.float16, device=device,  # half\n    )\n",
    ),
    "no arguments, a string with parentheses and a hash": (
        "    w = torch.tensor(['(#', ')']).to(device), torch.ones().to(device)\n",
        "    w = torch.tensor(['(#', ')'], device=device), torch.ones(device=device)\n",
    ),
    "an alias of torch, non-ASCII text before it": (
        "    w = ('é→', th.arange(1, 5,).to(device))\n",
        "    w = ('é→', th.arange(1, 5, device=device))\n",
    ),
}


def _comments(source: str) -> list[str]:
    return [
        t.string
        for t in tokenize.generate_tokens(_io.StringIO(source).readline)
        if t.type == tokenize.COMMENT
    ]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_device_is_written_by_tokens_in_any_layout(layout: str) -> None:
    """The device= goes after the factory's last argument token, never into a comment or a
    string; the move goes; every comment outside the move stays; the result parses."""
    before, after = LAYOUTS[layout]
    source = "import torch as th\n" + HEAD + before + TAIL
    assert any(f.code == "LK004" for f in lint.check_source(source))
    fixed = lint.fix_source(source)
    assert fixed == "import torch as th\n" + HEAD + after + TAIL
    ast.parse(fixed)
    assert [c for c in _comments(source) if c not in _comments(fixed)] == []
    assert not [f for f in lint.check_source(fixed) if f.code == "LK004"]


def test_cli_fixes_the_issue_41_script(tmp_path: Path) -> None:
    """The multi-line call with a trailing comment of issue 41: --fix prints its diff and
    exits 1; never "cannot parse" nor "Nothing to fix." for a file that parses."""
    before, after = LAYOUTS["trailing comment after a trailing comma (issue 41's)"]
    script = tmp_path / "train.py"
    script.write_text(HEAD + before + TAIL)
    proc = _cli("--fix", str(script))
    assert proc.returncode == 1
    assert "cannot parse" not in proc.stderr and "Nothing to fix." not in proc.stdout
    assert "+        [1.0, 2.0], device=device,  # per-class weights\n" in proc.stdout
    assert (_cli("--fix", "--write", str(script)).returncode, script.read_text()) == (
        0,
        HEAD + after + TAIL,
    )


def test_a_rewrite_that_would_not_parse_is_a_reported_bug(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Were a rewrite ever to write text that does not parse to the intended code, fix_source
    raises (naming the file and line) and the CLI reports it as the fixer's bug, exits 1 and
    leaves the file: not "cannot parse", not "Nothing to fix."."""

    def broken(node: ast.AST, script: object, text: object) -> _rewrites.Rewrite | None:
        answer = _rewrites.host_factory(node, script, text)  # type: ignore[arg-type]
        if not isinstance(answer, _rewrites.Rewrite):
            return None
        start, _, insert = answer.edits[0]
        return _rewrites.Rewrite(
            answer.node, answer.span, ((start, start, insert + " #"),), answer.replacement
        )

    monkeypatch.setitem(_fix._REWRITERS, "LK004", broken)
    source = HEAD + "    w = torch.ones(3).to(device)\n" + TAIL
    with pytest.raises(RuntimeError, match=r"<string> at line\(s\) 4 .*a bug of the fixer"):
        lint.fix_source(source)
    script = tmp_path / "train.py"
    script.write_text(source)
    assert lint.main(["--fix", "--write", str(script)]) == 1
    out, err = capsys.readouterr()
    assert f"{script}: not fixed: loopkit.lint --fix: the rewrite of {script}" in err
    assert "cannot parse" not in err and "Nothing to fix." not in out
    assert script.read_text() == source


C04 = """\
import torch
from torch import nn

torch.manual_seed(0)


class MultiTask(nn.Module):
    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(4, 8)
        self.heads = nn.ModuleList([nn.Linear(8, 1), nn.Linear(8, 1)])

    def forward(self, x, task):
        return self.heads[task](torch.relu(self.trunk(x)))


model = MultiTask()
opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
data = [(torch.randn(8, 4), torch.randn(8, 1), i % 2) for i in range(6)]
for x, y, task in data:
    opt.zero_grad(set_to_none=False)
    loss = nn.functional.mse_loss(model(x, task), y)
    loss.backward()
    opt.step()
print([p.detach().flatten().tolist() for p in model.parameters()])
"""


def _run(source: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exec(compile(source, "<c04>", "exec"), {"__name__": "__main__"})
    return out.getvalue()


def test_set_to_none_is_suggested_not_applied() -> None:
    """zero_grad(set_to_none=False) in a multi-task loop (a head without gradient on every
    other step) is left as it is, with a suggestion saying why; the rewrite it suggests
    would indeed train other weights with AdamW."""
    suggestions: list[lint.Finding] = []
    assert lint.fix_source(C04, suggestions=suggestions) == C04
    assert [(s.line, s.code, s.fix) for s in suggestions] == [
        (21, "LK010", "opt.zero_grad(set_to_none=True)")
    ]
    assert "optimizers skip a None gradient where a zero one still moves" in suggestions[0].message
    suggested = C04.replace("set_to_none=False", "set_to_none=True")
    assert _run(C04) == _run(C04) != _run(suggested)


SUGGESTED = {
    "torch.randn(3).to(device)": ("torch.randn(3, device=device)", _rewrites.RANDOM),
    "torch.randint(0, 5, (3,)).cuda()": (
        "torch.randint(0, 5, (3,), device='cuda')",
        _rewrites.RANDOM,
    ),
    "torch.linspace(0, 1, 5).to(device)": (
        "torch.linspace(0, 1, 5, device=device)",
        _rewrites.ROUNDING,
    ),
    "torch.arange(0, 1, 0.1).to(device)": (
        "torch.arange(0, 1, 0.1, device=device)",
        _rewrites.ROUNDING,
    ),
    "torch.arange(n, dtype=torch.float16).to(device)": (
        "torch.arange(n, dtype=torch.float16, device=device)",
        _rewrites.ROUNDING,
    ),
    "torch.arange(k, n).to(device)": ("torch.arange(k, n, device=device)", _rewrites.ROUNDING),
    "torch.ones(3).to(device, torch.float16)": (
        "torch.ones(3, device=device, dtype=torch.float16)",
        _rewrites.TWO_ROUNDINGS,
    ),
    "torch.tensor([0.1]).to(device=device, dtype=torch.half)": (
        "torch.tensor([0.1], device=device, dtype=torch.half)",
        _rewrites.TWO_ROUNDINGS,
    ),
    "torch.tensor([1.0], requires_grad=True).to(device)": (
        "torch.tensor([1.0], requires_grad=True, device=device)",
        _rewrites.NOT_A_LEAF,
    ),
    "torch.zeros(3, pin_memory=True).to(device)": (
        "torch.zeros(3, pin_memory=True, device=device)",
        "a tensor built on the device cannot",
    ),
    "torch.ones(3).to(dev_dtype)": ("torch.ones(3, device=dev_dtype)", "`dev_dtype` is not known"),
    "torch.ones(3).to(gpu)": ("torch.ones(3, device=gpu)", "`gpu` is not known to be a device"),
    "torch.ones(3).to(pick())": ("torch.ones(3, device=pick())", "`pick()` is not known"),
    "torch.ones(3).to(pick().device)": (
        "torch.ones(3, device=pick().device)",
        "the device expression would run before",
    ),
}


@pytest.mark.parametrize("move", list(SUGGESTED))
def test_a_rewrite_that_could_change_a_result_is_a_suggestion(move: str) -> None:
    """Random factories, linspace, a fractional or float arange, a dtype converted by the
    move, requires_grad/pin_memory, a target not known to be a device: left as written, a
    suggestion with the rewrite and the reason."""
    source = (
        "import torch\ndevice = torch.device('cpu')\ndev_dtype = torch.float16\n"
        f"def train(gpu, n, k):\n    for x in data:\n        w = {move}\n"
        "        f(x, w).backward()\n        opt.step()\n"
    )
    assert [f.line for f in lint.check_source(source) if f.code == "LK004"] == [6]
    suggestions: list[lint.Finding] = []
    assert lint.fix_source(source, suggestions=suggestions) == source
    after, reason = SUGGESTED[move]
    assert [(s.line, s.code, s.fix) for s in suggestions] == [(6, "LK004", after)]
    assert suggestions[0].message.startswith(f"`{move}` not rewritten by --fix: {reason}")


def test_a_device_is_known_by_every_binding_of_its_name() -> None:
    """A name every binding of which is a device (a device string, torch.device, an IfExp of
    them, f"cuda:{rank}", x.device) is rewritten; one that is also a parameter is not."""
    source = (
        "import torch\n"
        'dev = "cuda" if torch.cuda.is_available() else "cpu"\n'
        'gpu = torch.device(f"cuda:{rank}")\n'
        "here = batch.device\n"
        "def train(other):\n"
        "    for x in data:\n"
        "        a = torch.ones(3).to(dev) + torch.ones(3).to(gpu) + torch.ones(3).to(here)\n"
        "        b = torch.zeros(2).to(other)\n"
        "        f(x, a, b).backward()\n"
        "        opt.step()\n"
    )
    suggestions: list[lint.Finding] = []
    fixed = lint.fix_source(source, suggestions=suggestions)
    assert (
        "        a = torch.ones(3, device=dev) + torch.ones(3, device=gpu)"
        " + torch.ones(3, device=here)\n" in fixed
    )
    assert [(s.line, s.fix) for s in suggestions] == [(8, "torch.zeros(2, device=other)")]
