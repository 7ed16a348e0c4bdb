"""Under torchrun: local rank 0 opens or builds the cache while the node's other ranks wait.

They do not wait inside a collective, which the process group's timeout bounds (a build
of a real data set easily takes longer, and would kill them): they poll a small file,
``.<name>.job-<token>-<host>`` in the cache root, in which local rank 0 says that it is
working (and its pid), then where the cache is, or why it failed. The token, drawn by
rank 0 and shared in one quick collective as ``preload`` starts, tells this call's file
from an earlier one's. A waiter raises with local rank 0's error if the build failed,
and if local rank 0 died without finishing (its pid is gone), so none waits forever.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .. import _ranks

_MAX_POLL_S = 1.0


def job_token() -> str:
    """A token all ranks of this call share (one quick collective); "" in a single process."""
    if not _ranks.is_multi_rank():
        return ""
    return str(_ranks.gather_objects(secrets.token_hex(8))[0])


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def _path(directory: Path, name: str, token: str) -> Path:
    host = re.sub(r"[^A-Za-z0-9._-]", "_", socket.gethostname())[:64]
    return directory / f".{name}.job-{token}-{host}"


class Announcer:
    """Local rank 0's side: says what it is doing, in a file the node's other ranks poll."""

    def __init__(self, directory: Path, name: str, token: str) -> None:
        self.path = _path(directory, name, token)

    def say(self, state: str, **more: str) -> None:
        said = {"state": state, "pid": os.getpid(), "pid_ns": _pid_namespace(), **more}
        tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(json.dumps(said))
        os.replace(tmp, self.path)  # a reader sees the old news or the new, never half

    def remove(self) -> None:
        with contextlib.suppress(OSError):  # never there (no root), or already gone
            os.unlink(self.path)


def _read(path: Path) -> dict[str, Any] | None:
    try:
        said = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return said if isinstance(said, dict) else None


def _gone(said: dict[str, Any]) -> bool:
    """Whether the process that wrote ``said`` is known to have ended."""
    pid = said.get("pid")
    if not isinstance(pid, int) or said.get("pid_ns") != _pid_namespace() or not said["pid_ns"]:
        return False  # another pid namespace (or no /proc): its pids say nothing here
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def wait_for(
    directory: Path, name: str, token: str, outcome: Callable[[], str | None] = lambda: None
) -> Path:
    """The cache's path once local rank 0 says it is ready; raises what it says if it failed.

    ``outcome``: local rank 0's final word if it has one (its error, "" when it succeeded),
    posted where a failure before the handoff file existed (no root) still arrives.
    """
    path = _path(directory, name, token)
    delay = 0.02
    while True:
        said = _read(path)
        if said is None:
            final = outcome()
            if final:
                raise RuntimeError(
                    f"preload: local rank 0 could not build or open the cache in {directory}: "
                    f"{final}"
                )
        if said is not None:
            if said.get("state") == "ready":
                return Path(str(said.get("path")))
            if said.get("state") == "failed":
                raise RuntimeError(
                    f"preload: local rank 0 could not build or open the cache: {said.get('error')}"
                )
            if _gone(said):
                raise RuntimeError(
                    f"preload: local rank 0 (pid {said.get('pid')}) ended without finishing "
                    "the cache: see its output for why"
                )
        time.sleep(delay)  # bounded: a finished build is seen within a second
        delay = min(delay * 1.5, _MAX_POLL_S)
