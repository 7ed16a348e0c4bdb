"""evaluate: sample-weighted means, eval mode and RNG put back, one host read, DDP untouched.

The 2-process case (7 samples, batch 2: bit-identical sums) is in test_evaluate_ddp.py.
"""

from __future__ import annotations

import itertools
import random
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
import torch
from helpers import ROOT, deep, launch_env
from torch import nn

import loopkit
from loopkit import distributed
from loopkit._control._evaluate import real_samples

Batch = tuple[torch.Tensor, torch.Tensor]


def per_sample(model: nn.Module, batch: Batch) -> dict[str, torch.Tensor]:
    x, y = batch
    out = model(x)
    return {"loss": (out.float() - y).pow(2).mean(1), "big": (out.float() > 0).float()[:, 0]}


def _data(n: int = 7) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(n, 4, generator=g), torch.randn(n, 1, generator=g)
    return torch.utils.data.TensorDataset(x, y)


def test_real_samples_partition_the_data_set() -> None:
    """DistributedSampler's real (unpadded) samples per rank add up to the data set."""
    for n in range(1, 30):
        for world in range(1, 6):
            counts = [real_samples(r, world, n) for r in range(world)]
            assert sum(counts) == n and max(counts) - min(counts) <= 1


def test_sample_weighted_means_of_uneven_batches() -> None:
    """Batches of 3, 3, 1: the mean over samples, not over batch means; sums in float64."""
    model = nn.Linear(4, 1)
    data = _data()
    loader = torch.utils.data.DataLoader(data, batch_size=3)
    result = loopkit.evaluate(model, loader, per_sample, precision="fp32")
    with torch.no_grad():
        full = per_sample(model, data.tensors)
        batch_means = [per_sample(model, b)["loss"].mean().item() for b in loader]
    assert result.samples == 7
    assert result["loss"] == pytest.approx(full["loss"].double().mean().item(), rel=1e-6)
    assert result.sums["big"] == full["big"].sum().item()
    assert abs(result["loss"] - sum(batch_means) / 3) > 1e-3  # what a naive mean would say


def test_modes_and_rng_are_put_back_and_inference_mode_is_on() -> None:
    """Mixed train/eval submodules come back as they were; the RNGs draw as if it never ran."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5), nn.BatchNorm1d(4), nn.Linear(4, 1))
    model.train()
    model[2].eval()  # a frozen BatchNorm, as fine-tuning code keeps it
    seen: list[Any] = []

    def fn(m: nn.Module, batch: Batch) -> dict[str, torch.Tensor]:
        seen.append((torch.is_inference_mode_enabled(), [s.training for s in m.modules()]))
        torch.rand(3), random.random(), np.random.rand()  # an fn that draws
        return per_sample(m, batch)

    state = (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy())
    loopkit.evaluate(model, torch.utils.data.DataLoader(_data(), batch_size=4), fn)
    assert all(on and not any(modes) for on, modes in seen) and len(seen) == 2
    assert [m.training for m in model.modules()] == [True, True, True, False, True]
    assert torch.equal(torch.get_rng_state(), state[0]) and random.getstate() == state[1]
    assert np.array_equal(np.random.get_state()[1], state[2])


def test_an_error_in_fn_still_puts_the_modes_back() -> None:
    """fn raising on the second batch: the error propagates, the model is in train mode."""
    model = nn.Linear(4, 1)
    calls = []

    def fn(m: nn.Module, batch: Batch) -> dict[str, torch.Tensor]:
        calls.append(1)
        if len(calls) == 2:
            raise KeyError("label")
        return per_sample(m, batch)

    with pytest.raises(KeyError, match="label"):
        loopkit.evaluate(model, torch.utils.data.DataLoader(_data(), batch_size=4), fn)
    assert model.training


def test_one_host_read_per_call() -> None:
    """However many batches: one read of the sums, filed as evaluate's own."""
    model = nn.Linear(4, 1)
    data = _data(20).tensors
    batches = [(data[0][i : i + 3], data[1][i : i + 3]) for i in range(0, 20, 3)]
    with loopkit.count_host_syncs() as syncs:
        loopkit.evaluate(model, batches, per_sample)
    assert syncs.count == 1 and syncs.expected == {"evaluate's result": 1}


def test_the_steps_autocast_and_device() -> None:
    """step= a bf16 step: the forward runs under bf16 autocast."""
    model = nn.Linear(4, 1)
    step = loopkit.step(model, torch.optim.SGD(model.parameters(), lr=0.1), precision="bf16")
    dtypes = []

    def fn(m: nn.Module, batch: Batch) -> dict[str, torch.Tensor]:
        out = m(batch[0])
        dtypes.append(out.dtype)
        return {"loss": (out.float() - batch[1]).pow(2).mean(1)}

    loopkit.evaluate(model, torch.utils.data.DataLoader(_data(), batch_size=4), fn, step=step)
    assert dtypes == [torch.bfloat16, torch.bfloat16]


def test_inside_an_entered_bf16_step_evaluate_keeps_its_own_precision() -> None:
    """Called before s.backward (the step's bf16 autocast on): the result outside the step,
    bit for bit (fp32 by default, or bf16 of its own), and the step's autocast on after it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))
    step = loopkit.step(model, torch.optim.SGD(model.parameters(), lr=0.1), precision="bf16")
    loader = torch.utils.data.DataLoader(_data(9), batch_size=4)
    fp16 = torch.float16
    alone = [loopkit.evaluate(model, loader, per_sample, precision=p) for p in ("fp32", fp16)]
    x, y = _data(5).tensors
    with torch.autocast("cpu", dtype=torch.bfloat16):  # any enclosing autocast, not a step's
        assert loopkit.evaluate(model, loader, per_sample).sums == alone[0].sums
        assert model(x).dtype == torch.bfloat16
    with step as s:
        inside = [loopkit.evaluate(model, loader, per_sample, precision=p) for p in (None, fp16)]
        assert torch.is_autocast_enabled("cpu")
        assert torch.get_autocast_dtype("cpu") == torch.bfloat16
        out = model(x)  # the step's forward after the evaluation: still bf16
        s.backward((out.float() - y).pow(2).mean())
    assert out.dtype == torch.bfloat16 and not torch.is_autocast_enabled("cpu")
    assert [r.sums for r in inside] == [r.sums for r in alone]
    assert inside[0].sums != inside[1].sums  # fp32 and fp16 differ: the precision is seen


def test_ddp_is_unwrapped(process_group: None) -> None:
    """A DDP model's own forward (reducer, buffer broadcast) never runs; its module's does."""
    ddp = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(4, 1), nn.BatchNorm1d(1)))
    calls = []
    ddp.register_forward_pre_hook(lambda *a: calls.append("ddp"))
    ddp.module.register_forward_pre_hook(lambda *a: calls.append("inner"))
    loader = torch.utils.data.DataLoader(_data(), batch_size=4)
    loopkit.evaluate(ddp, loader, per_sample)
    assert calls == ["inner", "inner"]
    del ddp


def test_a_distributed_loader_is_left_where_it_was() -> None:
    """A loopkit loader is evaluated whole without moving its epoch (after a peek too);
    in the middle of a training pass it is refused."""
    model = nn.Linear(4, 1)
    loader = distributed.loader(_data(), batch_size=2, shuffle=False, num_workers=0)
    result = loopkit.evaluate(model, loader, per_sample)
    assert result.samples == 7 and loader.epoch == 0
    next(iter(loader))  # a peek: no training pass
    assert loopkit.evaluate(model, loader, per_sample).samples == 7 and loader.epoch == 0
    it = loader.training_pass()
    next(it)
    with pytest.raises(RuntimeError, match="middle of a pass"):
        loopkit.evaluate(model, loader, per_sample)


@pytest.mark.parametrize(
    ("fn", "loader_kw", "error", "says"),
    [
        (lambda m, b: {"loss": (m(b[0]) - b[1]).pow(2).mean()}, {}, ValueError, "per sample"),
        (lambda m, b: (m(b[0]) - b[1]).pow(2).mean(1), {}, TypeError, "dict"),
        (lambda m, b: {"a": m(b[0])[:, 0], "b": m(b[0])[:1, 0]}, {}, ValueError, "lengths"),
        (per_sample, {"drop_last": True}, ValueError, "drop_last"),
    ],
)
def test_refusals(fn: Any, loader_kw: dict[str, Any], error: type[Exception], says: str) -> None:
    """Per-batch scalars, a bare tensor, ragged values or a loader that drops: refused."""
    model = nn.Linear(4, 1)
    loader = torch.utils.data.DataLoader(_data(), batch_size=3, **loader_kw)
    with pytest.raises(error, match=says):
        loopkit.evaluate(model, loader, fn)
    assert model.training


def test_bad_arguments() -> None:
    """step= with precision=, an empty loader, a non-module: named."""
    model = nn.Linear(4, 1)
    step = loopkit.step(model, torch.optim.SGD(model.parameters(), lr=0.1))
    loader = torch.utils.data.DataLoader(_data(), batch_size=3)
    with pytest.raises(TypeError, match="not both"):
        loopkit.evaluate(model, loader, per_sample, step=step, precision="bf16")
    with pytest.raises(ValueError, match="no batch"):
        loopkit.evaluate(model, [], per_sample)
    with pytest.raises(TypeError, match=r"nn\.Module"):
        loopkit.evaluate(per_sample, loader, per_sample)  # type: ignore[arg-type]


def test_an_out_of_order_loader_is_refused(process_group: None) -> None:
    """in_order=False hands batches out of order: the padded duplicates could not be found."""
    data = _data()
    sampler = torch.utils.data.DistributedSampler(data, num_replicas=1, rank=0)
    loader = torch.utils.data.DataLoader(data, batch_size=2, sampler=sampler, num_workers=1,
                                         in_order=False)  # fmt: skip
    with pytest.raises(ValueError, match="in_order=True"):
        loopkit.evaluate(nn.Linear(4, 1), loader, per_sample)


class Merging(nn.Linear):
    """A module whose train() does something (as LoRA merges and unmerges its weights)."""

    calls: ClassVar[list[bool]] = []

    def train(self, mode: bool = True) -> Merging:
        Merging.calls.append(mode)
        return super().train(mode)


def test_modes_are_put_back_through_train() -> None:
    """After evaluate, train(True) was called again on a module whose train() has effects."""
    model = nn.Sequential(Merging(4, 1))
    model.train()
    Merging.calls.clear()
    loopkit.evaluate(model, torch.utils.data.DataLoader(_data(), batch_size=4), per_sample)
    assert Merging.calls == [False, True] and model[0].training


def test_non_finite_values_give_nan_or_inf_not_an_error() -> None:
    """inf and -inf among the values: the sum is nan (as a plain sum says), no exception."""

    def fn(m: nn.Module, batch: Batch) -> dict[str, torch.Tensor]:
        v = torch.zeros(len(batch[0]), dtype=torch.float64)
        v[0] = float("inf") if batch[1][0, 0] > 0 else -float("inf")
        return {"v": v}

    batches = [(torch.ones(2, 4), torch.ones(2, 1)), (torch.ones(2, 4), -torch.ones(2, 1))]
    result = loopkit.evaluate(nn.Linear(4, 1), batches, fn)
    assert result.sums["v"] != result.sums["v"]  # nan


def test_ratio_divides_the_exact_totals() -> None:
    """ratio("nll", "tokens"): the summed numerator over the summed denominator (perplexity's
    NLL per token), not a mean of per-sample ratios; unknown names and a zero total raise."""
    model = nn.Linear(4, 1)
    data = _data(9)

    def nll_tokens(m: nn.Module, batch: Batch) -> dict[str, torch.Tensor]:
        x, y = batch
        tokens = torch.arange(1, len(x) + 1, dtype=torch.float32)  # unequal per sample
        return {"nll": (m(x) - y).pow(2)[:, 0] * tokens, "tokens": tokens, "zero": 0 * tokens}

    result = loopkit.evaluate(model, torch.utils.data.DataLoader(data, batch_size=4), nll_tokens)
    with torch.no_grad():
        per = [nll_tokens(model, (data.tensors[0][i : i + 4], data.tensors[1][i : i + 4]))
               for i in range(0, 9, 4)]  # fmt: skip
    nll = sum(p["nll"].double().sum().item() for p in per)
    tokens = sum(p["tokens"].double().sum().item() for p in per)
    assert result.ratio("nll", "tokens") == pytest.approx(nll / tokens, rel=1e-12)
    assert abs(result.ratio("nll", "tokens") - result["nll"] / result["tokens"]) < 1e-12
    assert abs(result.ratio("nll", "tokens") - result["nll"]) > 1e-3  # the per-sample mean
    with pytest.raises(KeyError, match="no metric 'loss'"):
        result.ratio("loss", "tokens")
    with pytest.raises(ZeroDivisionError, match="'zero'"):
        result.ratio("nll", "zero")


def test_a_loader_accelerate_prepared_counts_every_sample_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One process: a loader accelerator.prepare made gives the plain loader's result. Two
    processes (its BatchSamplerShard has no .sampler: evaluate crashed): with even_batches
    (the default, the last round padded with repeated samples) each rank's real samples are
    counted, and over the ranks they are the data set, each once; without, all are real; a
    shuffled sampler, whose padding cannot be found, is refused naming the fix."""
    accelerate = pytest.importorskip("accelerate")
    from accelerate.data_loader import BatchSamplerShard

    from loopkit._control import _evaluate, _prepared

    model = nn.Linear(4, 1)
    plain = loopkit.evaluate(model, torch.utils.data.DataLoader(_data(7), batch_size=3), per_sample)
    prepared = accelerate.Accelerator(cpu=True).prepare(
        torch.utils.data.DataLoader(_data(7), batch_size=3)
    )
    got = loopkit.evaluate(model, prepared, per_sample)
    assert got.samples == plain.samples == 7 and got.sums == plain.sums

    def shard_of(n: int, rank: int, even: bool, split: bool, shuffle: bool = False) -> Any:
        data = _data(n)
        sampler: Any = (torch.utils.data.RandomSampler(data) if shuffle
                        else torch.utils.data.SequentialSampler(data))  # fmt: skip
        base = torch.utils.data.BatchSampler(sampler, batch_size=2, drop_last=False)
        shard = BatchSamplerShard(base, num_processes=2, process_index=rank, even_batches=even,
                                  split_batches=split)  # fmt: skip
        return torch.utils.data.DataLoader(data, batch_sampler=shard)

    monkeypatch.setattr(_evaluate._ranks, "is_multi_rank", lambda group=None: True)
    for n, even, split in itertools.product((1, 3, 7, 8, 9), (True, False), (False, True)):
        real = []
        for rank in (0, 1):
            monkeypatch.setattr(_prepared._ranks, "world", lambda group=None, r=rank: (r, 2))
            loader = shard_of(n, rank, even, split)
            _, count = _evaluate._shard(loader, disjoint=False)
            given = [int(i) for b in loader.batch_sampler for i in b]
            real += given if count is None else given[:count]
        assert sorted(real) == list(range(n)), (n, even, split)
    monkeypatch.setattr(_prepared._ranks, "world", lambda group=None: (0, 2))
    with pytest.raises(ValueError, match="shuffle=False"):
        _evaluate._shard(shard_of(7, 0, True, False, shuffle=True), disjoint=False)


_PREPARED_TWO = """
import sys, torch, loopkit, accelerate
from torch import nn
torch.manual_seed(0)
acc = accelerate.Accelerator(cpu=True)
# Small integers and dyadic weights: every float32 value is exact, however it is batched.
data = torch.utils.data.TensorDataset(torch.randint(-3, 4, (7, 4)).float(),
                                      torch.randint(-3, 4, (7, 1)).float())
model = nn.Linear(4, 1)
with torch.no_grad():
    model.weight.copy_(torch.tensor([[1.0, -2.0, 0.5, 3.0]]))
    model.bias.fill_(0.25)
def per_sample(m, b):
    x, y = b
    return {"loss": (m(x) - y).pow(2).mean(1)}
loader = acc.prepare(torch.utils.data.DataLoader(data, batch_size=2))
shard = type(loader.batch_sampler).__name__
result = loopkit.evaluate(model, loader, per_sample)
exact = per_sample(model, data.tensors)["loss"].double().sum().item()
said = (f"rank {acc.process_index} of {acc.num_processes}: {shard} {result.samples} "
        f"{abs(result.sums['loss'] - exact):.3g}")
open(f"{sys.argv[1]}/rank{acc.process_index}.txt", "w").write(said)  # one pipe would mix them
acc.wait_for_everyone()
torch.distributed.destroy_process_group()  # exiting with the group alive may abort (gloo)
"""


@deep
def test_under_accelerate_launch_a_prepared_loader_counts_each_sample_once(
    tmp_path: Path,
) -> None:
    """accelerate launch, 2 processes, even_batches (7 samples in batches of 2: the last
    round padded with repeats): each rank's evaluate sees 7 samples and the exact sum."""
    pytest.importorskip("accelerate")
    script = tmp_path / "prepared.py"
    script.write_text(_PREPARED_TWO)
    launcher = Path(sys.executable).parent / "accelerate"
    with socket.socket() as s:  # a free port: accelerate's default 29500 may be taken
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    proc = subprocess.run(
        [str(launcher), "launch", "--multi_gpu", "--num_processes", "2",
         "--main_process_port", port, str(script), str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=launch_env(),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = [(tmp_path / f"rank{r}.txt").read_text() for r in (0, 1)]
    assert lines == [f"rank {r} of 2: BatchSamplerShard 7 0" for r in (0, 1)], proc.stdout
