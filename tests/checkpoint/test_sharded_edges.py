"""Sharded (FSDP2) checkpoints at their edges: an optimizer under extra=, keys holding the
separator '/', a checkpoint directory copied under another name, a one-file checkpoint of
the unsharded model resumed sharded; the 2-rank runs are ``dist_worker.py``'s
``sharded_edges`` (other numbers of processes: ``test_world_change.py``).

FSDP2 on a one-process group (``process_group``) shards over one rank: its parameters,
optimizer moments and EMA are DTensors, so the Checkpointer writes and reads them through
``torch.distributed.checkpoint`` as on many ranks, with no process launched.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import loopkit
from loopkit._checkpoint import _export, _sharded


class Named(nn.Module):
    """Two linear layers kept in a ModuleDict under ``enc`` (or ``enc/0``, a key with a '/')."""

    def __init__(self, slash: bool) -> None:
        super().__init__()
        self.first = "enc/0" if slash else "enc"
        self.d = nn.ModuleDict({self.first: nn.Linear(4, 8), "dec": nn.Linear(8, 2)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.d["dec"](torch.tanh(self.d[self.first](x)))  # type: ignore[no-any-return]


@dataclass
class Run:
    model: nn.Module
    opt: torch.optim.Optimizer
    average: loopkit.ema
    step: loopkit.step
    ckpt: loopkit.Checkpointer


def _build(root: Path, *, slash: bool, opt_in_extra: bool, shard: bool = True) -> Run:
    """FSDP2 over each Linear (unless not ``shard``), AdamW, an EMA under extra=
    (``"ema/teacher"`` with ``slash``), the optimizer under extra= (``opt_in_extra``) or
    saved with the step."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = Named(slash)
    for layer in [*model.d.values(), model] if shard else []:
        fully_shard(layer)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    average = loopkit.ema(model, decay=0.9)
    step = loopkit.step(model, opt)
    extra: dict[str, Any] = {"ema/teacher" if slash else "teacher": average}
    if opt_in_extra:
        extra["opt"] = opt
    return Run(model, opt, average, step, loopkit.Checkpointer(root, model=model, step=step,
                                                               extra=extra))  # fmt: skip


def _train(run: Run, first: int, n: int, rows: int = 6) -> None:
    for i in range(first, first + n):
        x = torch.randn(rows, 4, generator=torch.Generator().manual_seed(i))
        with run.step as s:
            s.backward(run.model(x).pow(2).mean())
        run.average.update()


def _state(run: Run) -> list[torch.Tensor]:
    """The weights, the EMA and Adam's moments, whole."""
    moments = [s[k] for s in run.opt.state.values() for k in ("exp_avg", "exp_avg_sq")]
    tensors = [*run.model.parameters(), *run.average.state_dict()["shadow"].values(), *moments]
    return [t.full_tensor() if isinstance(t, torch.distributed.tensor.DTensor) else t
            for t in tensors]  # fmt: skip


def _saved_then_resumed(root: Path, **how: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """A run saved after 3 updates and ended after 5, and fresh objects resumed from its
    save and trained the same 2 updates: both states."""
    run = _build(root, **how)
    _train(run, 0, 3)
    run.ckpt.save()
    _train(run, 3, 2)
    fresh = _build(root, **how)
    assert fresh.ckpt.resume() is not None and fresh.step.updates == 3
    _train(fresh, 3, 2)
    return _state(run), _state(fresh)


def _assert_same(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b) == 16  # 4 parameters, their 4 averages, 2 moments each
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_an_optimizer_under_extra_resumes_into_a_fresh_run(
    tmp_path: Path, process_group: None
) -> None:
    """Checkpointer(extra={"opt": opt}) of an FSDP2 model: a fresh run (no optimizer state
    before its first step) resumes it and ends bit-identical, moments included."""
    whole, resumed = _saved_then_resumed(tmp_path, slash=False, opt_in_extra=True)
    _assert_same(whole, resumed)


def test_keys_with_a_slash_resume_into_a_fresh_run(tmp_path: Path, process_group: None) -> None:
    """A ModuleDict key "enc/0" and extra={"ema/teacher": ...}: resumed bit-identical, each
    tensor under a DCP key of its own with the '/' of a name escaped."""
    whole, resumed = _saved_then_resumed(tmp_path, slash=True, opt_in_extra=False)
    _assert_same(whole, resumed)
    saved = loopkit.load_checkpoint(sorted(tmp_path.glob("ckpt-*"))[-1])
    keys = set(_sharded.placeholders(saved))
    assert "extra/ema%2Fteacher/shadow/d.enc%2F0.weight" in keys
    assert "model/d.enc%2F0.weight" in keys and len(keys) == 16


def test_dcp_keys_are_one_per_path() -> None:
    """Paths that join alike ('a/b' + 'c', 'a' + 'b/c', a literal '%2F') get other keys."""
    paths = [("a/b", "c"), ("a", "b/c"), ("a", "b", "c"), ("a%2Fb", "c"), ("a%", "2Fb", "c")]
    assert len({_sharded._key(p) for p in paths}) == len(paths)


def test_keys_alike_as_text_are_refused(process_group: None) -> None:
    """An int key and a str key that read alike in one dict of sharded tensors: refused when
    split for the save, naming the clash."""
    from torch.distributed.fsdp import fully_shard

    layer = nn.Linear(2, 2)
    fully_shard(layer)
    with pytest.raises(loopkit.CheckpointError, match="both at 'x/0'"):
        _sharded.split({"x": {0: layer.weight, "0": layer.bias}})


def test_a_checkpoint_with_unescaped_keys_still_resumes(
    tmp_path: Path, process_group: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Written with DCP keys joined by '/' unescaped (before the escaping), even with '/' in
    names: a resume finds each tensor by its place in loop.pt, bit-identical."""
    run = _build(tmp_path, slash=True, opt_in_extra=True)
    _train(run, 0, 3)
    with monkeypatch.context() as patched:
        patched.setattr(_sharded, "_key", "/".join)
        run.ckpt.save()
    saved = loopkit.load_checkpoint(sorted(tmp_path.glob("ckpt-*"))[-1])
    assert "extra/ema/teacher/shadow/d.enc/0.weight" in _sharded.placeholders(saved)
    _train(run, 3, 2)
    fresh = _build(tmp_path, slash=True, opt_in_extra=True)
    fresh.ckpt.resume()
    _train(fresh, 3, 2)
    _assert_same(_state(run), _state(fresh))


def test_a_renamed_checkpoint_directory_is_a_checkpoint(
    tmp_path: Path, process_group: None
) -> None:
    """A sharded checkpoint copied to final/: export_weights, python -m loopkit.export and
    ckpt.resume(path) read it as under its own name; a directory without loop.pt is refused
    as not a checkpoint."""
    run = _build(tmp_path / "run", slash=False, opt_in_extra=False)
    _train(run, 0, 3)
    path = run.ckpt.save()
    assert path is not None and path.is_dir()
    final = tmp_path / "final"
    shutil.copytree(path, final)
    names = [n for n, _ in run.model.named_parameters()]
    weights = loopkit.export_weights(final)
    assert all(torch.equal(weights[n], p.full_tensor())
               for n, p in zip(names, run.model.parameters(), strict=True))  # fmt: skip
    average = loopkit.export_weights(final, ema=True)
    shadow = run.average.state_dict()["shadow"]
    assert all(torch.equal(average[n], shadow[n].full_tensor()) for n in names)
    assert _export.main([str(final), str(tmp_path / "out.pt")]) == 0
    out = torch.load(tmp_path / "out.pt", weights_only=True)
    assert out.keys() == weights.keys() and all(torch.equal(out[k], weights[k]) for k in out)
    _train(run, 3, 2)
    fresh = _build(tmp_path / "fresh", slash=False, opt_in_extra=False)
    assert fresh.ckpt.resume(final) == final and fresh.step.updates == 3
    _train(fresh, 3, 2)
    _assert_same(_state(run), _state(fresh))
    (tmp_path / "empty").mkdir()
    with pytest.raises(loopkit.CheckpointError, match=r"without loop\.pt, so not a checkpoint"):
        loopkit.export_weights(tmp_path / "empty")


def test_a_two_rank_save_resumes_on_one_process_under_another_name(
    dist_results: dict[str, Any], tmp_path: Path
) -> None:
    """dist_worker's 2-rank FSDP2 save (keys with '/', AdamW under extra=), resumed bit-identical
    there by fresh objects, copied to final/ and resumed here by one unsharded process
    (reseed=True): its end within float rounding of the 2-rank run's."""
    found = dist_results["sharded_edges"]
    assert all(r["same"] and r["resumed"] == "ckpt-0000000003" for r in found)
    final = tmp_path / "final"
    shutil.copytree(found[0]["path"], final)
    run = _build(tmp_path / "run", slash=True, opt_in_extra=True, shard=False)
    assert run.ckpt.resume(final, reseed=True) == final and run.step.updates == 3
    _train(run, 3, 2, rows=12)  # each update: both ranks' 6 rows
    ended = _state(run)
    assert len(ended) == len(found[0]["ended"]) == 16
    diff = [(a - b).abs().max().item() for a, b in zip(ended, found[0]["ended"], strict=True)]
    assert max(diff) < 1e-6


def _resumed_state(run: Run) -> list[torch.Tensor]:
    """The weights, the EMA, Adam's moments and steps, whole, and the step's count."""
    steps = [s["step"] for s in run.opt.state.values()]
    return [*_state(run), *steps, torch.tensor(run.step.updates)]


def test_a_one_file_checkpoint_resumes_into_a_sharded_model(
    tmp_path: Path, process_group: None
) -> None:
    """Written by an unsharded model (one file), resumed by the same model sharded by FSDP2:
    right after the resume its weights, EMA, Adam's moments and counts are the unsharded
    resume's, bit for bit, and 2 more updates end alike; another width is refused naming the
    shapes, nothing loaded."""
    plain = _build(tmp_path, slash=True, opt_in_extra=True, shard=False)
    _train(plain, 0, 3)
    path = plain.ckpt.save()
    assert path is not None and path.is_file()
    again = _build(tmp_path, slash=True, opt_in_extra=True, shard=False)
    sharded = _build(tmp_path, slash=True, opt_in_extra=True)
    assert again.ckpt.resume() == sharded.ckpt.resume() == path
    assert isinstance(next(sharded.model.parameters()), torch.distributed.tensor.DTensor)
    _assert_exact(_resumed_state(again), _resumed_state(sharded))
    _train(again, 3, 2)
    _train(sharded, 3, 2)
    _assert_same(_state(again), _state(sharded))


def test_a_sharded_run_maps_a_one_file_checkpoint_and_keeps_nothing_of_the_mapping(
    tmp_path: Path, process_group: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Resumed by an FSDP2 model, a one-file checkpoint is mapped, not read (a rank reads only
    its parts' pages); once resumed no tensor of the run is backed by the file (Linux)."""
    import gc

    from torch.utils.serialization import config

    plain = _build(tmp_path, slash=False, opt_in_extra=False, shard=False)
    _train(plain, 0, 3)
    path = plain.ckpt.save()
    mapped: list[bool] = []
    load = torch.load

    def spied(*args: Any, **kwargs: Any) -> Any:
        mapped.append(config.load.mmap)
        return load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", spied)
    _build(tmp_path, slash=False, opt_in_extra=False, shard=False).ckpt.resume()
    sharded = _build(tmp_path, slash=False, opt_in_extra=False)
    assert sharded.ckpt.resume() == path
    assert mapped == [False, True] and not config.load.mmap
    gc.collect()
    maps = Path("/proc/self/maps")
    if maps.exists():
        assert str(path) not in maps.read_text()


def _assert_exact(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b) == 16 + 4 + 1  # and Adam's 4 steps, the step's count
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_a_one_file_checkpoint_of_another_model_is_refused_by_a_sharded_one(
    tmp_path: Path, process_group: None
) -> None:
    """A one-file checkpoint of other widths, resumed by an FSDP2 model: CheckpointError
    naming the shapes, before anything loads."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    small = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 2))
    loopkit.Checkpointer(tmp_path, model=small).save()
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    for layer in (*model, model):
        fully_shard(layer)
    before = [p.full_tensor() for p in model.parameters()]
    with pytest.raises(loopkit.CheckpointError, match=r"shape mismatch .*\(6, 4\) saved"):
        loopkit.Checkpointer(tmp_path, model=model).resume()
    after = [p.full_tensor() for p in model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
