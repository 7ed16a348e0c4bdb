"""loopkit.lint: every bad snippet gives exactly its codes on its lines, good ones give none."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT

from loopkit import lint
from loopkit.lint._registry import REGISTRY

CORPUS = ROOT / "tests" / "lint" / "corpus"
BAD = sorted((CORPUS / "bad").glob("*.py"))
GOOD = sorted((CORPUS / "good").glob("*.py"))
PY2 = CORPUS / "unparsable" / "py2_script.py"
CODES = re.compile(r"LK\d{3}")
EVERY_RULE = list(REGISTRY)
OFF_BY_DEFAULT = {code for code, rule in REGISTRY.items() if not rule.default}


def _expected_codes(path: Path) -> set[str]:
    """The codes in a bad file's first line, ``# expect: LK001, LK002``."""
    first = path.read_text().splitlines()[0]
    assert first.startswith("# expect:"), f"{path.name} has no '# expect:' header"
    return set(CODES.findall(first))


def _expected_lines(path: Path) -> set[tuple[str, int]]:
    """(code, line) for every ``# <- LK00N`` marker: the line each finding must be on."""
    marks: set[tuple[str, int]] = set()
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if "# <- " in line:
            marks.update((code, number) for code in CODES.findall(line.split("# <- ", 1)[1]))
    return marks


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "loopkit.lint", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def test_corpus_covers_every_rule() -> None:
    """At least 14 bad and 8 good snippets, and every rule is expected by some bad file."""
    assert len(BAD) >= 14 and len(GOOD) >= 8
    expected = set().union(*(_expected_codes(p) for p in BAD))
    assert expected == set(lint.RULES) == {f"LK{i:03d}" for i in range(1, 22)}


@pytest.mark.parametrize("path", BAD, ids=lambda p: p.name)
def test_bad_file_gives_exactly_its_codes(path: Path) -> None:
    """With every rule, the codes found equal the '# expect:' header, each on its '# <- LK00N'
    line; by default, the same less the rules that are off by default."""
    findings = lint.check_paths([path], select=EVERY_RULE)
    assert {f.code for f in findings} == _expected_codes(path)
    assert {(f.code, f.line) for f in findings} == _expected_lines(path)
    assert all(f.path == str(path) and f.col >= 1 for f in findings)
    by_default = lint.check_paths([path])
    assert by_default == [f for f in findings if f.code not in OFF_BY_DEFAULT]


@pytest.mark.parametrize("path", GOOD, ids=lambda p: p.name)
def test_good_file_is_clean(path: Path) -> None:
    """Correct loops (logging every N, inference_mode, seeded workers, loopkit) give nothing,
    with every rule on."""
    assert lint.check_paths([path]) == []
    assert lint.check_paths([path], select=EVERY_RULE) == []


def test_examples_lint_clean() -> None:
    """`python -m loopkit.lint examples/` exits 0 and reports nothing."""
    proc = _cli("examples/")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout == "No problems found.\n"
    assert proc.stderr == ""


def test_text_output_and_exit_status_1() -> None:
    """Findings print as path:line:col: CODE why Fix: fix, then a summary; the exit status is 1."""
    path = CORPUS / "bad" / "lk009_ragged_window.py"
    proc = _cli(_rel(path))
    assert proc.returncode == 1, proc.stderr
    finding, summary = proc.stdout.splitlines()
    why, fix = lint.RULES["LK009"]
    assert finding.startswith(f"{_rel(path)}:16:13: LK009 ")
    assert why in finding and finding.endswith(f"Fix: {fix}")
    assert summary == "Found 1 problem(s) in 1 file(s)."


def test_clean_input_exits_0() -> None:
    """A folder of good snippets exits 0."""
    proc = _cli(_rel(CORPUS / "good"))
    assert (proc.returncode, proc.stdout) == (0, "No problems found.\n")


@pytest.mark.parametrize(
    "args",
    [
        (),
        ("no/such/dir",),
        ("--select", "LK999", "examples/"),
        ("--select", "LK001,nope", "examples/"),
        ("--format", "xml", "examples/"),
    ],
    ids=["no-paths", "missing-path", "unknown-code", "one-unknown-code", "bad-format"],
)
def test_usage_errors_exit_2(args: tuple[str, ...]) -> None:
    """No paths, a missing path, an unknown --select code or format: exit status 2, no output."""
    proc = _cli(*args)
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert "usage:" in proc.stderr


def test_json_output() -> None:
    """--format json is a list of objects with path, line, col, code, message and fix."""
    path = CORPUS / "bad" / "kitchen_sink_script.py"
    proc = _cli("--format", "json", _rel(path))
    assert proc.returncode == 1
    rows = json.loads(proc.stdout)
    assert [(r["code"], r["line"]) for r in rows] == [
        ("LK007", 11),  # the training loader: no pin_memory (the test loader is read once)
        ("LK006", 14),
        ("LK002", 28),
        ("LK001", 32),  # no LK008 at 37: one test pass after training records its graphs once
    ]
    for row in rows:
        assert set(row) == {"path", "line", "col", "code", "message", "fix"}
        assert row["path"] == _rel(path) and row["fix"] == lint.RULES[row["code"]][1]
    assert json.loads(_cli("--format", "json", "examples/").stdout) == []


def test_select_keeps_only_those_codes() -> None:
    """--select LK002,LK006 reports only those; selecting an absent code exits 0."""
    path = _rel(CORPUS / "bad" / "kitchen_sink_script.py")
    proc = _cli("--select", "LK002,lk006", "--format", "json", path)
    assert proc.returncode == 1
    assert [(r["code"], r["line"]) for r in json.loads(proc.stdout)] == [
        ("LK006", 14),
        ("LK002", 28),
    ]
    assert _cli("--select", "LK003", path).returncode == 0
    assert [f.code for f in lint.check_paths([path], select=["LK001"])] == ["LK001"]


def test_lk011_is_opt_in() -> None:
    """LK011 (reproducibility, not speed) runs only when selected: --select LK011 or --all."""
    path = CORPUS / "bad" / "lk011_unseeded_workers.py"
    assert [(f.code, f.line) for f in lint.check_paths([path])] == [("LK007", 22)]
    assert [(f.code, f.line) for f in lint.check_paths([path], select=["LK011"])] == [
        ("LK011", 22),
        ("LK011", 23),
    ]
    selected = _cli("--select", "lk011", "--format", "json", _rel(path))
    assert [r["code"] for r in json.loads(selected.stdout)] == ["LK011", "LK011"]
    every = _cli("--all", "--format", "json", _rel(path))
    assert [r["code"] for r in json.loads(every.stdout)] == ["LK007", "LK011", "LK011"]
    both = _cli("--all", "--select", "LK011", _rel(path))
    assert (both.returncode, both.stdout) == (2, "")
    assert "not allowed with" in both.stderr


def test_silencing_comments() -> None:
    """`# loopkit: ignore` silences a line; `ignore[CODES]` only those codes."""
    path = CORPUS / "good" / "silenced.py"
    source = path.read_text()
    assert lint.check_source(source) == []
    bare = re.sub(r"\s*# loopkit: ignore.*", "", source)
    assert [(f.code, f.line) for f in lint.check_source(bare)] == [
        ("LK002", 14),
        ("LK001", 15),
        ("LK003", 16),
    ]
    # Naming another code leaves the line's own finding in place.
    narrow = source.replace("ignore[LK001]", "ignore[LK002]")
    assert [(f.code, f.line) for f in lint.check_source(narrow)] == [("LK001", 15)]


def test_unparsable_file_is_skipped() -> None:
    """A Python 2 script is reported on stderr and skipped; the other files are still checked."""
    bad = CORPUS / "bad" / "lk003_empty_cache.py"
    proc = _cli(_rel(PY2), _rel(bad))
    assert proc.returncode == 1
    assert proc.stderr.startswith(f"{_rel(PY2)}: skipped, cannot parse: ")
    assert "LK003" in proc.stdout and "py2_script" not in proc.stdout
    alone = _cli(_rel(PY2.parent))
    assert (alone.returncode, alone.stdout) == (0, "No problems found.\n")
    assert "skipped, cannot parse" in alone.stderr
    with pytest.raises(SyntaxError):
        lint.check_source(PY2.read_text())


def test_scripts_are_read_never_run(tmp_path: Path) -> None:
    """Checking a script does not import or execute it: its side effect never happens."""
    marker = tmp_path / "ran"
    script = tmp_path / "train.py"
    script.write_text(
        f"open({str(marker)!r}, 'w').close()\n"
        "raise SystemExit(3)\n"
        "for x in data:\n"
        "    torch.cuda.empty_cache()\n"
    )
    findings = lint.check_paths([tmp_path])
    assert [(f.code, f.line) for f in findings] == [("LK003", 4)]
    assert not marker.exists()


def test_folders_recurse_and_skip_hidden(tmp_path: Path) -> None:
    """A folder is searched for *.py recursively; hidden folders and __pycache__ are not."""
    snippet = "for x in data:\n    torch.cuda.empty_cache()\n"
    for rel in ("a.py", "sub/deep/b.py", ".venv/c.py", "__pycache__/d.py", "notes.txt"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(snippet)
    found = {Path(f.path).relative_to(tmp_path).as_posix() for f in lint.check_paths([tmp_path])}
    assert found == {"a.py", "sub/deep/b.py"}


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        # .item() in the else branch of a `% N` test still runs on most steps.
        (
            "for i, b in enumerate(dl):\n"
            "    loss = f(b.cuda())\n"
            "    loss.backward()\n"
            "    if i % 10 == 0:\n"
            "        print(loss.item())\n"
            "    else:\n"
            "        last = loss.item()\n",
            [("LK002", 7)],
        ),
        # A batch straight from the loader lives in host memory: .tolist() is no device sync.
        ("for x, y in dl:\n    ids = y.tolist()\n    f(x).backward()\n", []),
        # The same name, moved to the device first, is a sync.
        ("for x, y in dl:\n    y = y.cuda()\n    f(x).backward()\n    n = y.tolist()\n", None),
        # .to(dtype) is a conversion, not a transfer; .to(device) after a factory is one.
        ("for b in dl:\n    m = torch.ones(3).to(torch.float16)\n", []),
        (
            "for b in dl:\n"
            "    m = torch.ones(3).to(dev, non_blocking=True)\n"
            "    f(b, m).backward()\n",
            [("LK004", 2)],
        ),
        # **kwargs hides the loader settings: no guess.
        ("dl = DataLoader(ds, **loader_kwargs)\ntorch.cuda.init()\n", []),
        # Positional num_workers=4 and pin_memory=True, no seeding, a script that resumes:
        # only LK011 (opt-in).
        (
            "dl = DataLoader(ds, 8, True, None, None, 4, None, True)\nx = 'cuda'\n"
            "start = load(args.resume)\n",
            [("LK011", 1)],
        ),
        # pin_memory is only asked for when the script targets CUDA.
        ("dl = DataLoader(ds, batch_size=8)\n", [("LK007", 1)]),
        # Steps on `% K` for a different K than the divisor: not an accumulation window.
        (
            "for i, b in enumerate(dl):\n"
            "    (f(b) / 4).backward()\n"
            "    if i % 8 == 0:\n"
            "        opt.step()\n"
            "        opt.zero_grad()\n",
            [],
        ),
    ],
    ids=[
        "item-in-else",
        "loader-batch-tolist",
        "moved-batch-tolist",
        "to-dtype",
        "to-device",
        "kwargs-loader",
        "positional-loader",
        "cpu-only-loader",
        "other-modulus",
    ],
)
def test_heuristic_edges(source: str, expected: list[tuple[str, int]] | None) -> None:
    """Edge cases of the heuristics give exactly these findings with every rule on (None: LK002
    on the last line); by default, the same less LK011."""
    if expected is None:
        expected = [("LK002", source.count("\n"))]
    every = lint.check_source(source, select=EVERY_RULE)
    assert [(f.code, f.line) for f in every] == expected
    assert lint.check_source(source) == [f for f in every if f.code not in OFF_BY_DEFAULT]


def test_api_types() -> None:
    """RULES maps each code to (why, fix); Finding is frozen and formats as the CLI prints it."""
    assert all(len(why) > 20 and fix for why, fix in lint.RULES.values())
    (finding,) = lint.check_source("for b in dl:\n    torch.cuda.empty_cache()\n", "t.py")
    assert (finding.path, finding.line, finding.col, finding.code) == ("t.py", 2, 5, "LK003")
    assert finding.fix == lint.RULES["LK003"][1]
    assert finding.format().startswith("t.py:2:5: LK003 `torch.cuda.empty_cache()` inside a loop")
    with pytest.raises(dataclasses.FrozenInstanceError):
        finding.line = 3  # type: ignore[misc]  # frozen: mypy rejects what must raise here
