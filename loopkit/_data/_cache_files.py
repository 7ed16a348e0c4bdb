"""A preload cache on disk: its files, how a build writes them, how an open checks them.

A cache is a directory of one file per field: a fixed-shape field as ``[N, *shape]``
(``field{j}.bin``), a field whose sizes vary as the items' elements one after another
(``field{j}.bin``) with each item's start (``field{j}.offsets``, int64 ``[N + 1]``) and
shape (``field{j}.shapes``, int64 ``[N, ndim]``). ``meta.json`` names the fields and holds
each file's sha256, written as the bytes are. A build writes into a temporary directory
(``.<name>.tmp-*``) and renames it into place once complete, under an ``flock`` on
``.<name>.lock`` (mode 0600 whatever the umask: no other user writes beside a cache,
``_cache_trust``): a second process building the same cache waits, then opens the first
one's, and only a builder holding the lock removes temporary directories (a killed
build's), so a live build's directory is never removed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import glob
import hashlib
import json
import os
import shutil
import stat
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ._fields import FORMAT, Field, Survey, check_item, raw_bytes

META = "meta.json"


def complete(path: Path) -> bool:
    """Whether a finished cache is at ``path`` (``meta.json`` is written last)."""
    return (path / META).is_file()


def free_bytes(directory: Path) -> int:
    """Free bytes where ``directory`` is (or would be created)."""
    while not directory.exists() and directory != directory.parent:
        directory = directory.parent
    return shutil.disk_usage(directory).free


def needed_bytes(n: int, survey: Survey) -> int:
    """Bytes the cache will take: exact for fixed shapes, estimated from the sample otherwise."""
    total = 0
    for f, mean in zip(survey.fields, survey.mean_numel, strict=True):
        if f.shape is not None:
            total += n * int(np.prod(f.shape, dtype=np.int64)) * f.element_size
        else:  # a margin for the estimate, and the offsets and shapes
            total += int(mean * n * 1.25) * f.element_size + (n + 1) * 8 + n * f.ndim * 8
    return total


@contextlib.contextmanager
def build_lock(root: Path, name: str) -> Iterator[bool]:
    """Hold ``root/.<name>.lock`` exclusively inside; yields whether the lock is held.

    The holder removes the file when done; a process that waited on the removed file
    takes the lock again on a new one. Where the file system has no locks, yields False.
    """
    path = root / f".{name}.lock"
    while True:
        fd = _open_lock(path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as err:
            os.close(fd)
            if err.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                raise
            yield False
            return
        try:
            here = os.stat(path)
        except FileNotFoundError:
            here = None
        mine = os.fstat(fd)
        if here is not None and (here.st_ino, here.st_dev) == (mine.st_ino, mine.st_dev):
            break
        os.close(fd)  # the holder before us removed the file we waited on: lock anew
    try:
        yield True
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        os.close(fd)  # releases the lock, after the file is gone


def _open_lock(path: Path) -> int:
    """The lock file, opened for writing; one this call creates is owner-only (0600)."""
    denied = 0
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            pass
        else:
            try:  # the umask cuts O_CREAT's mode (0o277 leaves 0o400): set it, whatever it is
                os.fchmod(fd, 0o600)
            except OSError:
                os.close(fd)
                raise
            return fd
        try:
            return os.open(path, os.O_RDWR)
        except FileNotFoundError:
            continue  # its holder removed it as we opened it: make it anew
        except PermissionError as err:
            denied += 1  # its creator may not have set its mode yet: wait a moment for it
            if denied == 50:
                raise PermissionError(
                    err.errno,
                    f"preload: cannot open the build lock {path} ({err.strerror}): another "
                    "user's build of this cache holds it, or its mode was changed; run again "
                    "once no build of it runs, or pass cache= a directory of your own",
                ) from err
            time.sleep(0.01)


def remove_leftovers(root: Path, name: str) -> None:
    """Remove killed builds' temporary directories (call only while holding the lock)."""
    for stale in root.glob(glob.escape(f".{name}.tmp-") + "*"):
        shutil.rmtree(stale, ignore_errors=True)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


@dataclasses.dataclass
class _Writer:
    """One field's files being written, hashed as they are written."""

    data: Any
    hash: Any
    offsets: list[int] | None
    shapes: list[tuple[int, ...]] | None


def write(
    n: int,
    get: Callable[[int], tuple[torch.Tensor, ...]],
    survey: Survey,
    single: bool,
    final: Path,
) -> None:
    """Write the cache into a temporary directory and rename it into place when complete."""
    root = final.parent
    needed = needed_bytes(n, survey)
    free = shutil.disk_usage(root).free
    if needed > free:
        raise OSError(
            f"preload needs {needed:,} bytes ({needed / 2**30:.2f} GiB) in {root} but only "
            f"{free:,} are free: pass cache= a directory with room, or free space there"
        )
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=root))
    try:
        sums = _write_fields(n, get, survey.fields, tmp)
        meta = {
            "format": FORMAT,
            "fingerprint": survey.fingerprint,
            "length": n,
            "single": single,
            "fields": [dataclasses.asdict(f) for f in survey.fields],
            "sha256": sums,
        }
        # meta.json is what makes a cache complete, and only the final name is ever opened.
        with open(tmp / META, "x") as fh:
            fh.write(json.dumps(meta))
            fh.flush()
            os.fsync(fh.fileno())
        # Readable as the root is, writable by this user only (whatever the umask).
        mode = stat.S_IMODE(os.stat(root).st_mode) & 0o755 | 0o700
        for f in tmp.iterdir():
            os.chmod(f, mode & 0o644)
        os.chmod(tmp, mode)
        try:
            os.rename(tmp, final)
        except OSError:
            if not complete(final):  # not a builder (on another node) that got there first
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _write_fields(
    n: int, get: Callable[[int], tuple[torch.Tensor, ...]], fields: list[Field], tmp: Path
) -> dict[str, str]:
    """Every item's fields into ``tmp``; the sha256 of each file written, by file name."""
    writers = []
    try:
        for j, f in enumerate(fields):
            ragged = f.shape is None
            writers.append(_Writer(open(tmp / f"field{j}.bin", "xb"), hashlib.sha256(),  # noqa: SIM115
                                   [0] if ragged else None, [] if ragged else None))  # fmt: skip
        for i in range(n):
            parts = get(i)
            check_item(i, parts, fields)
            for p, w in zip(parts, writers, strict=True):
                data = raw_bytes(p).data
                w.data.write(data)
                w.hash.update(data)
                if w.offsets is not None and w.shapes is not None:
                    w.offsets.append(w.offsets[-1] + p.numel())
                    w.shapes.append(tuple(p.shape))
    finally:
        for w in writers:
            w.data.flush()
            os.fsync(w.data.fileno())
            w.data.close()
    sums = {f"field{j}.bin": w.hash.hexdigest() for j, w in enumerate(writers)}
    for j, (w, f) in enumerate(zip(writers, fields, strict=True)):
        if w.offsets is None or w.shapes is None:
            continue
        shapes = np.asarray(w.shapes, dtype=np.int64).reshape(n, f.ndim)
        for suffix, array in (("offsets", np.asarray(w.offsets, dtype=np.int64)),
                              ("shapes", shapes)):  # fmt: skip
            blob = array.tobytes()
            with open(tmp / f"field{j}.{suffix}", "xb") as fh:
                fh.write(blob)
                fh.flush()
                os.fsync(fh.fileno())
            sums[f"field{j}.{suffix}"] = hashlib.sha256(blob).hexdigest()
    return sums


def read_meta(path: Path) -> dict[str, Any]:
    """The cache's ``meta.json``, checked to be of this layout."""
    try:
        meta = json.loads((path / META).read_text())
        if not isinstance(meta, dict):
            raise ValueError("not an object")
    except (OSError, ValueError) as err:
        raise RuntimeError(
            f"preload: {path / META} cannot be read ({err}): delete {path} to rebuild it"
        ) from err
    if meta.get("format") != FORMAT:
        raise RuntimeError(
            f"preload: {path} is a cache of layout {meta.get('format')!r}, not {FORMAT}: "
            f"delete it to rebuild it"
        )
    missing = [k for k in ("fingerprint", "length", "single", "fields") if k not in meta]
    if missing:
        raise RuntimeError(
            f"preload: {path / META} lacks {', '.join(missing)}: delete {path} to rebuild it"
        )
    return meta


def check_sizes(path: Path, sizes: dict[str, int]) -> None:
    """Refuse a cache whose files do not have the sizes its metadata implies (truncated)."""
    for name, size in sizes.items():
        try:
            have = os.stat(path / name).st_size
        except FileNotFoundError:
            have = -1
        if have != size:
            said = "is missing" if have < 0 else f"has {have:,} bytes, not {size:,}"
            raise RuntimeError(
                f"preload: the cache {path} is damaged: {name} {said}; delete {path} to rebuild it"
            )


def verify(path: Path, meta: dict[str, Any], names: list[str]) -> None:
    """Refuse a cache whose files ``names`` differ from the checksums written at its build."""
    sums = meta.get("sha256")
    if not isinstance(sums, dict) or set(sums) != set(names):
        raise RuntimeError(
            f"preload: the cache {path} lacks the checksums of its files: delete it to rebuild it"
        )
    for name in names:
        if _sha256(path / name) != sums[name]:
            raise RuntimeError(
                f"preload: {path / name} does not match the checksum written when the cache "
                f"was built (changed or damaged since): delete {path} to rebuild it"
            )


def contents(path: Path) -> str:
    """A digest of what the cache at ``path`` holds: every file's sha256 from its build.

    Equal for two caches of the same items whatever their key, root or node; it compares
    every byte, where the fingerprint in a cache's name compares a sample of items.
    """
    meta = read_meta(path)
    held = {k: meta.get(k) for k in ("length", "single", "fields")}
    held["sha256"] = meta.get("sha256") or meta["fingerprint"]
    return hashlib.sha256(json.dumps(held, sort_keys=True).encode()).hexdigest()[:16]
