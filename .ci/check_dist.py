"""Check a built sdist and wheel of torch-loopkit: what an index and pip will read.

    python .ci/check_dist.py DIST_DIR

DIST_DIR holds one ``torch_loopkit-<v>.tar.gz`` and one ``torch_loopkit-<v>-py3-none-any.whl``.
Both must carry the version of ``loopkit/__init__.py`` (read from the source, not imported), the
name, the SPDX license and its file, the runtime dependencies, the README as markdown, the
``loopkit-lint`` command and ``py.typed``; the wheel holds the package only. Prints the version
and exits 0, or prints each problem and exits 1. Standard library only.
"""

from __future__ import annotations

import ast
import sys
import tarfile
import zipfile
from email.message import Message
from email.parser import Parser
from pathlib import Path

NAME = "torch-loopkit"
PROJECT = "torch_loopkit"  # the file-name form of the distribution's name
RUNTIME = {"torch", "numpy", "accelerate", "typing-extensions"}
ROOT = Path(__file__).resolve().parent.parent


def source_version(init: Path) -> str:
    """``__version__`` as ``loopkit/__init__.py`` assigns it (a string literal)."""
    for node in ast.parse(init.read_text()).body:
        if not isinstance(node, ast.Assign) or not isinstance(node.value, ast.Constant):
            continue
        named = any(isinstance(t, ast.Name) and t.id == "__version__" for t in node.targets)
        if named and isinstance(node.value.value, str):
            return node.value.value
    raise ValueError(f"{init}: no __version__ = '<string>'")


def _requirement_name(line: str) -> str:
    """``torch>=2.6,<3`` -> ``torch``; ``typing_extensions`` -> ``typing-extensions``."""
    head = line.split(";")[0].strip()
    for stop in "[<>=!~ (":
        head = head.split(stop)[0]
    return head.strip().lower().replace("_", "-")


def metadata_problems(meta: Message, version: str, readme: str, where: str) -> list[str]:
    """What is wrong with one METADATA/PKG-INFO against the expected version and README."""
    problems = []

    def expect(field: str, value: str) -> None:
        if meta.get(field) != value:
            problems.append(f"{where}: {field} is {meta.get(field)!r}, expected {value!r}")

    expect("Name", NAME)
    expect("Version", version)
    expect("License-Expression", "Apache-2.0")
    expect("Requires-Python", ">=3.10")
    if meta.get_all("License-File") != ["LICENSE"]:
        problems.append(f"{where}: License-File is {meta.get_all('License-File')}, not [LICENSE]")
    content_type = (meta.get("Description-Content-Type") or "").split(";")[0].strip()
    if content_type != "text/markdown":
        problems.append(f"{where}: Description-Content-Type is {content_type!r}, not markdown")
    body = meta.get_payload()
    if not isinstance(body, str) or body.strip() != readme.strip():
        problems.append(f"{where}: the long description is not README.md")
    runtime = {
        _requirement_name(r) for r in meta.get_all("Requires-Dist") or [] if "extra ==" not in r
    }
    if runtime != RUNTIME:
        problems.append(f"{where}: runtime Requires-Dist {sorted(runtime)}, not {sorted(RUNTIME)}")
    extras = set(meta.get_all("Provides-Extra") or [])
    if not {"dev", "docs"} <= extras:
        problems.append(f"{where}: Provides-Extra {sorted(extras)} lacks dev or docs")
    return problems


def check(dist: Path, root: Path = ROOT) -> tuple[str, list[str]]:
    """(the version, every problem found) for the sdist and wheel in ``dist``."""
    version = source_version(root / "loopkit" / "__init__.py")
    readme = (root / "README.md").read_text()
    wheels = sorted(dist.glob("*.whl"))
    sdists = sorted(dist.glob("*.tar.gz"))
    if len(wheels) != 1 or len(sdists) != 1:
        names = sorted(p.name for p in dist.iterdir())
        return version, [f"{dist}: expected one wheel and one sdist, found {names}"]
    wheel, sdist = wheels[0], sdists[0]
    problems = []
    if wheel.name != f"{PROJECT}-{version}-py3-none-any.whl":
        problems.append(f"{wheel.name}: not {PROJECT}-{version}-py3-none-any.whl")
    if sdist.name != f"{PROJECT}-{version}.tar.gz":
        problems.append(f"{sdist.name}: not {PROJECT}-{version}.tar.gz")

    with zipfile.ZipFile(wheel) as whl:
        files = whl.namelist()
        info = f"{PROJECT}-{version}.dist-info"
        if f"{info}/METADATA" not in files:
            return version, [*problems, f"{wheel.name}: no {info}/METADATA"]
        meta = Parser().parsestr(whl.read(f"{info}/METADATA").decode())
        problems += metadata_problems(meta, version, readme, wheel.name)
        scripts = f"{info}/entry_points.txt"
        entry_points = whl.read(scripts).decode() if scripts in files else ""
    if "loopkit-lint = loopkit.lint._cli:main" not in entry_points:
        problems.append(f"{wheel.name}: no loopkit-lint console script")
    for needed in ("loopkit/__init__.py", "loopkit/py.typed", "loopkit/lint/__init__.py"):
        if needed not in files:
            problems.append(f"{wheel.name}: {needed} missing")
    strays = sorted({f.split("/")[0] for f in files} - {"loopkit", info})
    if strays:
        problems.append(f"{wheel.name}: holds more than the package: {strays}")

    with tarfile.open(sdist) as tar:
        top = f"{PROJECT}-{version}"
        members = set(tar.getnames())
        for needed in ("PKG-INFO", "pyproject.toml", "README.md", "LICENSE", "loopkit/py.typed"):
            if f"{top}/{needed}" not in members:
                problems.append(f"{sdist.name}: {needed} missing")
        pkg_info = tar.extractfile(f"{top}/PKG-INFO") if f"{top}/PKG-INFO" in members else None
        if pkg_info is not None:
            meta = Parser().parsestr(pkg_info.read().decode())
            problems += metadata_problems(meta, version, readme, sdist.name)
    return version, problems


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    version, problems = check(Path(argv[0]))
    for problem in problems:
        print(f"check_dist: {problem}", file=sys.stderr)
    if not problems:
        print(version)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
