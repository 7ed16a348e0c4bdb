"""FSDP2 as users configure it, on two ranks (dist_worker.py's fsdp2_options and
own_fully_shard, in the shared launch): wrap's fully_shard options, and a model the user
sharded with torch's own fully_shard or FSDP2's replicate through step, the Checkpointer,
a resume on another number of processes, the EMA, evaluate and export."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import elastic
import pytest
import torch
from torch import nn

import loopkit

EVERY_SAMPLE_ONCE = [list(range(elastic.SAMPLES))] * elastic.EPOCHS


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) > 0 and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _close(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))


def test_wrap_takes_fully_shards_options(dist_results: dict[str, Any]) -> None:
    """Each block but the last reshards after its forward by default, every one when told;
    mp_policy, offload_policy (pin_memory=False) and a 1-D mesh of the user's train as the
    hand-sharded model, bit for bit; a 2-D mesh is HSDP; a mesh of part of the job and a
    reshard size not dividing it are refused, the model left whole."""
    for found in dist_results["fsdp2_options"]:
        assert found["default"] == [True, True, False]
        assert found["given"] == [True, True, True]
        assert found["same"] and found["dtype"] == torch.bfloat16 and found["offloaded"]
        assert found["hsdp"] == ["R", "S(0)"]
        part, part_whole = found["refused"]["part"]
        assert "the mesh spans 1 ranks but this job has 2" in part and part_whole
        size, size_whole = found["refused"]["size"]
        assert "reshard_after_forward=3 does not divide the 2 ranks" in size and size_whole


@pytest.mark.parametrize("how", ["fully_shard", "replicate"])
def test_own_sharding_resumes_bit_identical(dist_results: dict[str, Any], how: str) -> None:
    """The user's own fully_shard (own mesh, last block kept after the forward) and FSDP2's
    replicate: accumulate, clipping, AdamW, a scheduler and an EMA, stopped after the save at
    update 4 and resumed by fresh objects, end bit-identical to the uninterrupted run; both
    train as wrap(fsdp=True) does within float rounding."""
    wrapped = dist_results["world_change"][0]["fsdp_whole"]
    for found in dist_results["own_fully_shard"]:
        whole, resumed = found[f"{how}_whole"], found[f"{how}_resumed"]
        assert resumed.resumed_from is not None
        assert resumed.resumed_from.startswith("ckpt-0000000004")
        assert whole.updates == resumed.updates == 6 and whole.lr == resumed.lr
        assert _equal(whole.weights, resumed.weights) and _equal(whole.ema, resumed.ema)
        assert resumed.norms == whole.norms[4:] and min(whole.norms) > 0.05  # every one clips
        assert _close(whole.weights, wrapped.weights) < 1e-6
        assert whole.norms == pytest.approx(wrapped.norms, rel=1e-6)


def test_own_fully_shard_changes_its_number_of_processes(
    dist_results: dict[str, Any], tmp_path: Path
) -> None:
    """Shrunk: the stopped 2-rank run of the user's own shards resumed by one plain process
    (reseed=True); grown: a 1-process checkpoint resumed into them. Each uses the samples of
    the uninterrupted run, every sample once an epoch, and ends at its weights."""
    found = dist_results["own_fully_shard"][0]
    shutil.copytree(Path(found["root"]) / "fully_shard_cut", tmp_path / "cut")
    shrunk = elastic.run(tmp_path / "cut", reseed=True)
    whole, cut = found["fully_shard_whole"], found["fully_shard_cut"]
    assert shrunk.resumed_from is not None and shrunk.resumed_from.startswith("ckpt-0000000004")
    assert shrunk.seen == whole.seen[4:]
    assert elastic.coverage(cut.seen, shrunk.seen, 4) == EVERY_SAMPLE_ONCE
    assert _close(shrunk.weights, whole.weights) < 1e-6 and _close(shrunk.ema, whole.ema) < 1e-6
    one = elastic.run(tmp_path / "one")
    stopped = elastic.run(tmp_path / "one_cut", stop=5)
    for r in dist_results["own_fully_shard"]:
        grown = r["grown"]
        assert grown.resumed_from is not None and grown.seen == one.seen[4:]
        assert elastic.coverage(stopped.seen, grown.seen, 4) == EVERY_SAMPLE_ONCE
        assert _close(grown.weights, one.weights) < 1e-6


def _per_sample(m: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
    x, y = batch
    return {"loss": torch.stack([nn.functional.mse_loss(m(x[i : i + 1]), y[i : i + 1])
                                 for i in range(len(x))])}  # fmt: skip


def test_own_fully_shard_evaluates_and_exports(dist_results: dict[str, Any]) -> None:
    """After a resume, evaluate (its first forward) and the EMA swapped in give one plain
    process's sums bit for bit, and a forward outside evaluate still runs; the exported
    weights and EMA load strictly into a plain model with the sharded model's outputs."""
    found = dist_results["own_fully_shard"][0]
    final = sorted((Path(found["root"]) / "fully_shard_whole").glob("ckpt-*"))[-1]
    samples = elastic.Indexed(13)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(samples.x, samples.y),
                                       batch_size=3)  # fmt: skip
    plain = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    plain.load_state_dict(loopkit.export_weights(final), strict=True)
    assert _equal([p.detach() for p in plain.parameters()], found["after"])
    expected = loopkit.evaluate(plain, data, _per_sample).sums
    plain.load_state_dict(loopkit.export_weights(final, ema=True), strict=True)
    expected_ema = loopkit.evaluate(plain, data, _per_sample).sums
    for r in dist_results["own_fully_shard"]:
        assert r["evaluated"] == expected and r["evaluated_ema"] == expected_ema
        assert torch.equal(r["sharded_out"], found["exported_out"])
        assert torch.equal(r["sharded_ema_out"], found["exported_ema_out"])
