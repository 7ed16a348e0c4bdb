"""The release check CI runs (.ci/release_check) and its metadata validator (.ci/check_dist.py)."""

from __future__ import annotations

import importlib.util
import io
import tarfile
import zipfile
from pathlib import Path
from types import ModuleType

import pytest
from helpers import ROOT

CI = (ROOT / ".ci" / "run").read_text()
README_TEST = (
    'pip install --no-compile torch==2.13.0 -e ".[dev]" --config-settings editable_mode=compat'
)


def _check_dist() -> ModuleType:
    spec = importlib.util.spec_from_file_location("check_dist", ROOT / ".ci" / "check_dist.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_ci_runs_the_release_check_after_the_tests_in_the_dev_venv() -> None:
    """.ci/run runs .ci/release_check on its own line after the README's test command, so
    the dev venv (build, twine) is active and a failing test stops CI before it."""
    lines = [ln.strip() for ln in CI.splitlines()]
    tests = [i for i, ln in enumerate(lines) if README_TEST in ln and ln.endswith("pytest -q")]
    checks = [i for i, ln in enumerate(lines) if ln == "bash .ci/release_check"]
    assert len(tests) == 1 and len(checks) == 1 and checks[0] > tests[0]
    assert "set -euo pipefail" in CI
    assert (ROOT / ".ci" / "release_check").stat().st_mode & 0o111


GOOD = {
    "Metadata-Version": "2.4",
    "Name": "torch-loopkit",
    "Version": "9.8.7",
    "Requires-Python": ">=3.10",
    "License-Expression": "Apache-2.0",
    "License-File": "LICENSE",
    "Description-Content-Type": "text/markdown",
    "Requires-Dist": [
        "torch<3,>=2.6",
        "numpy>=1.24",
        "accelerate>=1.0",
        "typing-extensions>=4.6",
        'pytest>=8; extra == "dev"',
    ],
    "Provides-Extra": ["dev", "docs"],
}
README = "# loopkit\n\nKeep your own loop.\n"


def _metadata(fields: dict[str, object]) -> str:
    lines = []
    for key, value in fields.items():
        for item in value if isinstance(value, list) else [value]:
            lines.append(f"{key}: {item}")
    return "\n".join(lines) + "\n\n" + README


def _release(tmp: Path, fields: dict[str, object], wheel_files: list[str]) -> Path:
    """A source root at version 9.8.7 and a dist/ with a wheel and an sdist built from
    ``fields`` (the METADATA) holding ``wheel_files`` besides the dist-info."""
    (tmp / "loopkit").mkdir()
    (tmp / "loopkit" / "__init__.py").write_text('"""x."""\n\n__version__ = "9.8.7"\n')
    (tmp / "README.md").write_text(README)
    dist = tmp / "dist"
    dist.mkdir()
    info = "torch_loopkit-9.8.7.dist-info"
    with zipfile.ZipFile(dist / "torch_loopkit-9.8.7-py3-none-any.whl", "w") as whl:
        for name in wheel_files:
            whl.writestr(name, "")
        whl.writestr(f"{info}/METADATA", _metadata(fields))
        whl.writestr(
            f"{info}/entry_points.txt",
            "[console_scripts]\nloopkit-lint = loopkit.lint._cli:main\n",
        )
    with tarfile.open(dist / "torch_loopkit-9.8.7.tar.gz", "w:gz") as tar:
        sdist = {"PKG-INFO": _metadata(fields), "pyproject.toml": "", "README.md": README}
        sdist |= {"LICENSE": "", "loopkit/py.typed": ""}
        for name, text in sdist.items():
            data = text.encode()
            member = tarfile.TarInfo(f"torch_loopkit-9.8.7/{name}")
            member.size = len(data)
            tar.addfile(member, io.BytesIO(data))
    return dist


PACKAGE = ["loopkit/__init__.py", "loopkit/py.typed", "loopkit/lint/__init__.py"]


def test_check_dist_passes_a_complete_release(tmp_path: Path) -> None:
    """A release whose metadata says what pyproject.toml declares has no problem."""
    dist = _release(tmp_path, GOOD, PACKAGE)
    assert _check_dist().check(dist, root=tmp_path) == ("9.8.7", [])


@pytest.mark.parametrize(
    ("change", "files", "found"),
    [
        ({"Requires-Dist": GOOD["Requires-Dist"][1:]}, PACKAGE, "runtime Requires-Dist"),
        ({"Description-Content-Type": "text/x-rst"}, PACKAGE, "not markdown"),
        ({"Version": "9.8.6"}, PACKAGE, "Version is '9.8.6', expected '9.8.7'"),
        ({"License-Expression": "MIT"}, PACKAGE, "License-Expression is 'MIT'"),
        ({"License-File": []}, PACKAGE, "License-File is None"),
        ({}, PACKAGE[:1] + PACKAGE[2:], "loopkit/py.typed missing"),
        ({}, [*PACKAGE, "tests/test_x.py"], "holds more than the package: ['tests']"),
    ],
)
def test_check_dist_names_each_fault(
    tmp_path: Path, change: dict[str, object], files: list[str], found: str
) -> None:
    """Each fault an index or pip would see is reported, naming the field or file."""
    dist = _release(tmp_path, GOOD | change, files)
    version, problems = _check_dist().check(dist, root=tmp_path)
    assert version == "9.8.7"
    assert any(found in p for p in problems), problems
