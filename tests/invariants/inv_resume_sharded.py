"""Resume at scale: sharded models, saves in the background, and another number of processes.

A scenario: DDP or FSDP2 (each Linear a shard group) on 2 ranks, ``accumulate`` 1 to 3,
SGD or AdamW, a scheduler or not, an EMA or not, clipping or not, a data set of 8 to 40
samples carrying their index, a global batch of 2 to 8, ``drop_last``, ``shuffle``, 2
epochs, saves every 1 to 3 updates (synchronous or in the background), a
``detach_logging(sync_ranks=True)`` flushing every 1 to 4 micro-steps, and a stop after a
drawn update (the run ends there, as a killed job: nothing after its last save survives).
Drawn as well: a ``probe_micro_batch`` before training in every run (its largest trial
fitting, or dying of an out-of-memory error in its backward), ``skip_nonfinite=True`` with
a non-finite loss on rank 0 in a drawn window (skipped on every rank, then saved again at
the same update), and a ``save()`` right after the ``maybe_save`` of a drawn update (the
same update saved twice).

Checked on the 2 ranks: the stopped run, resumed by fresh objects, ends bit-identical to
the uninterrupted run (weights, EMA, optimizer state, lr, every log record after the
resume). Checked by the pytest side on 1 process (``check_one_process``): the stopped
run's newest checkpoint, resumed with ``reseed=True``, takes the same samples in each
update as the uninterrupted 2-rank run (so every sample once an epoch) and ends within
float rounding of it (weights, EMA, lr, log records); where the 2 ranks pad the data set
to another length than 1 process does (no ``drop_last``, an odd length) the resume is
refused, naming ``drop_last=True``, with nothing loaded.
"""

from __future__ import annotations

import math
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from hypothesis import strategies as st
from torch import nn

import loopkit
from loopkit import distributed

Spec = dict[str, Any]
EPOCHS = 2


class Indexed(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor, int]]):
    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(n)
        self.x, self.y = torch.randn(n, 6, generator=g), torch.randn(n, 2, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.x[i], self.y[i], i


PROBED = 9
"""The probe's batch: no training batch has as many samples (a global batch is at most 8)."""


class _OOMInBackward(torch.autograd.Function):
    """The identity, whose backward runs out of memory on the probe's batch."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.samples = len(x)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        if ctx.samples == PROBED:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return grad


class OOMGate(nn.Module):
    """Between the layers (no parameters): the probe's largest trial dies in its backward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _OOMInBackward.apply(x)  # type: ignore[no-any-return]


def _mse(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return nn.functional.mse_loss(model(batch[0]), batch[1])


def full(t: torch.Tensor) -> torch.Tensor:
    gather = getattr(t, "full_tensor", None)
    return (gather() if gather is not None else t).detach().clone()


def _everyone(indices: list[int]) -> list[int]:
    if not dist.is_initialized():
        return sorted(indices)
    found: list[list[int]] = [[] for _ in range(dist.get_world_size())]
    dist.all_gather_object(found, indices)
    return sorted(i for part in found for i in part)


def run(spec: Spec, root: Path, stop: int | None = None, reseed: bool = False) -> dict[str, Any]:
    """Train the scenario (resuming from ``root``), ending at update ``stop`` if given."""
    torch.manual_seed(0)
    probe = spec.get("probe")
    gate = [OOMGate()] if probe == "oom" else []
    net = nn.Sequential(nn.Linear(6, 12), *gate, nn.Tanh(), nn.Linear(12, 2))
    model = distributed.wrap(net, fsdp=nn.Linear if spec["sharded"] else False)
    params = list(model.parameters())
    opt: torch.optim.Optimizer = (
        torch.optim.AdamW(params, lr=1e-2) if spec["optimizer"] == "adamw"
        else torch.optim.SGD(params, lr=0.05, momentum=0.9)
    )  # fmt: skip
    if probe is not None:  # taken back: as if it had never run
        g = torch.Generator().manual_seed(7)
        big = (torch.randn(PROBED, 6, generator=g) * 5, torch.randn(PROBED, 2, generator=g))
        fits = loopkit.probe_micro_batch(model, opt, _mse, big)
        assert fits == (4 if probe == "oom" else PROBED), fits
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, 0.7) if spec["scheduler"] else None
    average = loopkit.ema(model, decay=0.8) if spec["ema"] else None
    records: list[dict[str, float]] = []

    def sink(metrics: dict[str, float], step: int) -> None:
        records.append({"loss": metrics["loss"], "step": step})

    log = loopkit.detach_logging(every=spec["log_every"], sink=sink, sync_ranks=True)
    loader = distributed.loader(Indexed(spec["n"]), global_batch_size=spec["global_batch"],
                                drop_last=spec["drop_last"], shuffle=spec["shuffle"], seed=2,
                                num_workers=0)  # fmt: skip
    nonfinite, resave = spec.get("nonfinite"), spec.get("resave")
    step = loopkit.step(model, opt, accumulate=spec["accumulate"], scheduler=sched,
                        ema=average, clip_grad_norm=spec["clip"], log=log,
                        skip_nonfinite=nonfinite is not None)  # fmt: skip
    ckpt = loopkit.Checkpointer(root, model=model, step=step, loader=loader,
                                async_save=spec["async_save"])  # fmt: skip
    resumed = ckpt.resume(reseed=reseed)
    windows_at_resume = step.updates + step.skipped
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    seen: list[list[int]] = []
    window: list[int] = []
    done = resaved = False
    for _ in range(loader.epoch, EPOCHS):
        for x, y, index in step.iterate(loader):
            with step as s:
                loss = nn.functional.mse_loss(model(x), y)
                if rank0 and step.updates + step.skipped == nonfinite:
                    loss = loss * float("nan")  # this window is skipped on every rank
                s.backward(loss)
            window += index.tolist()
            if step.micro_step == 0:
                seen.append(_everyone(window))
                window = []
            ckpt.maybe_save(every=spec["save_every"])
            if step.micro_step == 0 and step.updates == resave and not resaved:
                ckpt.save()  # the update maybe_save saved (or deferred), saved again
                resaved = True
            done = stop is not None and step.updates == stop and step.micro_step == 0
            if done:
                break
        if done:
            break
    if not done:
        ckpt.save_if_needed()
    ckpt.wait()
    log.close()
    return {
        "weights": [full(p) for p in model.parameters()],
        "ema": [] if average is None
               else [full(t) for t in average.state_dict()["shadow"].values()],
        "optimizer": [full(v) for s in opt.state.values() for v in s.values()
                      if isinstance(v, torch.Tensor) and v.dim() > 0],
        "lr": opt.param_groups[0]["lr"],
        "updates": step.updates,
        "seen": seen,
        "records": records,
        "resumed_from": None if resumed is None else resumed.name,
        "windows_at_resume": windows_at_resume,
        "skipped": step.skipped,
    }  # fmt: skip


def windows_of(spec: Spec) -> int:
    """The windows of the uninterrupted run (windows close at each pass's end)."""
    n, g = spec["n"], spec["global_batch"]
    batches = n // g if spec["drop_last"] else -(-n // g)
    return EPOCHS * -(-batches // spec["accumulate"])


@st.composite
def scenarios(draw: Callable[..., Any]) -> Spec:
    spec = {
        "sharded": draw(st.booleans()),
        "accumulate": draw(st.integers(1, 3)),
        "optimizer": draw(st.sampled_from(["adamw", "sgd"])),
        "scheduler": draw(st.booleans()),
        "ema": draw(st.booleans()),
        "clip": draw(st.sampled_from([None, 0.05, 1.0])),
        "n": draw(st.integers(8, 40)),
        "global_batch": draw(st.sampled_from([2, 4, 6, 8])),
        "drop_last": draw(st.booleans()),
        "shuffle": draw(st.booleans()),
        "save_every": draw(st.integers(1, 3)),
        "async_save": draw(st.booleans()),
        "log_every": draw(st.integers(1, 4)),
        "probe": draw(st.sampled_from([None, "fits", "oom"])),
    }
    windows = windows_of(spec)
    spec["nonfinite"] = draw(st.one_of(st.none(), st.integers(0, windows - 1)))
    total = windows - (spec["nonfinite"] is not None)  # the updates
    # Mostly after the first save (a resume to do), sometimes before it (a fresh start).
    spec["stop"] = draw(st.integers(min(spec["save_every"], max(1, total - 1)), max(1, total - 1)))
    spec["resave"] = draw(st.sampled_from([None, *range(spec["save_every"], total + 1,
                                                          spec["save_every"])]))  # fmt: skip
    return spec


EXPLICIT = [  # a pass padded otherwise by 2 ranks (14) than by 1 process (13): refused there
    {"sharded": True, "accumulate": 2, "optimizer": "adamw", "scheduler": True, "ema": True,
     "clip": 1.0, "n": 13, "global_batch": 4, "drop_last": False, "shuffle": True,
     "save_every": 1, "async_save": True, "log_every": 3, "stop": 3},
    # FSDP2: the probe's largest trial dies in its backward; update 2 saved twice, the run
    # stopped there and resumed from that save; its next window (the pass's last) skipped,
    # then update 2 saved again when the next pass starts.
    {"sharded": True, "accumulate": 2, "optimizer": "adamw", "scheduler": True, "ema": True,
     "clip": 1.0, "n": 24, "global_batch": 4, "drop_last": True, "shuffle": True,
     "save_every": 1, "async_save": False, "log_every": 2, "stop": 2, "probe": "oom",
     "nonfinite": 2, "resave": 2},
]  # fmt: skip


def check_on_ranks(spec: Spec, info: Any) -> dict[str, Any]:
    """Both ranks: stopped and resumed on 2 ranks == uninterrupted, bit for bit; the stopped
    run's directory is kept for the 1-process resume."""
    base = Path(tempfile.mkdtemp(prefix="inv-sharded-")) if info.rank == 0 else None
    said = [str(base) if base is not None else ""]
    dist.broadcast_object_list(said, src=0)
    base = Path(said[0])
    whole = run(spec, base / "whole")
    cut = run(spec, base / "cut", stop=spec["stop"])
    if info.rank == 0:  # as it was when the job died (empty if it died before its first save)
        shutil.copytree(base / "cut", base / "for_one") if (base / "cut").exists() else (
            base / "for_one").mkdir()  # fmt: skip
    dist.barrier()
    resumed = run(spec, base / "cut")
    problems = []
    for key in ("weights", "ema", "optimizer"):
        if not all(torch.equal(a, b) for a, b in zip(whole[key], resumed[key], strict=True)):
            problems.append(f"{key} differ after a resume on 2 ranks")
    counts = ("lr", "updates", "skipped")
    if any(whole[k] != resumed[k] for k in counts):
        problems.append(f"lr/updates/skipped {[resumed[k] for k in counts]} != whole's")
    if whole["skipped"] != (spec.get("nonfinite") is not None):
        problems.append(f"{whole['skipped']} windows skipped")
    saved_at = _saved_update(resumed["resumed_from"])
    windows = resumed["windows_at_resume"]  # the seen of skipped windows too
    if resumed["seen"] != whole["seen"][windows:]:
        problems.append("the resumed run took other samples")
    expected = _records_after(whole["records"], resumed["records"], saved_at)
    if info.rank == 0 and not _same_records(resumed["records"], expected, 0.0):
        problems.append(f"log records {resumed['records']} != {whole['records']}")
    assert not problems, "; ".join(problems)
    return {"spec": spec, "dir": str(base / "for_one"), "whole": whole, "cut": cut,
            "saved_at": saved_at, "saved_windows": windows}  # fmt: skip


def _same_records(a: list[dict[str, float]], b: list[dict[str, float]], rel: float) -> bool:
    """The same steps, and losses within ``rel`` (a non-finite window's: NaN in both)."""
    if [r["step"] for r in a] != [r["step"] for r in b]:
        return False
    return all(
        (math.isnan(x["loss"]) and math.isnan(y["loss"]))
        or abs(x["loss"] - y["loss"]) <= rel * max(1.0, abs(y["loss"]))
        for x, y in zip(a, b, strict=True)
    )


def _saved_update(name: str | None) -> int:
    return 0 if name is None else int(name.removeprefix("ckpt-").removesuffix(".pt"))


def _records_after(whole: list[dict[str, float]], resumed: list[dict[str, float]],
                   update: int) -> list[dict[str, float]]:  # fmt: skip
    """The uninterrupted run's records that a run resumed at ``update`` flushed again: its
    last ones, as many as the resumed run's (each flushed after ``update``, or in the window
    after it, still at ``update``); [] if the resumed run's are not such a tail."""
    tail = whole[len(whole) - len(resumed) :] if resumed else []
    after = [r for r in whole if r["step"] > update]
    if len(resumed) < len(after) or any(r["step"] < update for r in tail):
        return []
    return tail


def check_one_process(record: dict[str, Any]) -> None:
    """1 process: the 2-rank checkpoint resumed with reseed=True continues the same samples
    and ends within float rounding; or, padded otherwise, is refused naming the fix."""
    spec, whole = record["spec"], record["whole"]
    work = Path(tempfile.mkdtemp(prefix="inv-one-"))
    shutil.copytree(record["dir"], work / "cut")
    pads_alike = spec["drop_last"] or spec["n"] % 2 == 0
    at, windows = record["saved_at"], record["saved_windows"]
    if not pads_alike and at == 0:
        return  # nothing saved: a fresh run on 1 process, whose passes are padded otherwise
    if not pads_alike:
        try:
            run(spec, work / "cut", reseed=True)
        except loopkit.CheckpointError as err:
            assert "drop_last=True" in str(err), err
            return
        raise AssertionError(f"{spec}: a pass padded otherwise was resumed")
    one = run(spec, work / "cut", reseed=True)
    assert (one["resumed_from"] is None) == (at == 0), spec
    assert one["windows_at_resume"] == windows, spec
    assert one["seen"] == whole["seen"][windows:], f"{spec}: other samples after the resume"
    flat = [i for u in (*record["cut"]["seen"][:windows], *one["seen"]) for i in u]
    n_used = sum(len(u) for u in whole["seen"])
    assert sorted(flat) == sorted(i for u in whole["seen"] for i in u) and len(flat) == n_used
    assert all(one[k] == whole[k] for k in ("updates", "lr", "skipped")), spec
    for key in ("weights", "ema"):
        for a, b in zip(one[key], whole[key], strict=True):
            assert (a - b).abs().max().item() <= 1e-5, f"{spec}: {key} differ by {a - b}"
    expected = _records_after(whole["records"], one["records"], at)
    assert _same_records(one["records"], expected, 1e-5), (spec, one["records"], expected)


if __name__ == "__main__":  # replay one example's 1-process side: a saved record's path
    check_one_process(torch.load(sys.argv[1], weights_only=False))
