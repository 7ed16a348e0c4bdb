"""The installed distribution: its name, license, Python versions, console script and types."""

from __future__ import annotations

import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from helpers import ROOT, deep

DIST = "torch-loopkit"  # "loopkit" on the package index is someone else's package


def test_the_distribution_is_torch_loopkit_with_its_license_and_pythons() -> None:
    """Metadata as built: the free name, the SPDX license with its file, Python 3.10 to 3.13."""
    meta = metadata.metadata(DIST)
    assert meta["Name"] == DIST
    assert meta["License-Expression"] == "Apache-2.0"
    assert meta.get_all("License-File") == ["LICENSE"]
    classifiers = meta.get_all("Classifier") or []
    assert {f"Programming Language :: Python :: 3.{v}" for v in (10, 11, 12, 13)} <= set(
        classifiers
    )
    assert "Typing :: Typed" in classifiers
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text


def test_loopkit_lint_is_a_console_script_equal_to_the_module() -> None:
    """`loopkit-lint FILE` prints what `python -m loopkit.lint FILE` prints, with its status."""
    scripts = metadata.entry_points(group="console_scripts")
    (script,) = [e for e in scripts if e.name == "loopkit-lint"]
    assert script.dist is not None and script.dist.name == DIST
    exe = shutil.which("loopkit-lint", path=str(Path(sys.executable).parent))
    assert exe is not None, "loopkit-lint is not installed next to this python"
    bad = sorted((ROOT / "tests" / "lint" / "corpus" / "bad").glob("*.py"))[0]
    by_script = subprocess.run([exe, str(bad)], capture_output=True, text=True, timeout=60)
    by_module = subprocess.run(
        [sys.executable, "-m", "loopkit.lint", str(bad)], capture_output=True, text=True, timeout=60
    )
    assert by_script.returncode == by_module.returncode == 1
    assert by_script.stdout == by_module.stdout and "LK0" in by_script.stdout


@deep
def test_mypy_sees_loopkits_types_from_outside_the_checkout(tmp_path: Path) -> None:
    """After the README's editable install, mypy run elsewhere finds py.typed and the real
    signature of loopkit.step (not a missing module or Any)."""
    (tmp_path / "use.py").write_text("import loopkit\nreveal_type(loopkit.step)\n")
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "--no-incremental", "use.py"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "optimizer: torch.optim.optimizer.Optimizer" in proc.stdout, proc.stdout
    assert "-> loopkit._step._compose.step" in proc.stdout


def test_every_module_loopkit_imports_is_declared() -> None:
    """Each third-party module loopkit's code imports (accelerate's out-of-memory test and
    typing_extensions included) is a declared dependency; the trackers and tqdm, imported
    only when asked for, are extras."""
    import ast

    declared = {
        r.split(";")[0].split("[")[0].split(">")[0].split("=")[0].split("<")[0].strip().lower()
        for r in metadata.requires(DIST) or []
        if "extra ==" not in r
    }
    assert {"torch", "numpy", "accelerate", "typing-extensions"} <= declared
    found: set[str] = set()
    for path in (ROOT / "loopkit").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                found.add(node.module.split(".")[0])
            elif (isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "import_module"
                  and node.args and isinstance(node.args[0], ast.Constant)):  # fmt: skip
                found.add(str(node.args[0].value).split(".")[0])
    third_party = {m for m in found if m not in sys.stdlib_module_names and m != "loopkit"}
    extras = {"wandb", "mlflow", "tensorboard", "tqdm"}  # the sinks' and progress's extras
    assert {m.replace("_", "-") for m in third_party - extras} <= declared
