"""Every code block in the README runs, and its commands are the ones CI runs."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT

README = (ROOT / "README.md").read_text()
CI = (ROOT / ".ci" / "run").read_text()
BLOCKS = re.findall(r"^```(\w+)\n(.*?)^```", README, flags=re.M | re.S)
SETUP = "python -m venv .venv && . .venv/bin/activate && pip install --no-compile torch==2.13.0 -e "
# A path entry, not setuptools' default import hook: mypy (and other tools) then find
# loopkit's sources and its py.typed after an editable install.
EDITABLE = "--config-settings editable_mode=compat"


def _setup_commands() -> list[str]:
    """The one-line set-up commands near the top (they create a venv and install)."""
    return [
        line
        for lang, body in BLOCKS
        if lang == "bash"
        for line in body.splitlines()
        if line.startswith("python -m venv")
    ]


def _scripts() -> list[str]:
    """Every other bash block: run as it is."""
    return [
        body for lang, body in BLOCKS if lang == "bash" if not body.startswith("python -m venv")
    ]


def test_only_known_block_languages() -> None:
    """Blocks are python or bash, so none escapes the checks below."""
    assert BLOCKS, "no code blocks found"
    assert {lang for lang, _ in BLOCKS} <= {"python", "bash"}


def test_python_blocks_run_in_order(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """All python blocks, executed top to bottom in one namespace, run without error."""
    monkeypatch.chdir(tmp_path)  # what they write (checkpoints) lands in a fresh folder
    namespace: dict[str, object] = {"__name__": "__readme__"}
    for i, (lang, body) in enumerate(BLOCKS):
        if lang == "python":
            exec(compile(body, f"README.md block {i}", "exec"), namespace)


def test_test_command_is_what_ci_runs() -> None:
    """The README's test command appears verbatim in .ci/run."""
    tests = [c for c in _setup_commands() if c.endswith("python -m pytest -q")]
    assert len(tests) == 1
    assert tests[0] in CI.splitlines()


def test_example_command_runs() -> None:
    """The example command: CI proves its set-up (a superset install); its run is done here."""
    runs = [c for c in _setup_commands() if not c.endswith("python -m pytest -q")]
    assert runs, "no example command in the README"
    for cmd in runs:
        assert cmd.startswith(SETUP + ". " + EDITABLE + " && "), cmd
        assert SETUP + '".[dev]" ' + EDITABLE in CI  # the same set-up, with the dev extra on top
        run = shlex.split(cmd[len(SETUP + ". " + EDITABLE + " && ") :])
        assert run[0] == "python"
        proc = subprocess.run(
            [sys.executable, *run[1:]], cwd=ROOT, capture_output=True, text=True, timeout=300
        )
        assert proc.returncode == 0, proc.stderr
        # It trains: the loss falls clearly (tests/test_examples.py's fp32 check, done here
        # on the README's own run rather than on a second one).
        m = re.search(r"loss went from ([\d.]+) to ([\d.]+)", proc.stdout)
        assert m, proc.stdout
        assert float(m.group(2)) < 0.85 * float(m.group(1)), proc.stdout


def test_the_readme_is_the_landing_page_of_the_site() -> None:
    """The README's blocks are those of docs/index.md: the site's landing, kept executable."""
    index = (ROOT / "docs" / "index.md").read_text()
    assert re.findall(r"^```(\w+)\n(.*?)^```", index, flags=re.M | re.S) == BLOCKS
