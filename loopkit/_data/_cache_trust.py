"""Whose cache it is: the default root is private to the user, a foreign cache is refused.

A cache is read as it is, so whoever can write it decides what a run trains on. The
default root (``/dev/shm`` or the temporary directory) is named per user and created
with mode 0700; a root or cache that another user owns, or that group or others can
write, is refused unless the caller trusts everyone who can write there
(``preload(..., trust_shared_cache=True)``). The root's ancestors are not checked.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from pathlib import Path

SHM = Path("/dev/shm")

_OPT_IN = (
    "if everyone who can write there is trusted (a team cache), pass "
    "preload(..., trust_shared_cache=True)"
)


def default_roots() -> list[Path]:
    """Where a cache may go without ``cache=``: /dev/shm's (if writable), then the temp dir's."""
    name = f"loopkit-preload-{os.getuid()}"
    places = [Path(tempfile.gettempdir()) / name]
    if SHM.is_dir() and os.access(SHM, os.W_OK):
        places.insert(0, SHM / name)
    return places


def _trusted_owners() -> set[int]:
    return {os.getuid(), 0}  # root could change anything anyway


def _problem(st: os.stat_result, *, private: bool) -> str | None:
    """What makes a path with this stat untrustworthy, or None."""
    if private and st.st_uid != os.getuid():
        return f"owned by uid {st.st_uid}, not by this user (uid {os.getuid()})"
    if st.st_uid not in _trusted_owners():
        return f"owned by uid {st.st_uid}, another user"
    mode = stat.S_IMODE(st.st_mode)
    if private and mode & 0o077:
        return f"open to group or others (mode {mode:#o}, not 0o700)"
    if mode & 0o022:
        return f"writable by group or others (mode {mode:#o})"
    return None


def check_root(root: Path, *, default: bool, trust: bool) -> None:
    """Refuse a root another user could have written (a missing one is fine: it is made private).

    A default root must be a real directory of this user's with mode 0700, even with
    ``trust``: it is named after the user, and one that is not theirs was planted.
    """
    try:
        st = os.lstat(root) if default else os.stat(root)
    except FileNotFoundError:
        return
    except OSError as err:  # a file in its path, no permission to look
        raise _root_error(err, "use", root) from err
    if not stat.S_ISDIR(st.st_mode):
        raise NotADirectoryError(f"preload: the cache root {root} is not a directory")
    if trust and not default:
        return
    problem = _problem(st, private=default)
    if problem is None:
        return
    if default:
        raise PermissionError(
            f"preload: refusing the default cache root {root}: it is {problem}, so another "
            f"user may have put data there. Remove it (or, if it is yours, chmod 700 it), or "
            f"pass cache= a directory of your own"
        )
    raise PermissionError(
        f"preload: refusing the cache root {root}: it is {problem}, so another user could "
        f"put a cache there that this run would train on. Pass cache= a directory only you "
        f"can write (one of your own, or `chmod go-w {root}` if it is yours), or, {_OPT_IN}"
    )


def _root_error(err: OSError, verb: str, root: Path) -> OSError:
    """``err`` (its type and errno kept) saying preload, the root and what to do."""
    return type(err)(
        err.errno,
        f"preload: cannot {verb} the cache root {root} ({err.strerror}): pass cache= a "
        "directory you can write to",
    )


def make_root(root: Path, *, default: bool, trust: bool) -> None:
    """Create ``root`` if missing (a default root private: mode 0700), then check it."""
    try:
        if not default:
            root.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):  # one already there is checked below
            # Never group- or other-writable, whatever the umask; a default root private.
            os.mkdir(root, 0o700 if default else 0o755)
    except OSError as err:
        raise _root_error(err, "create", root) from err
    check_root(root, default=default, trust=trust)


def check_cache(path: Path) -> None:
    """Refuse a cache directory that another user owns or could have written, file by file."""
    entries = [path, *sorted(path.iterdir())]
    for entry in entries:
        st = os.lstat(entry)
        kind_ok = stat.S_ISDIR(st.st_mode) if entry == path else stat.S_ISREG(st.st_mode)
        problem = None if kind_ok else "not a plain file or directory (a link?)"
        problem = problem or _problem(st, private=False)
        if problem is not None:
            raise PermissionError(
                f"preload: refusing the cache {path}: {entry.name} is {problem}, so another "
                f"user may have changed the items it holds. Delete {path} to rebuild it, or, "
                f"{_OPT_IN}"
            )
