"""Removing preload caches: Preloaded.remove() and python -m loopkit.preload_caches."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import ROOT, deep

import loopkit
from loopkit._data import _cache_admin


def _data(n: int, salt: float = 0.0) -> torch.utils.data.TensorDataset:
    return torch.utils.data.TensorDataset(torch.arange(float(n)) + salt)


def test_remove_deletes_the_cache_and_the_next_preload_rebuilds(tmp_path: Path) -> None:
    """remove(): the directory is gone (True), a second remove says False, the mapped items
    stay readable in this process, and preload builds the cache again."""
    cache = loopkit.preload(_data(6), tmp_path, key="nums")
    path = cache.path
    assert cache.remove() is True
    assert not path.exists() and list(tmp_path.iterdir()) == []
    assert cache.remove() is False
    assert float(cache[5][0]) == 5.0  # still mapped here
    again = loopkit.preload(_data(6), tmp_path, key="nums")
    assert again.built and again.path == path


def test_remove_refuses_what_is_not_a_complete_cache_of_this_user(tmp_path: Path) -> None:
    """A directory without meta.json is refused, naming it, and left as it was."""
    stray = tmp_path / "mine-0123"
    stray.mkdir()
    (stray / "notes.txt").write_text("keep me")
    with pytest.raises(ValueError, match="not a complete preload cache"):
        _cache_admin.remove(stray)
    assert (stray / "notes.txt").read_text() == "keep me"


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "loopkit.preload_caches", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip


@deep
def test_the_command_lists_and_prunes_with_a_dry_run_first(tmp_path: Path) -> None:
    """list names each cache (key, items, path); prune --older-than is a dry run until --yes,
    and removes only the caches older than asked."""
    old = loopkit.preload(_data(4), tmp_path, key="old")
    new = loopkit.preload(_data(9, salt=1), tmp_path, key="new")
    week_ago = time.time() - 7 * 86400
    os.utime(old.path / "meta.json", (week_ago, week_ago))
    listed = _cli("list", "--root", str(tmp_path))
    assert listed.returncode == 0, listed.stderr
    lines = listed.stdout.splitlines()
    assert lines[0].startswith("old\t4 items") and lines[0].endswith(str(old.path))
    assert lines[1].startswith("new\t9 items") and lines[1].endswith(str(new.path))
    dry = _cli("prune", "--root", str(tmp_path), "--older-than", "1")
    assert dry.returncode == 0 and "would remove" in dry.stdout and old.path.exists()
    done = _cli("prune", "--root", str(tmp_path), "--older-than", "1", "--yes")
    assert done.returncode == 0 and "removed" in done.stdout
    assert not old.path.exists() and new.path.exists()
    assert _cli("prune", "--root", str(tmp_path)).returncode == 2  # --older-than or --all
