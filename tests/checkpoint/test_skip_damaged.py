"""resume(skip_damaged=True): a damaged newest checkpoint is skipped for the newest readable
one, loudly; the run ends bit-identical to one resumed from that checkpoint; a checkpoint
that does not fit the run is never skipped; without the opt-in the error names it."""

from __future__ import annotations

import errno
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import assert_bit_equal, params
from torch import nn

import loopkit
from loopkit import distributed
from loopkit._checkpoint import _files, _owner, _sharded, _unreadable


@pytest.fixture(autouse=True)
def _released() -> None:
    """The directories the tests wrote are no one's (each test's runs are one job)."""
    _owner._RELEASER.release_all()


def _run(root: Path) -> dict[str, Any]:
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(48, 8), torch.randn(48, 1))
    loader = distributed.loader(data, batch_size=8, num_workers=0, seed=2)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Dropout(0.2), nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    step = loopkit.step(model, opt, scheduler=sched)
    ckpt = loopkit.Checkpointer(root, model=model, step=step, loader=loader, keep=10)
    return {"model": model, "loader": loader, "step": step, "ckpt": ckpt}


def _train(run: dict[str, Any], stop: int | None = None, **resume: Any) -> Path | None:
    """Resume (with ``resume``), train 2 epochs saving every 2 updates; end at ``stop``."""
    step, ckpt = run["step"], run["ckpt"]
    resumed = ckpt.resume(**resume)
    for _ in ckpt.epochs(2):
        for x, y in step.iterate(run["loader"]):
            with step as s:
                s.backward(nn.functional.mse_loss(run["model"](x), y))
            ckpt.maybe_save(every=2)
            if step.updates == stop:
                return resumed
    return resumed


def _damage(path: Path, how: str) -> None:
    data = path.read_bytes()
    if how == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif how == "garbage":
        path.write_bytes(random.Random(0).randbytes(len(data)))
    elif how == "no_format":  # a pickle of tensors only, no loopkit format: not a checkpoint
        torch.save({"weights": torch.ones(2)}, path)
    else:  # its bookkeeping (the metadata every file holds) out of range
        state = torch.load(path, weights_only=True)
        state["world_size"] = 0
        torch.save(state, path)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[torch.Tensor]]:
    """A run stopped at update 8 (checkpoints 2, 4, 6, 8) and the uninterrupted run's end."""
    root = tmp_path_factory.mktemp("skip")
    whole = _run(root / "whole")
    _train(whole)
    _train(_run(root / "cut"), stop=8)
    _owner._RELEASER.release_all()
    return root / "cut", params(whole["model"])


@pytest.mark.parametrize("how", ["truncated", "garbage", "no_format", "bookkeeping"])
def test_a_damaged_newest_is_skipped_and_the_run_ends_as_resumed_from_the_previous(
    how: str, saved: tuple[Path, list[torch.Tensor]], tmp_path: Path
) -> None:
    """The newest damaged: the opt-in resumes the previous one (update 6), warns naming the
    skipped file and its error, lists it in ckpt.damaged, moves it aside; the run ends
    bit-identical to a run resumed from update 6 by path (and to the uninterrupted run)."""
    cut, whole = saved
    shutil.copytree(cut, tmp_path / "a")
    shutil.copytree(cut, tmp_path / "b")
    newest = tmp_path / "a" / "ckpt-0000000008.pt"
    _damage(newest, how)
    run = _run(tmp_path / "a")
    with pytest.warns(loopkit.ResumeWarning) as warned:
        resumed = _train(run, skip_damaged=True)
    assert resumed == tmp_path / "a" / "ckpt-0000000006.pt"
    (said,) = [str(w.message) for w in warned if "skip_damaged" in str(w.message)]
    assert f"resumes the newest readable one, {resumed}" in said
    assert str(newest) in said and ("unreadable" in said or "damaged" in said
                                    or "not a loopkit checkpoint" in said)  # fmt: skip
    assert [p for p, _ in run["ckpt"].damaged] == [newest]
    assert run["ckpt"].damaged[0][1] in said
    assert len(list((tmp_path / "a").glob("abandoned-*/ckpt-0000000008.pt"))) == 1
    by_path = _run(tmp_path / "b")
    assert _train(by_path, path=tmp_path / "b" / "ckpt-0000000006.pt") is not None
    assert_bit_equal(params(run["model"]), params(by_path["model"]))
    assert_bit_equal(params(run["model"]), whole)


def test_without_the_opt_in_the_error_names_it_and_nothing_changes(
    saved: tuple[Path, list[torch.Tensor]], tmp_path: Path
) -> None:
    """A damaged newest without skip_damaged=True: CheckpointError naming the older ones,
    ckpt.resume(path) and ckpt.resume(skip_damaged=True); nothing moved or loaded."""
    shutil.copytree(saved[0], tmp_path / "a")
    _damage(tmp_path / "a" / "ckpt-0000000008.pt", "truncated")
    run = _run(tmp_path / "a")
    with pytest.raises(loopkit.CheckpointError) as info:
        run["ckpt"].resume()
    said = str(info.value)
    assert "ckpt.resume(skip_damaged=True)" in said and "ckpt-0000000006.pt" in said
    assert run["step"].updates == 0 and run["ckpt"].damaged == []
    assert not list((tmp_path / "a").glob("abandoned-*"))


def test_several_damaged_are_skipped_and_all_damaged_is_an_error(
    saved: tuple[Path, list[torch.Tensor]], tmp_path: Path
) -> None:
    """The two newest damaged: both skipped (newest first), the third resumed. Every one
    damaged: an error listing each, nothing resumed, nothing moved."""
    shutil.copytree(saved[0], tmp_path / "a")
    for n, how in ((8, "truncated"), (6, "garbage")):
        _damage(tmp_path / "a" / f"ckpt-{n:010d}.pt", how)
    run = _run(tmp_path / "a")
    with pytest.warns(loopkit.ResumeWarning, match="ckpt-0000000008.pt .*ckpt-0000000006.pt"):
        assert run["ckpt"].resume(skip_damaged=True) == tmp_path / "a" / "ckpt-0000000004.pt"
    assert [p.name for p, _ in run["ckpt"].damaged] == ["ckpt-0000000008.pt",
                                                        "ckpt-0000000006.pt"]  # fmt: skip
    _owner._RELEASER.release_all()
    shutil.copytree(saved[0], tmp_path / "c")
    for path in (tmp_path / "c").glob("ckpt-*"):
        _damage(path, "truncated")
    run = _run(tmp_path / "c")
    with pytest.raises(loopkit.CheckpointError, match=r"every checkpoint in .* is damaged"):
        run["ckpt"].resume(skip_damaged=True)
    assert run["step"].updates == 0 and not list((tmp_path / "c").glob("abandoned-*"))


def test_a_checkpoint_that_does_not_fit_the_run_is_never_skipped(
    saved: tuple[Path, list[torch.Tensor]], tmp_path: Path
) -> None:
    """A newest readable but written for another run (2 processes; another model): the
    opt-in raises that error as without it, and goes to no older checkpoint."""
    shutil.copytree(saved[0], tmp_path / "a")
    newest = tmp_path / "a" / "ckpt-0000000008.pt"
    state = torch.load(newest, weights_only=True)
    state["world_size"] = 2
    state["rng"] = state["rng"] * 2
    torch.save(state, newest)
    run = _run(tmp_path / "a")
    with pytest.raises(loopkit.CheckpointError, match="written by 2 process"):
        run["ckpt"].resume(skip_damaged=True)
    assert run["ckpt"].damaged == [] and run["step"].updates == 0
    with pytest.raises(TypeError, match="skip_damaged must be True or False"):
        run["ckpt"].resume(skip_damaged=1)


_KINDS = ("shard_deleted", "metadata", "loop")


def test_sharded_on_two_ranks_every_rank_skips_alike(dist_results: dict[str, Any]) -> None:
    """FSDP2 on 2 ranks (tests/dist_worker.py): the shard file only rank 1 reads deleted,
    DCP's metadata overwritten, loop.pt cut short: without the opt-in the error
    names it; with it both ranks resume update 6, rank 0 warns naming the skipped directory,
    and the run ends bit-identical to one resumed from update 6 by path. A directory another
    live job owns is refused on both ranks alike, naming it, and nothing is written."""
    ranks = dist_results["sharded_skip_damaged"]
    assert ranks[0]["base"] == ["ckpt-0000000003", "ckpt-0000000006", "ckpt-0000000008"]
    for rank, found in enumerate(ranks):
        assert all(found["same"]), found["same"]
        for kind in _KINDS:
            assert "ckpt.resume(skip_damaged=True)" in found[f"{kind}_refused"], kind
            assert [name for name, _ in found[f"{kind}_damaged"]] == ["ckpt-0000000008"], kind
            warned = found[f"{kind}_warned"]
            if rank == 0:
                (said,) = warned
                assert "ckpt-0000000006, and repeats the updates since" in said, said
                assert "ckpt-0000000008 (" in said and found[f"{kind}_damaged"][0][1] in said
            else:
                assert warned == [], kind
        assert "host node-b, pid 4242" in found["owned"] and "Slurm job 77" in found["owned"]
        assert found["owned"] == ranks[0]["owned"]
        assert found["owned_left"] == [".loopkit-owner-0000000001"]


_MACHINE_ERRORS = {
    "EIO": OSError(errno.EIO, "Input/output error"),
    "ESTALE": OSError(errno.ESTALE, "Stale file handle"),
    "EMFILE": OSError(errno.EMFILE, "Too many open files"),
    "MemoryError": MemoryError(),
    "host_oom": RuntimeError("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: "
                             "can't allocate memory: you tried to allocate 8589934592 bytes."),
    "cuda_oom": RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"),
}  # fmt: skip


@pytest.mark.parametrize("kind", sorted(_MACHINE_ERRORS))
def test_an_error_of_the_machine_is_raised_as_it_is_and_nothing_is_skipped(
    kind: str,
    saved: tuple[Path, list[torch.Tensor]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Reading the whole newest fails on an I/O error or out of memory: skip_damaged raises
    that very error, moves nothing aside, loads nothing; the next resume takes the newest."""
    shutil.copytree(saved[0], tmp_path / "a")
    newest = tmp_path / "a" / "ckpt-0000000008.pt"
    failure, real, calls = _MACHINE_ERRORS[kind], torch.load, []

    def flaky(f: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(str(f))
        if len(calls) == 1 and str(f) == str(newest):
            raise failure
        return real(f, *args, **kwargs)

    monkeypatch.setattr(_files.torch, "load", flaky)
    run = _run(tmp_path / "a")
    with pytest.raises(type(failure)) as info:
        run["ckpt"].resume(skip_damaged=True)
    assert info.value is failure and calls == [str(newest)]
    assert run["ckpt"].damaged == [] and run["step"].updates == 0
    assert not list((tmp_path / "a").glob("abandoned-*")) and newest.is_file()
    assert run["ckpt"].resume(skip_damaged=True) == newest and run["step"].updates == 8


class _Best:
    """A user's tracker whose state holds a numpy number once set."""

    def __init__(self) -> None:
        self.best: object = None

    def state_dict(self) -> dict[str, object]:
        return {"best": self.best}

    def load_state_dict(self, state: dict[str, object]) -> None:
        self.best = state["best"]


def test_a_numpy_number_in_an_extra_state_is_refused_not_skipped(tmp_path: Path) -> None:
    """A whole newest checkpoint holding a numpy scalar (weights_only refuses it): the
    opt-in raises the refusal naming it and the fix, skips nothing, moves nothing."""
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step, best = loopkit.step(model, opt), _Best()
    ckpt = loopkit.Checkpointer(tmp_path, model=model, step=step, extra={"best": best})
    for i in range(3):
        with step as s:
            s.backward(model(torch.ones(3, 2)).sum())
        best.best = np.float64(0.5) if i == 2 else None
        ckpt.save()
    _owner._RELEASER.release_all()
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = loopkit.step(model, opt)
    again = loopkit.Checkpointer(tmp_path, model=model, step=step, extra={"best": _Best()})
    with pytest.raises(loopkit.CheckpointError, match=r"ckpt-0000000003.pt: refused: it holds "
                       r"a numpy.*multiarray.scalar.*the file is whole.*float\(x\)"):  # fmt: skip
        again.resume(skip_damaged=True)
    assert again.damaged == [] and step.updates == 0
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == [
        "ckpt-0000000001.pt", "ckpt-0000000002.pt", "ckpt-0000000003.pt"]  # fmt: skip


def test_a_pickle_naming_no_known_class_is_damage(
    saved: tuple[Path, list[torch.Tensor]], tmp_path: Path
) -> None:
    """A byte garbled in a class's name inside the pickle (no such class here): damage, not
    a refusal of readable content; the opt-in skips it."""
    shutil.copytree(saved[0], tmp_path / "a")
    newest = tmp_path / "a" / "ckpt-0000000008.pt"
    data = newest.read_bytes()
    assert b"_rebuild_tensor_v2" in data
    newest.write_bytes(data.replace(b"_rebuild_tensor_v2", b"_rebuild_tensor_v9"))
    run = _run(tmp_path / "a")
    with pytest.warns(loopkit.ResumeWarning, match="ckpt-0000000008.pt"):
        assert run["ckpt"].resume(skip_damaged=True) == tmp_path / "a" / "ckpt-0000000006.pt"
    assert [p.name for p, _ in run["ckpt"].damaged] == ["ckpt-0000000008.pt"]


def _dcp_saved(root: Path) -> dict[str, torch.Tensor]:
    """A DCP checkpoint of two tensors in ``root`` (one process), and templates to read."""
    from torch.distributed.checkpoint import save

    with _sharded.single_process_read():
        save({"a": torch.arange(6.0), "b": torch.ones(3)}, checkpoint_id=str(root),
             no_dist=True)  # fmt: skip
    return {"a": torch.zeros(6), "b": torch.zeros(3)}


def _read(directory: Path, templates: dict[str, torch.Tensor]) -> None:
    """Read a sharded checkpoint's metadata, then its shards, as resume does."""
    damage = _unreadable.metadata_damage(directory)
    if damage is not None:
        raise _files.damaged(damage)
    _sharded.read_shards(directory, templates)


@pytest.mark.parametrize("where", ["read_data", "read_metadata"])
@pytest.mark.parametrize("kind", ["EIO", "host_oom", "cuda_oom", "MemoryError"])
def test_reading_shards_raises_the_machines_error_as_it_is(
    kind: str, where: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Reading DCP's metadata or shards failing on I/O or memory (DCP wraps it in its own
    exception): that error is raised as it is, not marked damaged."""
    from torch.distributed.checkpoint import FileSystemReader

    templates = _dcp_saved(tmp_path)
    failure = _MACHINE_ERRORS[kind]

    def failing(*args: Any, **kwargs: Any) -> Any:
        raise failure

    monkeypatch.setattr(FileSystemReader, where, failing)
    with pytest.raises(type(failure)) as info:
        _read(tmp_path, templates)
    assert str(info.value) == str(failure) and not _files.is_damaged(info.value)


@pytest.mark.parametrize("how", ["shard_deleted", "shard_truncated", "metadata", "no_metadata"])
def test_reading_damaged_shards_is_damage(how: str, tmp_path: Path) -> None:
    """A shard file missing or cut short, DCP's metadata overwritten or missing: a
    CheckpointError marked damaged, naming the checkpoint."""
    templates = _dcp_saved(tmp_path)
    (shard,) = tmp_path.glob("*.distcp")
    if how == "shard_deleted":
        shard.unlink()
    elif how == "shard_truncated":
        shard.write_bytes(shard.read_bytes()[:40])
    elif how == "metadata":
        (tmp_path / ".metadata").write_bytes(b"\x80\x04not metadata" * 8)
    else:
        (tmp_path / ".metadata").unlink()
    with pytest.raises(loopkit.CheckpointError, match="unreadable") as info:
        _read(tmp_path, templates)
    assert _files.is_damaged(info.value) and str(tmp_path) in str(info.value)
