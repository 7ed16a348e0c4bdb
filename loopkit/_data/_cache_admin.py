"""Preload caches on disk: list them, remove one, prune old ones.

A cache left in ``/dev/shm`` holds RAM until it is removed: ``Preloaded.remove()`` removes
the one a run used; ``python -m loopkit.preload_caches list|prune`` finds the others.
Only a complete cache (its ``meta.json`` written) that this user owns is ever removed, and
only under its build lock, so a build of the same cache running now is never cut short.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import time
from collections.abc import Sequence
from pathlib import Path

from ._cache_files import META, build_lock, complete, read_meta
from ._cache_trust import default_roots


@dataclasses.dataclass(frozen=True)
class CacheEntry:
    """One cache found under a root."""

    path: Path
    key: str
    length: int
    nbytes: int
    age_s: float


def key_of(path: Path) -> str:
    """The ``key`` a cache directory was built under (its name is ``<key>-<fingerprint>``)."""
    return path.name.rsplit("-", 1)[0]


def find(roots: Sequence[Path]) -> list[CacheEntry]:
    """Every complete cache this user owns under ``roots``, oldest first."""
    found = []
    for root in roots:
        if not root.is_dir():
            continue
        for path in sorted(root.iterdir()):
            if path.name.startswith(".") or not path.is_dir() or not complete(path):
                continue
            if path.stat().st_uid != os.getuid():
                continue
            meta = read_meta(path)
            files = [f for f in path.iterdir() if f.is_file()]
            found.append(CacheEntry(
                path=path, key=key_of(path), length=int(meta["length"]),
                nbytes=sum(f.stat().st_size for f in files),
                age_s=time.time() - (path / META).stat().st_mtime,
            ))  # fmt: skip
    return sorted(found, key=lambda e: -e.age_s)


def remove(path: Path) -> bool:
    """Remove the cache at ``path``; False if it was already gone.

    Refuses (before removing anything) a directory that is not a complete loopkit cache or
    that another user owns.
    """
    if not path.exists():
        return False
    if not complete(path):
        raise ValueError(
            f"preload: {path} is not a complete preload cache (no {META}): not removed; "
            "delete it by hand if it is yours"
        )
    read_meta(path)  # raises, naming the file, if it is not a loopkit cache's
    if path.stat().st_uid != os.getuid():
        raise PermissionError(f"preload: {path} belongs to another user: not removed")
    with build_lock(path.parent, key_of(path)):  # never under a build of the same cache
        if not path.exists():
            return False
        shutil.rmtree(path)
    return True


def _size(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    power = min(3, (n.bit_length() - 1) // 10)  # 1 KiB, 2 MiB, 3 GiB and above
    return f"{n / 1024**power:.1f} {('KiB', 'MiB', 'GiB')[power - 1]}"


def _age(seconds: float) -> str:
    if seconds < 3600:
        return f"{seconds / 60:.0f} min"
    if seconds < 2 * 86400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} d"


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m loopkit.preload_caches list|prune``: 0 on success, 2 on a usage error."""
    parser = argparse.ArgumentParser(
        prog="python -m loopkit.preload_caches",
        description="List or remove loopkit.preload caches (by default those under "
        f"{', '.join(str(r) for r in default_roots())}).",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    listing = sub.add_parser("list", help="list the caches: key, items, size, age, path")
    prune = sub.add_parser("prune", help="remove caches (prints what it would remove unless --yes)")
    for p in (listing, prune):
        p.add_argument(
            "--root", action="append", type=Path,
            help="a cache root given as preload(..., cache=ROOT); repeatable",
        )  # fmt: skip
    which = prune.add_mutually_exclusive_group(required=True)
    which.add_argument("--older-than", type=float, metavar="DAYS",
                       help="caches not rebuilt for more than DAYS days")  # fmt: skip
    which.add_argument("--all", action="store_true", help="every cache")
    prune.add_argument("--yes", action="store_true", help="remove them (default: a dry run)")
    args = parser.parse_args(argv)
    if args.command == "prune" and args.older_than is not None and args.older_than < 0:
        parser.error("--older-than must be >= 0 days")
    entries = find(args.root or default_roots())
    if args.command == "list":
        for e in entries:
            print(f"{e.key}\t{e.length} items\t{_size(e.nbytes)}\t{_age(e.age_s)}\t{e.path}")
        if not entries:
            print("no preload caches found")
        return 0
    chosen = [e for e in entries if args.all or e.age_s > args.older_than * 86400]
    for e in chosen:
        if args.yes:
            remove(e.path)
        print(f"{'removed' if args.yes else 'would remove'}\t{_size(e.nbytes)}\t{e.path}")
    if chosen and not args.yes:
        print("(a dry run: add --yes to remove them)")
    if not chosen:
        print("nothing to remove")
    return 0
