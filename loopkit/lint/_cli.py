"""``python -m loopkit.lint``: arguments, output, exit status."""

from __future__ import annotations

import argparse
import difflib
import json
import sys
import tokenize
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from ._check import check_paths, iter_python_files, parse
from ._explain import explain
from ._findings import Finding
from ._fix import fix_source, fixable_codes
from ._registry import REGISTRY


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: print the findings; 1 if any, 0 if clean, 2 on a usage error."""
    parser = argparse.ArgumentParser(
        prog="python -m loopkit.lint",
        usage="%(prog)s [-h] [--format {text,json}] [--select SELECT | --all] [--single-file] "
        "[--fix] [--write] PATH [PATH ...]\n       %(prog)s --explain CODE",
        description="Find the training-loop habits that slow PyTorch down, without running them.",
    )
    # Required, except with --explain (checked below: argparse cannot say "unless").
    parser.add_argument("paths", nargs="*", metavar="PATH", help="files or folders (*.py)")
    parser.add_argument(
        "--explain",
        metavar="CODE",
        help="print what rule CODE flags, why it costs, when the cost is real and when it is "
        "not, and its fix; takes no PATH",
    )
    parser.add_argument("--format", choices=["text", "json"], default="text")
    which = parser.add_mutually_exclusive_group()
    which.add_argument(
        "--select", help="comma-separated codes to check (only those run), e.g. LK001,LK002"
    )
    which.add_argument("--all", action="store_true", help="every rule, the ones off by default too")
    parser.add_argument(
        "--fix",
        action="store_true",
        help=f"rewrite the findings of {', '.join(fixable_codes())} whose fix keeps every "
        "result: prints a unified diff (writes the files only with --write), and the "
        "rewrites that could change a result as suggestions, with why",
    )
    parser.add_argument("--write", action="store_true", help="with --fix: write the fixes")
    parser.add_argument(
        "--single-file",
        action="store_true",
        help="check only the files named, not the program's own modules they import (by "
        "default those are checked with them: a helper's per-step reads are found, and it "
        "runs on the device of the script importing it); says on stderr which imports it "
        "did not see",
    )
    args = parser.parse_args(argv)
    if args.explain is not None:
        return _explain(parser, args)
    if not args.paths:
        parser.error("the following arguments are required: PATH")
    if args.write and not args.fix:
        parser.error("--write needs --fix (it writes the fixes --fix finds)")
    if args.fix and args.format != "text":
        parser.error("--fix prints a diff: --format json is for findings")

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

    if args.fix:
        return _fix(args.paths, select, write=args.write)
    findings = check_paths(args.paths, select=select, follow_imports=not args.single_file)
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


def _explain(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """Print rule ``--explain CODE``'s text: 0, or a usage error for an unknown code or for
    anything else asked with it."""
    code = args.explain.strip().upper()
    others = [
        name
        for name, given in (
            ("PATH", args.paths),
            ("--fix", args.fix),
            ("--write", args.write),
            ("--select", args.select is not None),
            ("--all", args.all),
            ("--single-file", args.single_file),
            ("--format json", args.format != "text"),
        )
        if given
    ]
    if others:
        parser.error(
            f"--explain prints one rule's explanation and checks nothing: it takes no "
            f"{', '.join(others)}"
        )
    if code not in REGISTRY:
        parser.error(f"unknown code for --explain: {args.explain}; known: {', '.join(REGISTRY)}")
    print(explain(code), end="")
    return 0


def _fix(paths: list[str], select: list[str] | None, *, write: bool) -> int:
    """Print each file's fixes as a unified diff (or write them), and on stderr the rewrites
    not applied because they could change a result, each with why: 1 if a diff was printed
    and not written (like a check that fails until the fixes are applied) or a file could
    not be fixed, else 0."""
    changed = failed = suggested = 0
    for file in iter_python_files(paths):
        name = str(file)
        try:
            with open(file, "rb") as handle:
                encoding, _ = tokenize.detect_encoding(handle.readline)
            source = file.read_text(encoding=encoding)
            parse(source, name)
        except (SyntaxError, UnicodeDecodeError, ValueError, RecursionError) as exc:
            print(f"{name}: skipped, cannot parse: {exc}", file=sys.stderr)
            continue
        suggestions: list[Finding] = []
        try:
            fixed = fix_source(source, select, path=name, suggestions=suggestions)
        except RuntimeError as exc:  # the fixer's own check of what it wrote
            print(f"{name}: not fixed: {exc}", file=sys.stderr)
            failed += 1
            continue
        for s in suggestions:
            print(
                f"{s.path}:{s.line}:{s.col}: {s.code} {s.message}. Suggested: {s.fix}",
                file=sys.stderr,
            )
        suggested += len(suggestions)
        if fixed == source:
            continue
        changed += 1
        if write:
            file.write_text(fixed, encoding=encoding)
        else:
            diff = difflib.unified_diff(
                source.splitlines(keepends=True),
                fixed.splitlines(keepends=True),
                fromfile="a/" + name.lstrip("/"),
                tofile="b/" + name.lstrip("/"),
            )
            sys.stdout.writelines(diff)
    if write and changed:
        print(f"Fixed {changed} file(s).")
    elif not changed and not suggested and not failed:
        print("Nothing to fix.")
    if suggested:  # on stderr, with the suggestions: stdout stays a diff that applies
        print(
            f"{suggested} rewrite(s) not applied, as they could change what some programs "
            "compute: apply them by hand where the reason given does not hold.",
            file=sys.stderr,
        )
    return 1 if failed or (changed and not write) else 0
