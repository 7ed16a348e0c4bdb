"""``python -m loopkit.lint``: arguments, output, exit status."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from ._check import check_paths
from ._registry import REGISTRY


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: print the findings; 1 if any, 0 if clean, 2 on a usage error."""
    parser = argparse.ArgumentParser(
        prog="python -m loopkit.lint",
        description="Find the training-loop habits that slow PyTorch down, without running them.",
    )
    parser.add_argument("paths", nargs="+", metavar="PATH", help="files or folders (*.py)")
    parser.add_argument("--format", choices=["text", "json"], default="text")
    which = parser.add_mutually_exclusive_group()
    which.add_argument(
        "--select", help="comma-separated codes to check (only those run), e.g. LK001,LK002"
    )
    which.add_argument("--all", action="store_true", help="every rule, the ones off by default too")
    args = parser.parse_args(argv)

    select: list[str] | None = list(REGISTRY) if args.all else None
    if args.select is not None:
        select = [c.strip().upper() for c in args.select.split(",") if c.strip()]
        unknown = sorted(set(select) - set(REGISTRY))
        if unknown or not select:
            parser.error(
                f"unknown code(s) in --select: {', '.join(unknown) or '(none given)'}; "
                f"known: {', '.join(REGISTRY)}"
            )
    missing = [p for p in args.paths if not Path(p).exists()]
    if missing:
        parser.error(f"no such file or directory: {', '.join(missing)}")

    findings = check_paths(args.paths, select=select)
    if args.format == "json":
        print(json.dumps([asdict(f) for f in findings], indent=2))
    else:
        for f in findings:
            print(f.format())
        files = len({f.path for f in findings})
        if findings:
            print(f"Found {len(findings)} problem(s) in {files} file(s).")
        else:
            print("No problems found.")
    return 1 if findings else 0
