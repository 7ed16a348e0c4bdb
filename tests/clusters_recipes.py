"""The recipes of docs/clusters.md, read by section, for the tests that run them.

Each recipe is a section (``## Heading``) holding a ``python`` block whose first line is
``# <file name>`` (the loop) and one or more ``bash`` blocks (the launch commands).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from helpers import ROOT

PAGE = ROOT / "docs" / "clusters.md"
_FENCE = re.compile(r"^```(\w+)\n(.*?)^```", flags=re.M | re.S)


@dataclass(frozen=True)
class Recipe:
    """One section's blocks: loops by file name, launch commands in order."""

    files: dict[str, str]
    commands: list[str]

    def write(self, where: Path) -> None:
        """Write each loop file into ``where``."""
        for name, text in self.files.items():
            (where / name).write_text(text)


def sections() -> dict[str, str]:
    """Each ``## `` section's text by heading."""
    parts = re.split(r"^## (.+)$", PAGE.read_text(), flags=re.M)
    return {parts[i].strip(): parts[i + 1] for i in range(1, len(parts), 2)}


def recipe(heading: str) -> Recipe:
    """The blocks of the section headed ``heading`` (KeyError naming the headings there)."""
    found = sections()
    if heading not in found:
        raise KeyError(f"no section {heading!r} in docs/clusters.md: {sorted(found)}")
    files: dict[str, str] = {}
    commands: list[str] = []
    for lang, body in _FENCE.findall(found[heading]):
        if lang == "python":
            first = body.splitlines()[0]
            assert first.startswith("# ") and first.endswith(".py"), first
            files[first[2:].strip()] = body
        else:
            commands.append(body)
    return Recipe(files, commands)
