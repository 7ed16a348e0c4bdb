"""A static checker for PyTorch training scripts: find what slows the loop, line by line.

``python -m loopkit.lint PATH...`` reads each script with :mod:`ast` (it never imports or
runs it) and reports the anti-patterns the PyTorch performance guides warn about: a host
sync every step, a loss kept in a list, tensors built on the CPU and copied every step,
``nn.DataParallel``, a DataLoader that loads in the main process, evaluation that records a
graph, a ragged accumulation window that is never stepped, and more. Each finding names
why it costs and the loopkit line that fixes it.

The heuristics prefer silence to noise: a rule fires only on a pattern it can see whole in
the files checked together (calls are followed into the functions and methods they define).
``# loopkit: ignore`` (or ``# loopkit: ignore[LK002,LK007]``) on a line silences it. Nothing
here imports torch, so a CI job can lint without installing it. ``--fix`` (and
``fix_source``) rewrites the findings whose fix keeps every result bit for bit, and shows
the others as suggestions, each with why it could change a result.

Layout, each layer importing only those below it: ``_syntax`` (pure questions about one
node), ``_names`` and ``_parsed`` (one file's own text: scopes, names, loops, grad-off
regions), ``_branches`` and ``_shape`` (cadences, error paths, training steps),
``_program`` (the whole program: calls followed between files, what runs per step or once,
which files run on an accelerator), ``_flags``, ``_script`` (what the rules ask: a file and
its program), ``_declaration`` (the ``@rule`` declaration), ``_rules/<theme>.py`` (the rules),
``_registry`` (collects them), ``_findings``, ``_check``, ``_fix`` (with ``_rewrites``, what
each fix writes, and ``_text``, source positions) and ``_cli``.
"""

from __future__ import annotations

from ._check import check_paths, check_source, check_sources, iter_python_files
from ._cli import main
from ._findings import Finding
from ._fix import fix_source
from ._registry import REGISTRY, markdown_table

__all__ = [
    "RULES",
    "Finding",
    "check_paths",
    "check_source",
    "check_sources",
    "fix_source",
    "iter_python_files",
    "main",
    "markdown_table",
]

# code -> (why it costs, the loopkit one-liner that fixes it), every rule, off-by-default too
RULES: dict[str, tuple[str, str]] = {code: (r.why, r.fix) for code, r in REGISTRY.items()}
