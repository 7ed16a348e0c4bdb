"""loopkit.lint reasons about the whole program: a helper module runs on the device of the
script that imports it (whatever its own text names); the program's own modules a named file
imports are found on disk and checked with it; --single-file says what it did not see."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from loopkit import lint
from loopkit.lint._check import parse
from loopkit.lint._imports import local_imports
from loopkit.lint._script import whole_program

TRAIN = """\
import torch

from {module} import evaluate, record

model = torch.nn.Linear(4, 1){device}
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for epoch in range(10):
    for x, y in loader:
        loss = torch.nn.functional.mse_loss(model(x{move}), y{move})
        loss.backward()
        opt.step()
        opt.zero_grad()
        record(loss)
    print(evaluate(model, val_loader))
"""

# No word of a device in it: where it runs is the importing script's business.
HELPERS = """\
import torch

history = []


def record(loss):
    history.append(loss.item())


@torch.no_grad()
def evaluate(model, loader):
    total = 0.0
    for x, y in loader:
        total += torch.nn.functional.mse_loss(model(x), y).item()
    return total
"""


def _program(tmp_path: Path, *, cuda: bool, module: str = "helpers") -> Path:
    device, move = (".cuda()", ".cuda()") if cuda else ("", "")
    (tmp_path / "train.py").write_text(TRAIN.format(module=module, device=device, move=move))
    target = tmp_path.joinpath(*module.split(".")).with_suffix(".py")
    target.parent.mkdir(parents=True, exist_ok=True)
    for folder in target.parent.relative_to(tmp_path).parents[:-1]:
        (tmp_path / folder / "__init__.py").touch()
    if target.parent != tmp_path:
        (target.parent / "__init__.py").touch()
    target.write_text(HELPERS)
    return target


def _codes(findings: list[lint.Finding]) -> list[tuple[str, int, str]]:
    return sorted((Path(f.path).name, f.line, f.code) for f in findings)


EXPECTED = [("helpers.py", 7, "LK002"), ("helpers.py", 14, "LK014")]


def test_a_helper_that_names_no_device_runs_on_the_importing_scripts(tmp_path: Path) -> None:
    """The folder checked: the per-step read (LK002, with its chain) and the per-batch
    evaluation read (LK014) in a helper that never names CUDA are both found."""
    _program(tmp_path, cuda=True)
    findings = lint.check_paths([tmp_path])
    assert _codes(findings) == EXPECTED
    lk002 = next(f for f in findings if f.code == "LK002")
    assert "reached from" in lk002.message and "train.py:13" in lk002.message


def test_the_same_helper_under_a_cpu_script_is_quiet(tmp_path: Path) -> None:
    """A script that never runs on a device: reading its CPU tensors waits for nothing."""
    _program(tmp_path, cuda=False)
    assert lint.check_paths([tmp_path]) == []


def test_naming_the_script_alone_checks_the_modules_it_imports(tmp_path: Path) -> None:
    """``loopkit-lint train.py``: helpers.py is found on disk and checked with it."""
    _program(tmp_path, cuda=True)
    assert _codes(lint.check_paths([tmp_path / "train.py"])) == EXPECTED


@pytest.mark.parametrize("module", ["pkg.helpers", "pkg.sub.helpers"])
def test_modules_inside_packages_are_found(tmp_path: Path, module: str) -> None:
    """``from pkg.sub.helpers import f`` resolves to pkg/sub/helpers.py next to the script."""
    _program(tmp_path, cuda=True, module=module)
    assert _codes(lint.check_paths([tmp_path / "train.py"])) == EXPECTED


def test_single_file_mode_checks_only_the_file_and_names_what_it_did_not_see(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--single-file: no finding in helpers.py, and stderr names the import left unseen;
    the API hands the same list to on_unseen."""
    helper = _program(tmp_path, cuda=True)
    assert lint.main(["--single-file", str(tmp_path / "train.py")]) == 0
    out = capsys.readouterr()
    assert "No problems found." in out.out
    assert f"imports {helper}, not checked with it (single-file mode)" in out.err
    unseen: list[tuple[str, list[str]]] = []
    found = lint.check_paths(
        [tmp_path / "train.py"],
        follow_imports=False,
        on_unseen=lambda path, modules: unseen.append((path, modules)),
    )
    assert found == [] and unseen == [(str(tmp_path / "train.py"), [str(helper)])]


def test_library_imports_are_not_files_of_the_program(tmp_path: Path) -> None:
    """torch, numpy and other installed modules are never followed: only files on disk
    beside the script (or in its packages) are, a relative import from its package too."""
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").touch()
    (tmp_path / "pkg" / "util.py").write_text("x = 1\n")
    script = tmp_path / "pkg" / "train.py"
    script.write_text("import os\nimport torch\nimport numpy as np\nfrom . import util\n")
    parsed = parse(script.read_text(), str(script))
    package = tmp_path / "pkg"
    assert set(local_imports(parsed)) == {package / "__init__.py", package / "util.py"}
    assert local_imports(parse("import torch\n", "<string>")) == []


def test_device_is_decided_by_the_program_not_the_file() -> None:
    """Program.on_device: a file naming CUDA, what it imports (at any depth), and nothing else."""
    sources = {
        "/p/train.py": "import torch\nimport mid\nx = torch.zeros(1).cuda()\n",
        "/p/mid.py": "import leaf\n",
        "/p/leaf.py": "def f(t):\n    return t.item()\n",
        "/p/tool.py": "import leaf\n",  # a CPU tool importing the same leaf: it stays off
    }
    scripts = [parse(text, path) for path, text in sources.items()]
    program = whole_program(scripts)
    on = {Path(s.path).name for s in scripts if program.on_device(s)}
    assert on == {"train.py", "mid.py", "leaf.py"}
    assert [Path(p.path).name for p in program.imports_of(scripts[0])] == ["mid.py"]
    assert isinstance(scripts[2].tree, ast.Module) and scripts[2].uses_accelerator


def test_a_script_inside_installed_packages_pulls_none_of_them_in(tmp_path: Path) -> None:
    """A file in site-packages whose imports name other installed packages (a torch/ beside
    it): none is followed (a one-file check stays one file, not hundreds)."""
    site = tmp_path / "lib" / "site-packages"
    for package in ("torch", "pkg"):
        (site / package).mkdir(parents=True)
        (site / package / "__init__.py").write_text("x = 1\n")
    (site / "pkg" / "util.py").write_text("y = 2\n")
    script = site / "pkg" / "train.py"
    script.write_text("import torch\nfrom . import util\n")
    assert local_imports(parse(script.read_text(), str(script))) == []
    # The same layout outside site-packages is the program's own code: followed.
    project = tmp_path / "project"
    (project / "pkg").mkdir(parents=True)
    (project / "torch").mkdir()
    (project / "torch" / "__init__.py").write_text("x = 1\n")
    (project / "pkg" / "__init__.py").write_text("")
    mine = project / "pkg" / "train.py"
    mine.write_text("import torch\n")
    assert local_imports(parse(mine.read_text(), str(mine))) == [project / "torch" / "__init__.py"]
