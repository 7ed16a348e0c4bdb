"""The documentation site builds with no warning, and every code block of it runs.

Pages run as the README's blocks did: the capability pages in the site's order, in one
namespace (they share the landing page's set-up), each migration guide in its own.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import types
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import ROOT, deep
from test_api_reference import check_built_page

DOCS = ROOT / "docs"
FENCE = re.compile(r"^```(\w+)\n(.*?)^```", flags=re.M | re.S)
CHAIN = [
    "index.md", "middlewares.md", "doctor.md", "lint.md", "several-models.md", "resuming.md",
    "loop-control.md", "distributed.md", "preload.md", "guarantees.md", "performance.md",
    "development.md",
]  # fmt: skip
ALONE = [
    "migrate/hand-loop.md", "migrate/accelerate.md", "trackers.md", "compile.md", "streaming.md",
]  # fmt: skip
NO_CODE = ["api.md", "stability.md"]
# Recipes run under a simulated cluster by the tests that name them (tests/clusters_recipes.py).
RECIPES = ["clusters.md"]


def _blocks(page: str) -> list[tuple[str, str]]:
    return FENCE.findall((DOCS / page).read_text())


def _nav_pages() -> list[str]:
    text = (ROOT / "mkdocs.yml").read_text()
    return re.findall(r":\s+(\S+\.md)\s*$", text, flags=re.M)


def test_every_page_is_in_the_nav_and_run_here() -> None:
    """No page escapes the checks: each is in mkdocs.yml's nav and in one list above."""
    pages = sorted(str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md"))
    assert pages == sorted(_nav_pages())
    assert pages == sorted(CHAIN + ALONE + NO_CODE + RECIPES)
    assert not any(_blocks(p) for p in NO_CODE)
    assert {lang for p in pages for lang, _ in _blocks(p)} <= {"python", "bash"}


def test_every_cluster_recipe_is_run_by_a_test() -> None:
    """Each section of docs/clusters.md with code blocks is read by a test, by its heading."""
    from clusters_recipes import sections

    tests = "".join(p.read_text() for p in (ROOT / "tests").rglob("test_*.py"))
    for heading, text in sections().items():
        if FENCE.search(text):
            assert f'recipe("{heading}")' in tests, f"no test runs the recipe {heading!r}"


def test_the_site_builds_with_no_warning(tmp_path: Path) -> None:
    """mkdocs build --strict (warnings are errors): links, nav and the API reference, whose
    page shows every signature whole and no internals."""
    pytest.importorskip("mkdocs", reason="the docs extra is not installed")
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env=dict(os.environ, NO_MKDOCS_2_WARNING="1"),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    for name in ("loopkit.step", "loopkit.Checkpointer", "loopkit.distributed.loader"):
        assert f'id="{name}"' in api, name
    check_built_page(api)  # every signature whole, no internals shown


def _namespace() -> dict[str, object]:
    """A fresh module ``__docs__``'s globals, registered (torch.compile imports a function's
    module by name to read its globals)."""
    module = types.ModuleType("__docs__")
    sys.modules["__docs__"] = module
    return vars(module)


def _run_python(pages: list[str], namespace: dict[str, object]) -> None:
    for page in pages:
        for i, (lang, body) in enumerate(_blocks(page)):
            if lang == "python":
                exec(compile(body, f"docs/{page} block {i}", "exec"), namespace)


def test_python_blocks_run_twice_alike(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The pages' python blocks run in order, twice in the same folder: a second run does
    what the first did. No resume finds the first run's checkpoint (a block that resumed it
    would end at the same weights, having trained nothing): a resume finds nothing or, where
    a block stops a run and launches it again, the checkpoint this run wrote. The weights of
    both runs are equal."""
    import loopkit

    resumed: list[str] = []  # "none", or "this run" (a checkpoint written since it started)
    real_resume = loopkit.Checkpointer.resume
    started = [0]

    def spy(self: loopkit.Checkpointer, path: Any = None, **kwargs: Any) -> Any:
        found = real_resume(self, path, **kwargs)
        if found is None:
            resumed.append("none")
        else:
            new = Path(found).stat().st_mtime_ns >= started[0]
            resumed.append("this run" if new else f"an earlier run's {found}")
        return found

    monkeypatch.setattr(loopkit.Checkpointer, "resume", spy)
    runs = []
    for _ in range(2):
        started[0] = time.time_ns()
        monkeypatch.chdir(tmp_path)
        chain = _namespace()
        _run_python(CHAIN, chain)
        for page in ALONE:
            _run_python([page], _namespace())
        net = chain["net"]
        assert isinstance(net, torch.nn.Module)
        runs.append([p.detach().clone() for p in net.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))
    # In each run: five blocks of the chain resume and find nothing; streaming.md launches
    # its runs 20 times, 7 of them relaunches that resume the checkpoint written before.
    assert sorted(resumed) == sorted(["none"] * 2 * (5 + 13) + ["this run"] * 2 * 7)


def _benchmarks_only(script: str) -> bool:
    """Whether every command of ``script`` is a ``python benchmarks/<x>.py --quick ...``."""
    lines = [ln.split("#")[0].strip() for ln in script.splitlines()]
    return all(re.fullmatch(r"python benchmarks/\w+\.py --quick.*", ln) for ln in lines if ln)


def test_the_benchmark_commands_of_the_docs_are_run_by_the_benchmark_tests() -> None:
    """Each ``python benchmarks/x.py --quick <flags>`` line of the docs is run, with those
    flags, by tests/test_benchmarks.py (so the docs' shell test need not run it again)."""
    tested = (ROOT / "tests" / "test_benchmarks.py").read_text()
    blocks = [b for p in CHAIN + ALONE for lang, b in _blocks(p) if lang == "bash"]
    found = 0
    for block in filter(_benchmarks_only, blocks):
        for line in block.splitlines():
            words = line.split("#")[0].split()[1:]
            if not words:
                continue
            found += 1
            call = ", ".join(f'"{w}"' for w in words)
            assert call in tested, f"{line.strip()} is not run by tests/test_benchmarks.py"
    assert found >= 4


@deep
def test_shell_blocks_rerun_over_their_own_output_and_leave_the_repository_clean() -> None:
    """The bash blocks (multi-process launches) run from the repository root as a second run
    would, over the files a first run left (stale ones here): each file is written anew and
    every launch ends at the single-process weights; git status is unchanged. (Running them
    twice would show the same at twice the cost: a minute of CI.)"""
    scripts = [b for p in CHAIN + ALONE for lang, b in _blocks(p) if lang == "bash"]
    scripts = [s for s in scripts if not s.startswith("python -m venv")]
    # The benchmarks' quick runs are run by tests/test_benchmarks.py (with --json): not twice.
    scripts = [s for s in scripts if not _benchmarks_only(s)]
    assert scripts
    env = dict(
        os.environ,
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        OMP_NUM_THREADS="1",
    )
    status = ["git", "status", "--porcelain", "--untracked-files=all"]
    before = subprocess.run(status, cwd=ROOT, capture_output=True, text=True).stdout
    out_dir = ROOT / "runs" / "ddp"
    out_dir.mkdir(parents=True, exist_ok=True)
    names = ("single", "ddp", "accelerate", "nodes")
    for name in names:  # what an earlier run left, made stale: each must be rewritten
        torch.save({"stale": torch.zeros(1)}, out_dir / f"{name}.pt")
    for script in scripts:
        proc = subprocess.run(["bash", "-e", "-c", script], cwd=ROOT, capture_output=True,
                              text=True, timeout=600, env=env)  # fmt: skip
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    out = {n: torch.load(out_dir / f"{n}.pt", weights_only=True) for n in names}
    for name, weights in out.items():
        assert "stale" not in weights, name
        diff = max((weights[k] - out["single"][k]).abs().max().item() for k in weights)
        assert diff < 1e-6, name
    assert subprocess.run(status, cwd=ROOT, capture_output=True, text=True).stdout == before


def test_the_api_reference_lists_every_public_name() -> None:
    """Each name of loopkit.__all__ has its `::: loopkit.<name>` entry in docs/api.md."""
    import loopkit

    listed = set(re.findall(r"^::: loopkit\.(\w+)$", (DOCS / "api.md").read_text(), flags=re.M))
    assert {n for n in loopkit.__all__ if n != "__version__"} <= listed
