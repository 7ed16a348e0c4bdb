"""A sharded (FSDP2) checkpoint saved again at its update is replaced, as a one-file one is.

A directory cannot be renamed over another: the old one is renamed aside, the new one takes
the name, the old one is deleted; a resume puts back an old one whose writer died between
the renames. The 2-rank runs are ``dist_worker.py``'s ``sharded_resave``, the 4-rank HSDP
ones ``dist4_worker.py``'s ``hsdp_resave``; the kills at each point of the replacement are
``test_files.py``'s.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import loopkit


class Tag:
    """A number saved under extra=: which of two saves of one update a resume found."""

    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict[str, int]:
        return {"n": self.n}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.n = state["n"]


def _build(
    root: Path, *, shard: bool = True, async_save: bool = False, train: bool = True
) -> tuple[Any, ...]:
    """FSDP2 over each Linear (one rank) unless not ``shard``, AdamW, a Tag: the model, step,
    tag and Checkpointer, trained 2 updates if ``train``."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    for layer in (model[0], model[2], model) if shard else ():
        fully_shard(layer)
    step = loopkit.step(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    tag = Tag()
    ckpt = loopkit.Checkpointer(root, model=model, step=step, extra={"tag": tag},
                                async_save=async_save)  # fmt: skip
    for i in range(2 if train else 0):
        with step as s:
            x = torch.randn(6, 4, generator=torch.Generator().manual_seed(i))
            s.backward(model(x).pow(2).mean())
    return model, step, tag, ckpt


def _whole(model: nn.Module) -> list[torch.Tensor]:
    return [getattr(p, "full_tensor", p.detach)() for p in model.parameters()]


@pytest.mark.parametrize("async_save", [False, True])
def test_a_resave_dying_between_its_renames_resumes_the_old_checkpoint(
    tmp_path: Path, process_group: None, monkeypatch: pytest.MonkeyPatch, async_save: bool
) -> None:
    """Update 2 saved, then saved again by a writer that dies once the old directory is
    renamed aside (no rename works after it): no ckpt-2 is listed, yet a resume finds the
    old one, whole (its tag, its weights); after the next save nothing is left beside the
    checkpoints (nothing aside, no temporary)."""
    root = tmp_path / "run"
    model, _, tag, ckpt = _build(root, async_save=async_save)
    tag.n = 1
    ckpt.save()
    ckpt.wait()
    tag.n = 2
    rename, dead = os.rename, []

    def dies_once_the_old_is_aside(src: Any, dst: Any) -> None:
        if dead:
            raise OSError("the writer is dead")
        rename(src, dst)
        if ".old-" in str(dst):
            dead.append(dst)

    with monkeypatch.context() as patched:
        patched.setattr(os, "rename", dies_once_the_old_is_aside)
        with pytest.raises((OSError, RuntimeError), match="the writer is dead"):
            ckpt.save()
            ckpt.wait()
    assert len(dead) == 1 and ckpt.checkpoints() == []
    fresh_model, _, fresh_tag, fresh = _build(root, async_save=async_save, train=False)
    assert fresh.resume() == root / "ckpt-0000000002" and fresh_tag.n == 1
    assert all(torch.equal(a, b) for a, b in zip(_whole(model), _whole(fresh_model), strict=True))
    with fresh.step as s:
        s.backward(fresh_model(torch.randn(6, 4)).pow(2).mean())
    fresh.save()
    fresh.wait()
    left = sorted(p.name for p in root.iterdir() if not p.name.startswith(".loopkit-owner"))
    assert left == ["ckpt-0000000002", "ckpt-0000000003"]


def test_a_save_replaces_the_checkpoint_of_the_other_kind_at_its_update(
    tmp_path: Path, process_group: None
) -> None:
    """A one-file checkpoint of update 2, then a sharded save of update 2 (a run resumed on
    another number of processes): the directory replaces the file, which a resume would
    otherwise have taken (it sorts last); and the other way round. Each update counts once
    for keep=."""
    _, _, tag, ckpt = _build(tmp_path / "run", shard=False)
    tag.n = 1
    ckpt.save()
    _, _, tag, sharded = _build(tmp_path / "run")
    tag.n = 2
    sharded.save()
    assert [p.name for p in sharded.checkpoints()] == ["ckpt-0000000002"]
    _, _, tag, ckpt = _build(tmp_path / "run", shard=False)
    tag.n = 3
    ckpt.save()
    assert [p.name for p in ckpt.checkpoints()] == ["ckpt-0000000002.pt"]
    _, _, tag, reader = _build(tmp_path / "run", shard=False)
    assert reader.resume() is not None and tag.n == 3


def test_a_sharded_checkpoint_saved_again_at_its_update_is_replaced_on_two_ranks(
    dist_results: dict[str, Any],
) -> None:
    """dist_worker's 2-rank FSDP2 run, saving synchronously and in the background: update 2
    saved again after a skipped window and update 4 saved three times, each replacing the
    last; fresh objects resume update 4 bit-identical (weights, moments, the skip counted)
    and update 2 as its second save left it. A background re-save whose shards rank 1
    cannot write is raised on both ranks, naming it and the cause; update 4 stays whole."""
    names = ["ckpt-0000000002", "ckpt-0000000003", "ckpt-0000000004"]
    for r in dist_results["sharded_resave"]:
        for mode in ("sync", "async"):
            found = r[mode]
            assert found["names"] == names and found["same"], (mode, found)
            assert found["skipped"] == (1, 1) and found["updates"] == (4, 4)
            assert found["older"] == (2, 1)
        found = r["async"]
        assert found["failed"] is not None, found
        assert "ckpt-0000000004 (rank 1's shards): File too large" in found["failed"]
        assert found["after"] == names and found["after_same"]


def test_an_hsdp_checkpoint_saved_again_at_its_update_is_replaced(
    dist4_results: dict[str, Any],
) -> None:
    """dist4_worker's HSDP run (a 2x2 mesh) saving update 2 three times, synchronously and
    in the background: one checkpoint left, which fresh objects resume (weights, EMA)."""
    for r in dist4_results["hsdp_resave"]:
        for mode in ("sync", "async"):
            assert r[mode] == {"names": ["ckpt-0000000002"], "resumed": "ckpt-0000000002",
                               "same": True}, (mode, r[mode])  # fmt: skip
