"""export_weights and ``python -m loopkit.export``: a checkpoint's weights, whole, in one file."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import ROOT, batches, launch_env, loss_fn, mlp
from torch import nn

import loopkit


def _trained(tmp_path: Path) -> tuple[nn.Module, list[loopkit.ema], Path]:
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 1))
    averages = [loopkit.ema(model, decay=0.9), loopkit.ema(model, decay=0.5)]
    step = loopkit.step(model, torch.optim.AdamW(model.parameters(), lr=1e-2), ema=averages)
    for batch in step.iterate(batches([4, 4, 4])):
        with step as s:
            s.backward(loss_fn(model, batch))
    path = loopkit.Checkpointer(tmp_path, model=model, step=step).save()
    assert path is not None
    return model, averages, path


def test_the_weights_and_each_average_come_out_whole(tmp_path: Path) -> None:
    """The model's state_dict (buffers too) and each average with the buffers copied with it,
    by the model's own names, equal to the run's."""
    model, averages, path = _trained(tmp_path)
    weights = loopkit.export_weights(path)
    assert weights.keys() == model.state_dict().keys()
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())
    for k, average in enumerate(averages):
        exported = loopkit.export_weights(path, ema=k)
        shadow = average.named_shadow()
        assert all(torch.equal(exported[n], t) for n, t in shadow.items())
        assert torch.equal(exported["1.running_mean"], model[1].running_mean)
    assert torch.equal(loopkit.export_weights(path, ema=True)["0.weight"], averages[0].shadow[0])


def test_the_command_writes_a_file_weights_only_reads(tmp_path: Path) -> None:
    """python -m loopkit.export CHECKPOINT OUT --ema 1: one torch.load(weights_only=True)."""
    _, averages, path = _trained(tmp_path)
    out = tmp_path / "ema.pt"
    proc = subprocess.run(
        [sys.executable, "-m", "loopkit.export", str(path), str(out), "--ema", "1"],
        cwd=ROOT, env=launch_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    loaded = torch.load(out, weights_only=True)
    assert torch.equal(loaded["0.weight"], averages[1].shadow[0])


def test_a_checkpoint_without_an_average_says_so(tmp_path: Path) -> None:
    """ema=True on a checkpoint that holds none, or an index past those held: refused."""
    model = mlp()
    path = loopkit.Checkpointer(tmp_path, model=model).save()
    assert path is not None
    with pytest.raises(loopkit.CheckpointError, match="holds no ema"):
        loopkit.export_weights(path, ema=True)
    _, _, two = _trained(tmp_path / "two")
    with pytest.raises(loopkit.CheckpointError, match="ema=2 but the checkpoint holds 2"):
        loopkit.export_weights(two, ema=2)


def test_an_average_out_of_range_names_those_held(tmp_path: Path) -> None:
    """ema=2 of 2 averages (or 1 of 1): CheckpointError naming the ema= values that exist;
    ema=-1: ValueError (no negative index); ema="x": TypeError; nothing read in either."""
    _, _, two = _trained(tmp_path / "two")
    held = r"holds 2 averages: ema=0 or ema=1 \(or True for the first\)"
    with pytest.raises(loopkit.CheckpointError, match=held):
        loopkit.export_weights(two, ema=2)
    one = tmp_path / "one"
    model = mlp()
    average = loopkit.ema(model, decay=0.9)
    path = loopkit.Checkpointer(one, model=model, extra={"ema": average}).save()
    with pytest.raises(loopkit.CheckpointError, match=r"holds 1 average: ema=0 \(or True\)"):
        loopkit.export_weights(path, ema=1)
    with pytest.raises(ValueError, match=r"no negative index.*-1"):
        loopkit.export_weights(tmp_path / "nope.pt", ema=-1)
    with pytest.raises(TypeError, match="ema must be False, True or the index"):
        loopkit.export_weights(tmp_path / "nope.pt", ema="x")  # type: ignore[arg-type]
