"""loopkit.lint --explain: one rule's claim, when its cost is real and when not, and its fix;
the same texts, from one place, are docs/lint.md's section on when a cost is real."""

from __future__ import annotations

import subprocess
import sys

import pytest
from helpers import ROOT

from loopkit.lint import main
from loopkit.lint._explain import END, EXPLANATIONS, START, explain, markdown, with_explanations
from loopkit.lint._registry import REGISTRY

DOCS = ROOT / "docs" / "lint.md"


def _flat(text: str) -> str:
    return " ".join(text.split())


def test_every_rule_has_exactly_one_explanation() -> None:
    """EXPLANATIONS covers every code of the registry, none missing, none extra, none empty."""
    assert list(EXPLANATIONS) == list(REGISTRY)
    assert all(e.real.strip() and e.not_real.strip() for e in EXPLANATIONS.values())


def test_explain_prints_the_rules_texts(capsys: pytest.CaptureFixture[str]) -> None:
    """`--explain lk002` (any case) exits 0 with the claim, when real, when not, and the fix."""
    assert main(["--explain", "lk002"]) == 0
    out = capsys.readouterr().out
    rule, more = REGISTRY["LK002"], EXPLANATIONS["LK002"]
    assert out.splitlines()[0] == "LK002 (syncs): on by default"
    assert f"\nFix\n    {rule.fix}\n" in out  # whole, on one line, to be copied
    for title in ("Flags", "Why it costs", "When the cost is real", "When it is not"):
        assert f"\n{title}\n" in out
    flat = _flat(out)
    for text in (rule.flags, rule.why, more.real, more.not_real):
        assert _flat(text) in flat
    assert "up to 6 calls deep" in flat and "on a CPU a read waits for nothing" in flat
    assert max(len(line) for line in out.splitlines() if line != "    " + rule.fix) <= 88


def test_explain_says_how_to_turn_on_an_off_by_default_rule() -> None:
    """An off-by-default rule's heading names --select CODE; an on-by-default one does not."""
    assert explain("LK011").splitlines()[0] == (
        "LK011 (data): off by default; run it with --select LK011 (or --all)"
    )
    assert "--select" not in explain("LK001").splitlines()[0]
    assert "Off by default: run it with `--select LK011`" in markdown()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--explain", "LK999"], "unknown code for --explain: LK999; known: LK001, LK002"),
        (["--explain", "LK002", "train.py"], "it takes no PATH"),
        (["--explain", "LK002", "--fix"], "it takes no --fix"),
        (["--explain", "LK002", "--select", "LK001"], "it takes no --select"),
        (["--explain", "LK002", "--all", "--format", "json"], "it takes no --all, --format json"),
        ([], "the following arguments are required: PATH"),
    ],
    ids=["unknown-code", "with-path", "with-fix", "with-select", "with-all-json", "nothing"],
)
def test_explain_usage_errors_exit_2(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """An unknown code, --explain with paths or other options, or neither: exit 2, no output."""
    with pytest.raises(SystemExit) as exit_:
        main(args)
    out, err = capsys.readouterr()
    assert (exit_.value.code, out) == (2, "")
    assert message in err and "--explain CODE" in err  # the usage names both forms


def test_docs_hold_exactly_the_generated_section() -> None:
    """docs/lint.md's explain section is markdown(), byte for byte: regenerate it with
    `python -c "from loopkit.lint._explain import write_docs; write_docs()"`."""
    page = DOCS.read_text()
    assert page.count(START) == page.count(END) == 1
    assert with_explanations(page) == page
    section = page.split(START)[1].split(END)[0]
    assert [line for line in section.splitlines() if line.startswith("### ")] == [
        f"### {code} ({rule.theme})" for code, rule in REGISTRY.items()
    ]
    for code, more in EXPLANATIONS.items():
        assert f"**When the cost is real:** {more.real}" in section, code
        assert f"**Fix:** {REGISTRY[code].fix}" in section, code


def test_with_explanations_refuses_a_page_without_markers() -> None:
    """A page that lost its markers is an error, not a page silently left as it was."""
    with pytest.raises(ValueError, match="markers"):
        with_explanations("# lint\n\nno markers here\n")


def test_the_installed_command_explains() -> None:
    """`python -m loopkit.lint --explain LK017` runs as a process: exit 0, the rule's fix."""
    proc = subprocess.run(
        [sys.executable, "-m", "loopkit.lint", "--explain", "LK017"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (proc.returncode, proc.stderr) == (0, "")
    assert REGISTRY["LK017"].fix in proc.stdout and "When it is not" in proc.stdout
