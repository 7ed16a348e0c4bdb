"""Under torchrun: local rank 0 opens or builds the cache while the node's other ranks wait.

They do not wait inside a collective, which the process group's timeout bounds (a build
of a real data set easily takes longer, and would kill them): they poll a small file,
``.<name>.job-<token>-r<rank>`` in the cache root, in which local rank 0 (global rank
``rank``) says that it is working (and its pid), then where the cache is, or why it
failed. The token, drawn by rank 0 and shared in one quick collective as ``preload``
starts, tells this call's file from an earlier one's; the same collective says where each
rank runs (``Handoff``), so a rank finds its node's local rank 0 whatever the numbering
(torchrun numbers a node's ranks in a row, ``srun -m cyclic`` does not) and two nodes
whose builders share a directory, even under one host name, never read each other's
file. Local rank 0's final word also goes to the job's store, which a
waiter reads at every poll: it raises with local rank 0's error as soon as it is posted,
even when the file still says "working" (a full disk: local rank 0 cannot rewrite it),
and if local rank 0 died without finishing (its pid is gone), so none waits forever.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import secrets
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .. import _ranks

_MAX_POLL_S = 1.0


@dataclasses.dataclass(frozen=True)
class Handoff:
    """What one ``preload`` call's ranks share: its token and where each rank runs."""

    token: str
    """Drawn by rank 0; "" in a single process."""
    places: tuple[tuple[str, int], ...] = ()
    """Each rank's node (``node()``) and local rank, in rank order."""

    def builder(self, rank: int) -> int:
        """The global rank of the local rank 0 of ``rank``'s node: the process it waits for."""
        node, local = self.places[rank]
        first = rank - local  # torchrun's layout: a node's ranks in a row
        if local == 0 or (0 <= first < len(self.places) and self.places[first] == (node, 0)):
            return first
        found = [r for r, place in enumerate(self.places) if place == (node, 0)]
        if len(found) != 1:
            raise RuntimeError(
                f"preload: rank {rank} (local rank {local} on {node}) cannot tell which process "
                f"of its node builds the cache: {len(found)} processes there have local rank "
                "0. The launcher must give a node's processes the local ranks 0, 1, ... once "
                "each (LOCAL_RANK)"
            )
        return found[0]


def node() -> str:
    """Where this process runs: its host, and the launcher's number for its node if it sets
    one (torchrun's ``GROUP_RANK``, Slurm's ``SLURM_NODEID``): nodes may share a host name."""
    number = os.environ.get("GROUP_RANK", os.environ.get("SLURM_NODEID", ""))
    return f"{socket.gethostname()}#{number}" if number else socket.gethostname()


def job_token(local_rank: int = 0) -> Handoff:
    """This call's token and every rank's place, in one quick collective (none in a single
    process); ``local_rank``: this process's, as ``preload`` chose its builder by it."""
    if not _ranks.is_multi_rank():
        return Handoff("")
    every = _ranks.gather_objects((secrets.token_hex(8), node(), local_rank))
    return Handoff(str(every[0][0]), tuple((str(n), int(r)) for _, n, r in every))


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def _path(directory: Path, name: str, token: str, rank: int) -> Path:
    return directory / f".{name}.job-{token}-r{rank}"


class Announcer:
    """Local rank 0's side: says what it is doing, in a file the node's other ranks poll."""

    def __init__(self, directory: Path, name: str, token: str, rank: int) -> None:
        self.path = _path(directory, name, token, rank)

    def say(self, state: str, **more: str) -> None:
        said = {"state": state, "pid": os.getpid(), "pid_ns": _pid_namespace(), **more}
        tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.fchmod(fd, 0o600)  # O_CREAT's mode is cut by the umask: owner-only, whatever it is
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


def _failed(error: str) -> RuntimeError:
    """Local rank 0's error as a waiter raises it (the same whichever way it arrived)."""
    return RuntimeError(f"preload: local rank 0 could not build or open the cache: {error}")


def wait_for(
    directory: Path,
    name: str,
    token: str,
    builder: int,
    outcome: Callable[[], str | None] = lambda: None,
) -> Path:
    """The cache's path once local rank 0 (global rank ``builder``) says it is ready; raises
    what it says if it failed.

    ``outcome``: local rank 0's final word if it has one (its error, "" when it succeeded),
    posted in the job's store. It is read first at every poll: a failure reaches the
    waiters whether or not local rank 0 could write it into the file (no root, a full disk).
    """
    path = _path(directory, name, token, builder)
    delay = 0.02
    while True:
        final = outcome()
        if final:
            raise _failed(final)
        said = _read(path)
        if said is not None:
            if said.get("state") == "ready":
                return Path(str(said.get("path")))
            if said.get("state") == "failed":
                raise _failed(str(said.get("error")))
            if _gone(said):
                raise RuntimeError(
                    f"preload: local rank 0 (pid {said.get('pid')}) ended without finishing "
                    "the cache: see its output for why"
                )
        time.sleep(delay)  # bounded: a finished build is seen within a second
        delay = min(delay * 1.5, _MAX_POLL_S)


def _outcome(token: str, rank: int) -> str:
    return f"preload/{token}/outcome/{rank}"


def builder_error(token: str, rank: int) -> str | None:
    """The error ``rank`` (a node's local rank 0) posted ("" if none), or None if not yet."""
    posted = _ranks.read_post(_outcome(token, rank))
    return None if posted is None else str(json.loads(posted)["error"])


def agree(
    failure: Exception | None,
    cache: tuple[Path, str] | None,
    announcer: Announcer | None,
    token: str,
    rank: int,
    world: int,
) -> None:
    """Every rank's outcome, once all have one: all raise if one failed or the nodes differ.

    ``cache``: the cache this rank got and what it holds (``_cache_files.contents``). The
    nodes' caches must hold the same data: each node's local rank 0 built (or found) its
    own from that node's copy of the data set. Through the job's store, not a collective:
    on another node a build may still be running (a fresh node without the cache), and a
    collective would time out waiting for it. A rank that failed returns, to raise its own
    exception unchanged; the last rank to read the outcomes deletes their keys.
    """
    report = {"error": "" if failure is None else f"{type(failure).__name__}: {failure}",
              "cache": "", "holds": "", "host": socket.gethostname()}  # fmt: skip
    if failure is None and cache is not None:
        report.update(cache=str(cache[0]), holds=cache[1])
    keys = [_outcome(token, r) for r in range(world)]
    _ranks.post(keys[rank], json.dumps(report))
    try:
        reports = [json.loads(posted) for posted in _ranks.wait_posts(keys)]
        _ranks.done_reading(keys, f"preload/{token}/read", world)
    except Exception:
        if failure is None:
            raise
        return  # this rank's own error says more than the exchange's: preload raises it
    finally:
        if announcer is not None:
            announcer.remove()
    if failure is not None:
        return
    failed = [(r, p["error"]) for r, p in enumerate(reports) if p["error"]]
    if failed:
        r, what = failed[0]
        raise RuntimeError(f"preload: rank {r} could not build or open the cache: {what}")
    held: dict[str, list[int]] = {}
    for r, p in enumerate(reports):
        held.setdefault(p["holds"], []).append(r)
    if len(held) > 1:
        nodes = "; ".join(
            f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} read "
            f"{reports[ranks[0]]['cache']} on {reports[ranks[0]]['host']} (contents {holds})"
            for holds, ranks in held.items()
        )
        raise RuntimeError(
            f"preload: the nodes' caches hold different data ({nodes}): each node's local "
            "rank 0 built its cache from that node's copy of the data set, and these copies "
            "differ. Make every node's data (and transform) the same, then run again"
        )
