"""doctor: phase shares, sync counts and the tip that applies, alone and inside loopkit.step."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import ROOT, batches, loss_fn, mlp, requires_cuda
from torch import nn

import loopkit
from loopkit._observe import _doctor
from loopkit._sync_points import expected_sync


class SlowData(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Each sample takes 2 ms to 'decode', like images read from a slow disk."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(0.002)
        return torch.randn(8), torch.randn(1)


def test_data_bound_loop_gets_the_data_tip() -> None:
    """A slow __getitem__ read through doc.iterate: the data wait dominates, with its tip."""
    loader = torch.utils.data.DataLoader(SlowData(), batch_size=8)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    doc = loopkit.doctor(sample_syncs_at=())
    for x, y in doc.iterate(loader):
        with doc:
            loss_fn(model, (x, y)).backward()
            with doc.phase("optimizer"):
                opt.step()
                opt.zero_grad()
    stats = doc.stats()
    assert stats["steps"] == 8 and doc.samples == 64
    assert stats["share"]["data"] > 0.5
    assert stats["share"]["between"] < stats["share"]["data"] / 5
    tips = doc.tips()
    assert tips and tips[0].startswith(f"{100 * stats['share']['data']:.0f}% of each step waits")
    assert "num_workers is 0" in tips[0]
    assert not any("outside the step" in t for t in tips)
    report = doc.report()
    assert "waiting for data" in report and "Tips:" in report


def _busy(a: torch.Tensor, n: int) -> torch.Tensor:
    """Sleep-free work of a measurable size, like evaluation or another model's step."""
    for _ in range(n):
        a = torch.tanh(a @ a)
    return a


def test_work_between_steps_is_not_a_data_wait() -> None:
    """Work between steps with a cheap next() is 'outside the step': no num_workers tip."""
    model = mlp()
    other = torch.randn(192, 192) / 14
    doc = loopkit.doctor(loader=[], sample_syncs_at=())
    for batch in doc.iterate(batches([4] * 8)):
        with doc:
            loss_fn(model, batch).backward()
        other = _busy(other, 20)  # the user's code between two steps
    share = doc.stats()["share"]
    assert share["between"] > 0.5
    assert share["data"] < share["between"] / 20
    tips = doc.tips()
    assert tips[0].startswith(f"{100 * share['between']:.0f}% of each step is spent outside")
    assert not any("num_workers" in t or "waits for data" in t for t in tips)
    assert not any("doc.iterate" in t for t in tips)  # the data wait was timed on its own
    assert "outside the step" in doc.report()


def test_a_second_models_step_is_outside_the_step() -> None:
    """GAN-style D and G steps, the doctor on D only: G's time is outside the step, not data."""
    d_model, g_model = mlp(0), mlp(1, width=512)
    doc = loopkit.doctor(sample_syncs_at=())
    d_step = loopkit.step(d_model, torch.optim.SGD(d_model.parameters(), lr=0.1), doctor=doc)
    g_step = loopkit.step(g_model, torch.optim.AdamW(g_model.parameters()))
    big = [(torch.randn(256, 8), torch.randn(256, 1)) for _ in range(6)]
    for batch in d_step.iterate(big):
        with d_step as s:
            s.backward(loss_fn(d_model, (batch[0][:4], batch[1][:4])))
        for _ in range(3):
            with g_step as s:
                s.backward(loss_fn(g_model, batch))
        print(f"step {d_step.updates}")  # prints between steps
    share = doc.stats()["share"]
    assert share["between"] > 3 * share["data"]
    assert not any("num_workers" in t for t in doc.tips())


def test_alone_without_iterate_the_gap_is_outside_the_step() -> None:
    """Without doc.iterate a slow loader cannot be told apart: no data share, no num_workers."""
    loader = torch.utils.data.DataLoader(SlowData(), batch_size=8)
    model = mlp()
    doc = loopkit.doctor(loader=loader, sample_syncs_at=())
    for x, y in loader:
        with doc:
            loss_fn(model, (x, y)).backward()
    stats = doc.stats()
    assert stats["seconds"]["data"] == 0.0
    assert stats["share"]["between"] > 0.5
    tips = doc.tips()
    assert not any("num_workers" in t for t in tips)
    assert "outside the step" in tips[0] and "doc.iterate(loader)" in tips[0]
    assert "waiting for data" not in doc.report()


def test_item_every_step_is_counted_and_named() -> None:
    """.item() each step: 1.0 sync per step on the sampled steps, and the detach_logging tip."""
    model = mlp()
    doc = loopkit.doctor(sample_syncs_at=(2, 3, 4), sample_syncs_every=None)
    for batch in batches([4] * 6):
        with doc:
            loss = loss_fn(model, batch)
            loss.backward()
            loss.item()
    stats = doc.stats()
    assert doc.sync_steps == 3 and stats["syncs_per_step"] == 1.0
    assert stats["sync_ops"] == {"Tensor.item": 3}
    assert any("detach_logging" in t and "1.0 host-device syncs" in t for t in doc.tips())


def test_sync_free_loop_has_no_sync_tip() -> None:
    """With detach_logging the sampled steps show 0 syncs and no sync tip."""
    model = mlp()
    log = loopkit.detach_logging(every=100, sink=None)
    doc = loopkit.doctor(sample_syncs_at=(2, 3), sample_syncs_every=None)
    for batch in batches([4] * 5):
        with doc:
            loss = loss_fn(model, batch)
            loss.backward()
            log(loss=loss)
    assert doc.stats()["syncs_per_step"] == 0.0
    assert not any("syncs" in t for t in doc.tips())


def test_slow_optimizer_phase_gets_its_tip() -> None:
    """An optimizer phase that dominates is named first, with the fused-optimizer advice."""
    doc = loopkit.doctor(sample_syncs_at=())
    for _ in range(3):
        with doc:
            time.sleep(0.001)
            with doc.phase("optimizer"):
                time.sleep(0.01)
    assert doc.stats()["share"]["optimizer"] > 0.7
    assert "fused" in doc.tips()[0]


def test_inside_step_every_phase_is_timed_and_samples_counted() -> None:
    """loopkit.step(doctor=...) times copies, compute, optimizer and logging; counts samples."""
    model = mlp()
    doc = loopkit.doctor(sample_syncs_at=(1,), sample_syncs_every=None)
    step = loopkit.step(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        accumulate=2,
        log=loopkit.detach_logging(every=100, sink=None),
        doctor=doc,
    )
    data = [{"x": x, "y": y} for x, y in batches([4] * 6)]
    for batch in step.iterate(data):
        with step as s:
            s.backward(loss_fn(model, (batch["x"], batch["y"])))
    stats = doc.stats()
    assert stats["steps"] == 6 and doc.samples == 24
    for phase in ("h2d", "compute", "optimizer", "logging"):
        assert stats["seconds"][phase] > 0, phase
    assert stats["syncs_per_step"] == 0.0  # the composed step makes none
    assert doc.precision == "fp32"


def test_off_means_no_doctor_code_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without doctor= the step never reads the doctor's clock."""
    calls: list[int] = []
    real = _doctor.time.perf_counter
    monkeypatch.setattr(_doctor.time, "perf_counter", lambda: calls.append(1) or real())
    model = mlp()
    step = loopkit.step(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for batch in step.iterate(batches([4] * 3)):
        with step as s:
            s.backward(loss_fn(model, batch))
    assert calls == []


def test_ddp_all_reduces_are_timed(process_group: None) -> None:
    """On a DDP model the doctor wraps the default all-reduce with a clock (once)."""
    ddp = nn.parallel.DistributedDataParallel(mlp())
    doc = loopkit.doctor(sample_syncs_at=())
    step = loopkit.step(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), doctor=doc)
    assert doc.watch(ddp) is False  # a second hook is refused, not stacked
    for batch in batches([4] * 3):
        with step as s:
            s.backward(loss_fn(ddp, batch))
    assert doc.stats()["seconds"]["communication"] > 0
    assert "communication" in doc.report()


def test_report_at_exit_and_every(tmp_path: Path) -> None:
    """report_every prints during the run; report_at_exit prints when the program ends."""
    script = tmp_path / "run.py"
    script.write_text(
        "import torch, loopkit\n"
        "doc = loopkit.doctor(report_at_exit=True, report_every=2, sample_syncs_at=())\n"
        "for _ in range(3):\n"
        "    with doc:\n"
        "        torch.ones(4).sum()\n"
    )
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("loopkit doctor:") == 2
    assert "loopkit doctor: 2 steps" in proc.stdout and "loopkit doctor: 3 steps" in proc.stdout


@pytest.mark.parametrize(
    ("call", "exc", "hint"),
    [
        (lambda: loopkit.doctor().phase("disk"), ValueError, "use one of data"),
        (lambda: loopkit.doctor(sample_syncs_at=(0,)), ValueError, "1 is the first step"),
        (lambda: loopkit.doctor(report_every=0), ValueError, "int >= 1 or None"),
        (lambda: loopkit.doctor(sink=3), TypeError, "e.g. print"),
        (lambda: loopkit.doctor().count(samples=-1), ValueError, "int >= 0"),
        (lambda: loopkit.doctor().step_samples(2.5), ValueError, "samples must be an int >= 0"),
    ],
)
def test_bad_input(call: Any, exc: type[Exception], hint: str) -> None:
    """Wrong arguments raise with the fix in the message."""
    with pytest.raises(exc) as info:
        call()
    assert hint in str(info.value)


def test_nested_entry_is_refused() -> None:
    """Entering the doctor twice in one step is a clear error."""
    doc = loopkit.doctor()
    with doc, pytest.raises(RuntimeError, match="once per step"):
        doc.__enter__()


@requires_cuda
def test_cuda_phases_are_timed_by_events() -> None:
    """On CUDA the phases come from CUDA events, resolved at report time."""
    doc = loopkit.doctor(device="cuda", sample_syncs_at=(2,))
    a = torch.randn(1024, 1024, device="cuda")
    for _ in range(3):
        with doc:
            (a @ a).sum()
            with doc.phase("optimizer"):
                a.mul_(1.0)
    stats = doc.stats()
    assert stats["seconds"]["compute"] > 0 and stats["seconds"]["optimizer"] > 0


def test_optimizer_step_counters_are_not_counted_as_syncs() -> None:
    """AdamW reads its host-side step counter with .item(): inside step() that is no sync."""
    model = mlp()
    doc = loopkit.doctor(sample_syncs_at=(2, 3, 4, 5), sample_syncs_every=None)
    step = loopkit.step(model, torch.optim.AdamW(model.parameters()), doctor=doc)
    for batch in batches([4] * 6):
        with step as s:
            loss = loss_fn(model, batch)
            s.backward(loss)
            loss.item()  # the one real sync per step
    assert doc.stats()["syncs_per_step"] == 1.0
    assert doc.stats()["sync_ops"] == {"Tensor.item": 4}


@pytest.mark.filterwarnings("ignore:fp16 autocast on a CPU")
def test_fp16_on_a_cpu_gets_the_bf16_tip_first() -> None:
    """loopkit.step(precision="fp16") on a CPU: the first tip says to use bf16; bf16 gets none."""
    tips: dict[str, list[str]] = {}
    for precision in ("fp16", "bf16"):
        model = mlp()
        doc = loopkit.doctor(sample_syncs_at=())
        step = loopkit.step(
            model, torch.optim.SGD(model.parameters(), lr=0.1), precision=precision, doctor=doc
        )
        for batch in step.iterate(batches([4] * 3)):
            with step as s:
                s.backward(loss_fn(model, batch))
        assert doc.precision == precision and doc.device == torch.device("cpu")
        tips[precision] = doc.tips()
    assert "precision='bf16'" in tips["fp16"][0] and "fp16 on a CPU" in tips["fp16"][0]
    assert not any("fp16 on a CPU" in t for t in tips["bf16"])


def test_fp16_tip_needs_a_cpu() -> None:
    """fp16 on a CUDA device gets no CPU tip; a doctor that knows no device gives none either."""
    doc = loopkit.doctor(device="cuda", sample_syncs_at=())
    doc.precision = "fp16"
    assert doc.device == torch.device("cuda")
    assert not any("fp16 on a CPU" in t for t in doc.tips())
    doc.device = None
    assert doc.device is None and not any("fp16 on a CPU" in t for t in doc.tips())
    doc.device = "cpu"
    assert any("fp16 on a CPU" in t for t in doc.tips())


def test_loopkits_own_syncs_are_labelled_not_blamed_on_the_user() -> None:
    """A read inside expected_sync is reported as loopkit's own, with no sync tip for it."""
    model = mlp()
    doc = loopkit.doctor(sample_syncs_at=(2, 3, 4), sample_syncs_every=None)
    for batch in batches([4] * 5):
        with doc:
            loss = loss_fn(model, batch)
            loss.backward()
            with expected_sync("fp16's overflow check"):
                torch.isfinite(loss).tolist()  # what the fp16 scaler reads once per update
    stats = doc.stats()
    assert stats["syncs_per_step"] == 0.0 and stats["sync_ops"] == {}
    assert stats["expected_syncs_per_step"] == {"fp16's overflow check": 1.0}
    assert "1.0 per step needed by fp16's overflow check" in doc.report()
    assert not any("host-device syncs" in t for t in doc.tips())


def test_the_device_changes_only_between_steps() -> None:
    """Setting the doctor's device inside a step, or to a non-device, raises and keeps the old."""
    doc = loopkit.doctor(device="cpu")
    with doc, pytest.raises(RuntimeError, match="between steps"):
        doc.device = "meta"
    with pytest.raises(TypeError, match=r"str, int or torch\.device"):
        doc.device = 2.5  # type: ignore[assignment]
    with pytest.raises(ValueError, match="is not a device"):
        doc.device = "nodevice"
    assert doc.device == torch.device("cpu")


@pytest.mark.filterwarnings("ignore:fp16 autocast on a CPU")
def test_fp16_overflow_check_is_loopkits_own_sync() -> None:
    """loopkit.step(precision="fp16"): the scaler's inf check is loopkit's sync, not the user's."""
    model = mlp()
    doc = loopkit.doctor(sample_syncs_at=(2, 3, 4), sample_syncs_every=None)
    step = loopkit.step(
        model, torch.optim.SGD(model.parameters(), lr=0.1), precision="fp16", doctor=doc
    )
    for batch in step.iterate(batches([4] * 5)):
        with step as s:
            s.backward(loss_fn(model, batch))
    stats = doc.stats()
    assert stats["sync_ops"] == {}
    assert stats["expected_syncs_per_step"] == {"fp16's overflow check": 1.0}
    assert not any("host-device syncs" in t for t in doc.tips())


@pytest.mark.filterwarnings("ignore:fp16 autocast on a CPU")
def test_attach_alone_tells_the_doctor_what_step_tells_it() -> None:
    """doc.attach(model, optimizer, precision, device) leaves the doctor as loopkit.step does."""
    model = mlp()
    opt = torch.optim.AdamW(model.parameters())
    alone, inside = loopkit.doctor(sample_syncs_at=()), loopkit.doctor(sample_syncs_at=())
    alone.attach(model, opt, "fp16", "cpu")
    loopkit.step(model, opt, precision="fp16", doctor=inside)
    for doc in (alone, inside):
        assert (doc.precision, doc.device, doc.optimizer) == ("fp16", torch.device("cpu"), opt)
    for batch in batches([4] * 3):
        with alone:
            loss_fn(model, batch).backward()
    assert "fp16 on a CPU" in alone.tips()[0]


def test_step_tells_the_doctor_through_attach(monkeypatch: pytest.MonkeyPatch) -> None:
    """loopkit.step calls the attach a user calls alone: one path, so one behaviour."""
    calls: list[tuple[Any, ...]] = []
    real = loopkit.doctor.attach

    def spy(self: loopkit.doctor, *args: Any, **kwargs: Any) -> None:
        calls.append((*args, *kwargs.values()))
        real(self, *args, **kwargs)

    monkeypatch.setattr(loopkit.doctor, "attach", spy)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loopkit.step(model, opt, precision="bf16", doctor=loopkit.doctor())
    assert calls == [(model, opt, "bf16", torch.device("cpu"))]


def test_attach_takes_the_device_from_the_model_and_a_precision_name() -> None:
    """Without device= the model's is used; a dtype names a precision; None gives no tips."""
    model = mlp()
    doc = loopkit.doctor()
    doc.attach(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.bfloat16)
    assert doc.device == torch.device("cpu") and doc.precision == "bf16"
    doc.attach(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert doc.precision is None


@pytest.mark.parametrize(
    ("bad", "exc", "hint"),
    [
        (lambda m, o: (m, "sgd"), TypeError, "torch.optim.Optimizer"),
        (lambda m, o: ("model", o), TypeError, "nn.Module"),
        (lambda m, o: (m, o, "fp8"), ValueError, "'bf16', 'fp16' or 'fp32'"),
        (lambda m, o: (m, o, "fp32", 2.5), TypeError, r"str, int or torch\.device"),
    ],
)
def test_attach_refuses_bad_arguments_and_changes_nothing(
    bad: Any, exc: type[Exception], hint: str
) -> None:
    """A bad argument raises with the fix and leaves what the doctor knew unchanged."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    doc = loopkit.doctor()
    doc.attach(model, opt, "bf16", "cpu")
    with pytest.raises(exc, match=hint):
        doc.attach(*bad(mlp(1), torch.optim.SGD(model.parameters(), lr=0.2)))
    assert (doc.precision, doc.device, doc.optimizer) == ("bf16", torch.device("cpu"), opt)


def test_attach_inside_a_step_is_refused() -> None:
    """The loop a doctor measures changes between steps, not inside one."""
    model = mlp()
    doc = loopkit.doctor()
    with doc, pytest.raises(RuntimeError, match="between steps"):
        doc.attach(model, torch.optim.SGD(model.parameters(), lr=0.1))


@requires_cuda
def test_attach_to_a_cuda_model_times_phases_with_events() -> None:
    """Attached alone to a CUDA model (no device=), the doctor times phases by CUDA events."""
    model = mlp().cuda()
    doc = loopkit.doctor(sample_syncs_at=())
    doc.attach(model, torch.optim.SGD(model.parameters(), lr=0.1), "bf16")
    assert doc.device is not None and doc.device.type == "cuda"
    for _ in range(2):
        with doc:
            model(torch.randn(4, 8, device="cuda")).sum().backward()
    assert doc.stats()["seconds"]["compute"] > 0
    assert doc._clock.cuda


def _flops_of_every_batch(model: nn.Module, data: list[tuple[torch.Tensor, torch.Tensor]]) -> int:
    """FlopCounterMode over each whole batch's forward and backward: what the run computed."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        for x, y in data:
            nn.functional.mse_loss(model(x), y).backward()
    model.zero_grad(set_to_none=True)
    return int(counter.get_total_flops())


@pytest.mark.parametrize(
    ("sizes", "micro_batch", "accumulate"),
    [
        ([20, 20, 20, 13], 8, 2),  # chunks 8 + 8 + 4 (the counted one is 8), then 8 + 5
        ([9, 9, 9, 9, 2], 4, 1),  # 4 + 4 + 1 each: the counted chunk is a 4
        ([16, 16, 16, 5], None, 1),  # whole batches, a ragged last one (and the lookahead)
        ([3, 11, 11, 11], None, 3),  # the counted step is the 11, the first a 3
    ],
)
def test_flops_of_unequal_steps_are_every_batchs(
    sizes: list[int], micro_batch: int | None, accumulate: int
) -> None:
    """The doctor's FLOPs (per step x steps, and FLOP/s) are FlopCounterMode's over every
    batch, whatever the chunks and a ragged last batch: counted per sample, not per step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 1))
    data = [(torch.randn(n, 6), torch.randn(n, 1)) for n in sizes]
    truth = _flops_of_every_batch(model, data)
    doc = loopkit.doctor(sink=lambda _: None, sample_syncs_at=())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    step = loopkit.step(model, opt, accumulate=accumulate, micro_batch=micro_batch, doctor=doc)
    for x, y in step.iterate(data):
        with step as s:
            s.backward(nn.functional.mse_loss(model(x), y))
    stats = doc.stats()
    chunks = sum(-(-n // micro_batch) for n in sizes) if micro_batch else len(sizes)
    assert stats["steps"] == chunks
    assert stats["flops_per_step"] is not None and stats["flops_per_s"] is not None
    assert stats["flops_per_step"] * stats["steps"] == pytest.approx(truth, rel=1e-12)
    assert stats["flops_per_s"] == pytest.approx(truth / doc._clock.wall, rel=1e-12)


def test_flops_alone_in_a_plain_loop_with_a_ragged_last_batch() -> None:
    """doc.iterate over batches of 7 and a last of 2: the steps' samples scale the count."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 1))
    data = [(torch.randn(n, 6), torch.randn(n, 1)) for n in (7, 7, 2)]
    truth = _flops_of_every_batch(model, data)
    doc = loopkit.doctor(sink=lambda _: None, sample_syncs_at=())
    for x, y in doc.iterate(data):
        with doc:
            nn.functional.mse_loss(model(x), y).backward()
    stats = doc.stats()
    assert stats["flops_per_step"] is not None
    assert stats["flops_per_step"] * stats["steps"] == pytest.approx(truth, rel=1e-12)
    told = loopkit.doctor(sink=lambda _: None, sample_syncs_at=())
    for n in (2, 7, 7):  # no doc.iterate: the samples said per step instead
        with told:
            told.count(samples=n)
            nn.functional.mse_loss(model(torch.randn(n, 6)), torch.randn(n, 1)).backward()
    assert told.stats()["flops_per_step"] == pytest.approx(truth / 3, rel=1e-12)


def test_a_groups_flops_count_every_chunk_and_ragged_batch() -> None:
    """A loopkit.steps member with a doctor, in chunks (micro_batch=) and a ragged last batch:
    FLOPs per step times steps equal FlopCounterMode over every whole batch, within 5%."""
    from torch.utils.flop_counter import FlopCounterMode

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 1))
    other = nn.Linear(64, 1)
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(n, 64, generator=g), torch.randn(n, 1, generator=g))
            for n in (32, 32, 32, 13)]  # fmt: skip
    with FlopCounterMode(display=False) as fc:
        for x, y in data:
            nn.functional.mse_loss(model(x), y).backward()
    truth = fc.get_total_flops()
    doc = loopkit.doctor()
    a = loopkit.step(
        model, torch.optim.SGD(model.parameters(), lr=0.01), micro_batch=24, doctor=doc
    )
    b = loopkit.step(other, torch.optim.SGD(other.parameters(), lr=0.01), micro_batch=24)
    for x, y in loopkit.steps(a, b).iterate(data):
        for m, s in ((model, a), (other, b)):
            with s as st:
                st.backward(nn.functional.mse_loss(m(x), y))
    stats = doc.stats()
    assert stats["flops_per_step"] * stats["steps"] == pytest.approx(truth, rel=0.05)
