"""loopkit.lint's rule registry: each rule declared once, covered by the corpus, run only when
selected, listed in the docs (docs/lint.md); and the linter runs where torch is not installed."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import types
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import ROOT

from loopkit import lint
from loopkit.lint import _registry
from loopkit.lint._declaration import Hit, Rule
from loopkit.lint._registry import REGISTRY
from loopkit.lint._script import Script

CORPUS = ROOT / "tests" / "lint" / "corpus"
KITCHEN_SINK = CORPUS / "bad" / "kitchen_sink_script.py"
THEMES = {"syncs", "memory", "data", "autograd", "accumulation", "parallel"}


def _header_codes(path: Path, marker: str) -> set[str]:
    """The codes after ``marker`` on a corpus file's first line (``# expect:``, ``# clean:``)."""
    first = path.read_text().splitlines()[0]
    return set(re.findall(r"LK\d{3}", first.split(marker, 1)[1])) if marker in first else set()


def test_every_rule_is_declared_once_with_its_texts() -> None:
    """Each rule: a unique LKnnn code, the theme of the module it is declared in, what it flags,
    why it costs and its fix; RULES is the registry's (why, fix), sorted by code."""
    assert list(REGISTRY) == sorted(REGISTRY)
    for code, rule in REGISTRY.items():
        assert rule.code == code and re.fullmatch(r"LK\d{3}", code)
        assert rule.theme in THEMES
        assert rule.check.__module__ == f"loopkit.lint._rules.{rule.theme}"
        assert rule.flags and len(rule.why) > 20 and rule.fix
    assert {rule.theme for rule in REGISTRY.values()} == THEMES
    assert {code: (rule.why, rule.fix) for code, rule in REGISTRY.items()} == lint.RULES


def test_a_code_declared_twice_is_refused() -> None:
    """collect() raises when two different rules share a code (a copy-paste slip)."""
    first = REGISTRY["LK001"]
    twin = dataclasses.replace(REGISTRY["LK002"], code="LK001")
    one = types.ModuleType("one")
    vars(one).update(first=first)
    two = types.ModuleType("two")
    vars(two).update(twin=twin)
    with pytest.raises(ValueError, match="LK001 is declared twice"):
        _registry.collect([one, two])
    assert _registry.collect([one, one]) == {"LK001": first}  # the same rule seen twice: fine


@pytest.mark.parametrize("code", list(REGISTRY))
def test_each_rule_has_a_bad_and_a_good_corpus_case(code: str) -> None:
    """Some bad file expects the code ('# expect:') and some good file is clean of it
    ('# clean:' on its first line, checked clean by test_lint.py)."""
    bad = [p for p in (CORPUS / "bad").glob("*.py") if code in _header_codes(p, "# expect:")]
    good = [p for p in (CORPUS / "good").glob("*.py") if code in _header_codes(p, "# clean:")]
    assert bad and good, f"{code}: bad {bad}, good {good}"


def test_every_good_file_says_what_it_is_clean_of() -> None:
    """Each good file's first line names the rules it shows the right way to write."""
    for path in (CORPUS / "good").glob("*.py"):
        assert _header_codes(path, "# clean:") <= set(REGISTRY), path.name
        assert _header_codes(path, "# clean:"), f"{path.name} has no '# clean:' header"


@pytest.fixture
def invocations(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """Each registered rule's check, wrapped to count its calls by code."""
    counts: Counter[str] = Counter()

    def counting(rule: Rule) -> Rule:
        def check(script: Script) -> Iterator[Hit]:
            counts[rule.code] += 1
            return rule.check(script)

        return dataclasses.replace(rule, check=check)

    for code, rule in list(REGISTRY.items()):
        monkeypatch.setitem(REGISTRY, code, counting(rule))
    return counts


def test_select_runs_only_the_selected_rules(invocations: Counter[str]) -> None:
    """--select filters before the rules run: the others' checks are never called."""
    found = lint.check_paths([KITCHEN_SINK], select=["LK002", "LK006"])
    assert [f.code for f in found] == ["LK006", "LK002"]
    assert invocations == Counter({"LK002": 1, "LK006": 1})

    invocations.clear()
    lint.check_source(KITCHEN_SINK.read_text())
    assert invocations == Counter({code for code, r in REGISTRY.items() if r.default})
    assert "LK011" not in invocations  # off by default: not even run

    invocations.clear()
    lint.check_paths([KITCHEN_SINK], select=list(REGISTRY))
    assert invocations == Counter(set(REGISTRY))


REGISTRY_CODES = list(REGISTRY)


def test_docs_table_comes_from_the_registry() -> None:
    """docs/lint.md holds exactly markdown_table(): one row per rule, in code order."""
    table = lint.markdown_table()
    rows = table.splitlines()[2:]
    assert [row.split(" | ")[0].removeprefix("| ") for row in rows] == list(REGISTRY)
    assert [row.rsplit(" | ", 1)[1] for row in rows].count("off |") == 1  # LK011 is opt-in
    assert rows[REGISTRY_CODES.index("LK011")].endswith("| off |")
    assert table in (ROOT / "docs" / "lint.md").read_text()


def test_importing_the_linter_imports_no_torch() -> None:
    """``import loopkit.lint`` loads neither torch nor loopkit's torch modules."""
    probe = (
        "import sys, loopkit.lint; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in {'torch', 'numpy'} "
        "or (m.startswith('loopkit.') and not m.startswith('loopkit.lint'))))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert (proc.returncode, proc.stdout) == (0, "[]\n"), proc.stderr


def test_lint_runs_in_a_venv_without_torch(tmp_path: Path) -> None:
    """`python -m loopkit.lint` in a fresh venv (no torch, no project site-packages) finds the
    kitchen-sink script's codes."""
    venv = tmp_path / "venv"
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120
    )
    python = venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env["PYTHONPATH"] = str(ROOT)

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(python), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
        )

    no_torch = run("-c", "import torch")
    assert no_torch.returncode != 0 and "No module named 'torch'" in no_torch.stderr
    proc = run("-m", "loopkit.lint", "--format", "json", str(KITCHEN_SINK.relative_to(ROOT)))
    assert proc.returncode == 1, proc.stderr
    assert {row["code"] for row in json.loads(proc.stdout)} == _header_codes(
        KITCHEN_SINK, "# expect:"
    )
