"""Where a checkpoint goes: one file that rank zero writes, or a sharded model's directory
that every rank writes its shards into (``_sharded``); now, or by the background thread
(``_background``); then the directory is pruned to the checkpoints kept."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .. import _ranks
from . import _files as files
from . import _sharded
from ._background import Background, staged


def write(
    state: dict[str, Any], directory: Path, number: int, keep: int, background: Background | None
) -> Path | None:
    """Write checkpoint ``number`` (replacing one of that number) and prune to ``keep``; its
    path on rank zero (None on the others). Raises on every rank alike if it was not written
    (a host-level exchange: no rank may read or prune before it is complete, and none goes
    on as if it were saved when it is not)."""
    path, error = _written(state, directory, number, keep, background)
    failed = _ranks.gather_objects(None if error is None else repr(error))[0]
    if error is not None:
        raise error
    if failed is not None:
        raise RuntimeError(f"rank 0 could not write the checkpoint: {failed}")
    return path


def _written(
    state: dict[str, Any], directory: Path, number: int, keep: int, background: Background | None
) -> tuple[Path | None, Exception | None]:
    """``write``'s writing: the path on rank zero (None on the others) and rank zero's
    error. A sharded model's state: every rank writes its shards (a collective, which raises
    on every rank alike when a rank cannot write its part). With ``background``: staged
    now, written by its thread (every rank starts one, so every rank waits for it alike)."""
    rank = _ranks.world()[0]
    if _sharded.holds_shards(state):
        where = files.path_for(directory, number, sharded=True)
        _sharded.write(state, where, background, lambda: files.prune(directory, keep, where))
        return (where if rank == 0 else None), None
    path = files.path_for(directory, number)
    if background is not None:
        copy = staged(state) if rank == 0 else None

        def written() -> None:
            if rank == 0:
                files.atomic_save(copy, path)
                files.prune(directory, keep, path)

        background.start(str(path), written)
        return (path if rank == 0 else None), None
    if rank != 0:
        return None, None
    try:
        files.atomic_save(state, path)
        files.prune(directory, keep, path)
    except Exception as err:
        return path, err
    return path, None
