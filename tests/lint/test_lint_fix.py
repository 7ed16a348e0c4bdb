"""loopkit.lint --fix: the rewrites that keep every result (LK004's exact factories), the
ones only suggested with their reason (LK004's others, LK010), their placement in any layout,
and fixed copies of CPU-runnable scripts that print exactly what the originals print."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT, deep
from test_lint import _cli

from loopkit import lint
from loopkit.lint import _rewrites

FIXABLE = sorted((ROOT / "tests" / "lint" / "corpus" / "fixable").glob("*.py"))

LOOP = """\
import torch
device = "cuda"
for x in data:
    m = torch.ones(3, 4).to(device)
    k = torch.arange(5,).cuda()
    r = torch.randn(3).to(device)
    t = torch.zeros((2, 2)).to(x)
    h = torch.zeros(2).to(device, non_blocking=True)
    s = torch.tensor([1, 2]).to(x.device)  # loopkit: ignore[LK004]
    opt.zero_grad(set_to_none=False)
    model.zero_grad(False)
    loss = f(x, m, k, r, t, h, s)
    loss.backward()
    opt.step()
"""

FIXED = """\
import torch
device = "cuda"
for x in data:
    m = torch.ones(3, 4, device=device)
    k = torch.arange(5, device="cuda")
    r = torch.randn(3).to(device)
    t = torch.zeros((2, 2)).to(x)
    h = torch.zeros(2, device=device)
    s = torch.tensor([1, 2]).to(x.device)  # loopkit: ignore[LK004]
    opt.zero_grad(set_to_none=False)
    model.zero_grad(False)
    loss = f(x, m, k, r, t, h, s)
    loss.backward()
    opt.step()
"""


def _found(source: str) -> list[tuple[int, str]]:
    return [(f.line, f.code) for f in lint.check_source(source)]


def test_fix_source_rewrites_exactly_the_safe_findings() -> None:
    """Exact factories moved by .to(device)/.cuda() (non_blocking too) get device=; a random
    factory, .to(tensor) and set_to_none=False are suggestions, with why; silenced lines stay."""
    assert _found(LOOP) == [(4, "LK004"), (5, "LK004"), (6, "LK004"), (7, "LK004"),
                            (8, "LK004"), (10, "LK010"), (11, "LK010")]  # fmt: skip
    suggestions: list[lint.Finding] = []
    fixed = lint.fix_source(LOOP, suggestions=suggestions)
    assert fixed == FIXED
    ast.parse(fixed)
    # The rewritten findings are gone; those it must not touch are still reported.
    assert _found(fixed) == [(6, "LK004"), (7, "LK004"), (10, "LK010"), (11, "LK010")]
    assert [(s.line, s.code, s.fix) for s in suggestions] == [
        (6, "LK004", "torch.randn(3, device=device)"),
        (7, "LK004", "torch.zeros((2, 2), device=x)"),
        (10, "LK010", "opt.zero_grad(set_to_none=True)"),
        (11, "LK010", "model.zero_grad(set_to_none=True)"),
    ]
    assert [s.message.split(": ", 1)[1] for s in suggestions] == [
        _rewrites.RANDOM,
        "`x` is not known to be a device: `.to()` of a dtype or a tensor converts the dtype "
        "too, which device= does not",
        _rewrites.SET_TO_NONE,
        _rewrites.SET_TO_NONE,
    ]
    assert lint.fix_source(fixed) == fixed  # a second pass has nothing left to do


def test_fix_source_select_and_nested_calls() -> None:
    """select= limits the rewrites to those codes; an inner fix inside an outer one is done
    over passes until nothing changes; a multi-line call keeps its arguments."""
    found: list[lint.Finding] = []
    assert lint.fix_source(LOOP, select=["LK010"], suggestions=found) == LOOP
    assert [(f.line, f.code) for f in found] == [(10, "LK010"), (11, "LK010")]
    nested = (
        "for b in dl:\n"
        "    w = torch.zeros(torch.ones(2).cuda().shape,\n"
        "                    dtype=torch.float16).to(device)\n"
        "    f(b, w).backward()\n"
    )
    fixed = lint.fix_source(nested)
    assert fixed == (
        "for b in dl:\n"
        '    w = torch.zeros(torch.ones(2, device="cuda").shape,\n'
        "                    dtype=torch.float16, device=device)\n"
        "    f(b, w).backward()\n"
    )
    assert _found(fixed) == []
    assert lint.fix_source("for b in dl:\n    x = torch.ones(3).to(device)\n", select=[]) == (
        "for b in dl:\n    x = torch.ones(3).to(device)\n"
    )


def test_fix_source_keeps_non_ascii_columns() -> None:
    """Columns count UTF-8 bytes in ast: a line with non-ASCII text before the call is cut
    at the right characters."""
    source = 'for b in dl:\n    é = ("→", torch.ones(3).to(device))\n    f(b, é).backward()\n'
    assert lint.fix_source(source) == (
        'for b in dl:\n    é = ("→", torch.ones(3, device=device))\n    f(b, é).backward()\n'
    )


def test_cli_fix_prints_a_diff_and_writes_only_with_write(tmp_path: Path) -> None:
    """--fix prints a unified diff (stdout) and exits 1, leaving the file, and the suggestions
    with their count (stderr); --fix --write writes it and exits 0; then --fix has only
    suggestions (exit 0, never "Nothing to fix."); --write alone is a usage error."""
    script = tmp_path / "train.py"
    script.write_text(LOOP)
    proc = _cli("--fix", str(script))
    assert proc.returncode == 1, proc.stderr
    assert proc.stdout.startswith(f"--- a/{str(script).lstrip('/')}\n+++ b/")
    lines = proc.stdout.splitlines()
    assert "-    m = torch.ones(3, 4).to(device)" in lines
    assert "+    m = torch.ones(3, 4, device=device)" in lines
    assert "+    h = torch.zeros(2, device=device)" in lines
    assert sum(line.startswith("+ ") or line.startswith("+    ") for line in lines) == 3
    notes = proc.stderr.splitlines()
    assert notes[-1] == "4 rewrite(s) not applied, as they could change what some programs " + (
        "compute: apply them by hand where the reason given does not hold."
    )
    assert [n.split(": ")[0] for n in notes[:-1]] == [f"{script}:{n}:" + c for n, c in (
        (6, "9"), (7, "9"), (10, "5"), (11, "5"))]  # fmt: skip
    assert notes[2].endswith("Suggested: opt.zero_grad(set_to_none=True)")
    assert script.read_text() == LOOP
    written = _cli("--fix", "--write", str(script))
    assert written.returncode == 0
    assert written.stdout.splitlines()[0] == "Fixed 1 file(s)."
    assert script.read_text() == FIXED
    again = _cli("--fix", str(script))
    assert again.returncode == 0 and "Nothing to fix." not in again.stdout
    assert again.stdout == "" and again.stderr.count("\n") == 5
    assert again.stderr.splitlines()[-1].startswith("4 rewrite(s) not applied")
    alone = _cli("--write", str(script))
    assert alone.returncode == 2 and "--write needs --fix" in alone.stderr


@deep
@pytest.mark.parametrize("path", FIXABLE, ids=lambda p: p.name)
def test_fixed_copy_runs_and_prints_the_same(path: Path, tmp_path: Path) -> None:
    """A CPU-runnable corpus script and its fixed copy print identical output (same losses,
    same parameters); the fixed copy parses, its LK004 findings are gone, and its LK010
    findings are left, as suggestions."""
    source = path.read_text()
    suggestions: list[lint.Finding] = []
    fixed = lint.fix_source(source, suggestions=suggestions)
    assert fixed != source
    before = {(f.line, f.code) for f in lint.check_source(source) if f.code in {"LK004", "LK010"}}
    after = {(f.line, f.code) for f in lint.check_source(fixed) if f.code in {"LK004", "LK010"}}
    assert before and after == {(s.line, s.code) for s in suggestions}
    assert {code for _, code in after} == {"LK010"}
    copy = tmp_path / path.name
    copy.write_text(fixed)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}

    def run(script: Path) -> str:
        proc = subprocess.run(
            [sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env
        )
        assert proc.returncode == 0, proc.stderr
        return proc.stdout

    original = run(path)
    assert original.count("\n") >= 3
    assert run(copy) == original
