"""loopkit.lint --fix: the mechanical rewrites (LK004, LK010), their limits, and fixed copies of
CPU-runnable scripts that print exactly what the originals print."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT
from test_lint import _cli

from loopkit import lint

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
    h = torch.zeros(2).to(device, non_blocking=True)
    s = torch.tensor([1, 2]).to(x.device)  # loopkit: ignore[LK004]
    opt.zero_grad(set_to_none=True)
    model.zero_grad(set_to_none=True)
    loss = f(x, m, k, r, t, h, s)
    loss.backward()
    opt.step()
"""


def _found(source: str) -> list[tuple[int, str]]:
    return [(f.line, f.code) for f in lint.check_source(source)]


def test_fix_source_rewrites_exactly_the_safe_findings() -> None:
    """Deterministic factories moved by .to(device)/.cuda() get device=, set_to_none=False
    becomes True; random factories, .to(tensor), .to(..., keyword) and silenced lines stay."""
    assert _found(LOOP) == [(4, "LK004"), (5, "LK004"), (6, "LK004"), (7, "LK004"),
                            (8, "LK004"), (10, "LK010"), (11, "LK010")]  # fmt: skip
    fixed = lint.fix_source(LOOP)
    assert fixed == FIXED
    ast.parse(fixed)
    # The rewritten findings are gone; those it must not touch are still reported.
    assert _found(fixed) == [(6, "LK004"), (7, "LK004"), (8, "LK004")]
    assert lint.fix_source(fixed) == fixed  # a second pass has nothing left to do


def test_fix_source_select_and_nested_calls() -> None:
    """select= limits the rewrites to those codes; an inner fix inside an outer one is done
    over passes until nothing changes; a multi-line call keeps its arguments."""
    only_zero_grad = lint.fix_source(LOOP, select=["LK010"])
    assert only_zero_grad == LOOP.replace("set_to_none=False", "set_to_none=True").replace(
        "zero_grad(False)", "zero_grad(set_to_none=True)"
    )
    nested = (
        "for b in dl:\n"
        "    w = torch.zeros(torch.ones(2).cuda().shape,\n"
        "                    dtype=torch.float16).to(dev)\n"
        "    f(b, w).backward()\n"
    )
    fixed = lint.fix_source(nested)
    assert fixed == (
        "for b in dl:\n"
        '    w = torch.zeros(torch.ones(2, device="cuda").shape,\n'
        "                    dtype=torch.float16, device=dev)\n"
        "    f(b, w).backward()\n"
    )
    assert _found(fixed) == []
    assert lint.fix_source("for b in dl:\n    x = torch.ones(3).to(dev)\n", select=[]) == (
        "for b in dl:\n    x = torch.ones(3).to(dev)\n"
    )


def test_fix_source_keeps_non_ascii_columns() -> None:
    """Columns count UTF-8 bytes in ast: a line with non-ASCII text before the call is cut
    at the right characters."""
    source = 'for b in dl:\n    é = ("→", torch.ones(3).to(dev))\n    f(b, é).backward()\n'
    assert lint.fix_source(source) == (
        'for b in dl:\n    é = ("→", torch.ones(3, device=dev))\n    f(b, é).backward()\n'
    )


def test_cli_fix_prints_a_diff_and_writes_only_with_write(tmp_path: Path) -> None:
    """--fix prints a unified diff and exits 1, leaving the file; --fix --write writes it and
    exits 0; then --fix finds nothing (exit 0); --write alone is a usage error."""
    script = tmp_path / "train.py"
    script.write_text(LOOP)
    proc = _cli("--fix", str(script))
    assert proc.returncode == 1, proc.stderr
    assert proc.stdout.startswith(f"--- a/{str(script).lstrip('/')}\n+++ b/")
    lines = proc.stdout.splitlines()
    assert "-    m = torch.ones(3, 4).to(device)" in lines
    assert "+    m = torch.ones(3, 4, device=device)" in lines
    assert "+    model.zero_grad(set_to_none=True)" in lines
    assert sum(line.startswith("+ ") or line.startswith("+    ") for line in lines) == 4
    assert script.read_text() == LOOP
    written = _cli("--fix", "--write", str(script))
    assert (written.returncode, written.stdout) == (0, "Fixed 1 file(s).\n")
    assert script.read_text() == FIXED
    assert (_cli("--fix", str(script)).returncode, _cli("--fix", str(script)).stdout) == (
        0,
        "Nothing to fix.\n",
    )
    alone = _cli("--write", str(script))
    assert alone.returncode == 2 and "--write needs --fix" in alone.stderr


@pytest.mark.parametrize("path", FIXABLE, ids=lambda p: p.name)
def test_fixed_copy_runs_and_prints_the_same(path: Path, tmp_path: Path) -> None:
    """A CPU-runnable corpus script and its fixed copy print identical output (same losses,
    same parameters); the fixed copy parses and its fixable findings are gone."""
    source = path.read_text()
    fixed = lint.fix_source(source)
    assert fixed != source
    before = {(f.line, f.code) for f in lint.check_source(source) if f.code in {"LK004", "LK010"}}
    assert before and not [f for f in lint.check_source(fixed) if f.code in {"LK004", "LK010"}]
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
