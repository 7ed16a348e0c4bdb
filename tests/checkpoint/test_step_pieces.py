"""What a step piece saves: a step's (and each group member's) own scheduler, an accumulate's
amp=, and the precision, which a resume may not change."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_bit_equal, params
from torch import nn

import loopkit
from loopkit import distributed

pytestmark = pytest.mark.filterwarnings("ignore:fp16 autocast on a CPU")


def _gan(directory: Path, *, schedulers: tuple[bool, bool] = (True, True), members: int = 2,
         precisions: tuple[str, str] = ("bf16", "fp32"),
         sched_in_extra: bool = False) -> dict[str, Any]:  # fmt: skip
    """A GAN-shaped group: D's and G's steps, each with its own StepLR (stepped per update)."""
    torch.manual_seed(0)
    G = nn.Sequential(nn.Linear(8, 16), nn.LeakyReLU(0.2), nn.Linear(16, 2))
    D = nn.Sequential(nn.Linear(2, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
    opt_g = torch.optim.Adam(G.parameters(), lr=2e-3)
    opt_d = torch.optim.Adam(D.parameters(), lr=2e-3)
    sched_d = torch.optim.lr_scheduler.StepLR(opt_d, 2, 0.5) if schedulers[0] else None
    sched_g = torch.optim.lr_scheduler.StepLR(opt_g, 2, 0.5) if schedulers[1] else None
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(32, 2, generator=g),
                                          torch.randn(32, 8, generator=g))  # fmt: skip
    loader = distributed.loader(data, batch_size=4, num_workers=0, seed=0)
    d_step = loopkit.step(D, opt_d, accumulate=2, scheduler=sched_d, precision=precisions[0])
    g_step = loopkit.step(G, opt_g, accumulate=2, frozen=[D], scheduler=sched_g,
                          precision=precisions[1])  # fmt: skip
    group = loopkit.steps(*[d_step, g_step][:members])
    extra: dict[str, Any] = {"opt_g": opt_g, "opt_d": opt_d}
    if sched_in_extra:
        extra["sched_g"] = sched_g
    ckpt = loopkit.Checkpointer(directory, model=nn.ModuleList([G, D]), step=group,
                                loader=loader, extra=extra)  # fmt: skip
    return {"G": G, "D": D, "d": d_step, "g": g_step, "group": group, "loader": loader,
            "ckpt": ckpt, "scheds": (sched_d, sched_g)}  # fmt: skip


def _train_gan(run: dict[str, Any], stop_after_save: int | None = None) -> None:
    bce = nn.BCEWithLogitsLoss()
    D, G, loader, ckpt = run["D"], run["G"], run["loader"], run["ckpt"]
    for _ in range(loader.epoch, 2):
        for real, noise in run["group"].iterate(loader):
            with run["d"] as s:
                s.backward(bce(D(real), torch.ones(4, 1)))
                fake = G(noise)
                s.backward(bce(D(fake.detach()), torch.zeros(4, 1)))
            if len(run["group"].members) > 1:
                with run["g"] as s:
                    s.backward(bce(D(fake), torch.ones(4, 1)))
            if ckpt.maybe_save(every=3) and run["group"].updates == stop_after_save:
                return


def _lrs(run: dict[str, Any]) -> list[float]:
    return [s.get_last_lr()[0] for s in run["scheds"] if s is not None]


@pytest.mark.parametrize("sched_in_extra", [False, True], ids=["by_the_step", "in_extra"])
def test_a_group_resumes_its_members_schedulers_bit_identical(
    tmp_path: Path, sched_in_extra: bool
) -> None:
    """Killed after the save at update 3, resumed: the members' schedulers and weights are an
    uninterrupted run's, bit for bit; a scheduler also in extra= is saved there only."""
    whole = _gan(tmp_path / "whole", sched_in_extra=sched_in_extra)
    _train_gan(whole)
    first = _gan(tmp_path / "parts", sched_in_extra=sched_in_extra)
    _train_gan(first, stop_after_save=3)
    saved = loopkit.load_checkpoint(first["ckpt"].checkpoints()[-1])
    members = saved["step"]["steps"]
    assert "scheduler" in members[0] and ("scheduler" in members[1]) is not sched_in_extra
    assert [m["precision"] for m in members] == ["bf16", "fp32"]
    second = _gan(tmp_path / "parts", sched_in_extra=sched_in_extra)
    second["ckpt"].resume()
    assert _lrs(second) == _lrs(first) != [2e-3, 2e-3]
    _train_gan(second)
    assert _lrs(second) == _lrs(whole)
    assert_bit_equal(params(whole["G"]) + params(whole["D"]),
                     params(second["G"]) + params(second["D"]))  # fmt: skip


def _state(run: dict[str, Any]) -> Any:
    return (params(run["G"]) + params(run["D"]), [copy.deepcopy(s.state_dict()) for s in
            run["scheds"] if s is not None], copy.deepcopy(run["group"].state_dict()))  # fmt: skip


@pytest.mark.parametrize(
    ("changes", "says"),
    [
        ({"schedulers": (True, False)}, "holds the group's step 1's scheduler"),
        ({"members": 1}, "saved with 2 steps in the group"),
        ({"sched_in_extra": True}, "holds the group's step 1's scheduler"),
        ({"precisions": ("fp32", "fp32")}, "group's step 0 was saved with precision 'bf16'"),
    ],
    ids=["member_without_scheduler", "member_count", "scheduler_moved", "precision"],
)
def test_a_group_built_otherwise_is_refused_before_anything_loads(
    tmp_path: Path, changes: dict[str, Any], says: str
) -> None:
    """A member without its scheduler now, another count of members, a scheduler moved to
    extra=, another precision: CheckpointError, and nothing of the run changed."""
    _train_gan(_gan(tmp_path), stop_after_save=3)
    run = _gan(tmp_path, **changes)
    before = _state(run)
    with pytest.raises(loopkit.CheckpointError, match=says):
        run["ckpt"].resume()
    after = _state(run)
    assert_bit_equal(before[0], after[0])
    assert before[1:] == after[1:] and run["loader"].epoch == 0


def _single(directory: Path, *, precision: str = "fp32", scheduler: str = "step",
            amp: str | None = None, kind: str = "step") -> dict[str, Any]:  # fmt: skip
    """One model; its StepLR given to the step and (``scheduler="both"``) to the Checkpointer."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    scaler_amp = loopkit.autocast_step(amp, device_type="cpu") if amp is not None else None
    if kind == "step":
        stepper: Any = loopkit.step(model, opt, precision=precision, scheduler=sched)
    else:
        stepper = loopkit.accumulate(model, opt, every=1, scheduler=sched, amp=scaler_amp)
    ckpt = loopkit.Checkpointer(directory, model=model, optimizer=opt, step=stepper,
                                scheduler=sched if scheduler == "both" else None)  # fmt: skip
    return {"model": model, "step": stepper, "ckpt": ckpt, "sched": sched, "amp": scaler_amp}


def _train_single(run: dict[str, Any], updates: int) -> None:
    g = torch.Generator().manual_seed(run["step"].updates)
    model, stepper, amp = run["model"], run["step"], run["amp"]
    while stepper.updates < updates:
        x, y = torch.randn(4, 4, generator=g), torch.randn(4, 1, generator=g)
        with stepper:
            with amp if amp is not None else torch.autocast("cpu", enabled=False):
                loss = nn.functional.mse_loss(model(x), y)
            stepper.backward(loss)


@pytest.mark.parametrize("kind", ["step", "accumulate"])
def test_a_single_steps_own_scheduler_is_saved_unless_the_checkpointer_saves_it(
    tmp_path: Path, kind: str
) -> None:
    """Checkpointer(step=s) saves s's scheduler (given only to the step) in the step's entry;
    given as scheduler= too, it is saved there only, as before. Resumed exactly either way."""
    for where in ("step", "both"):
        run = _single(tmp_path / where, scheduler=where, kind=kind)
        _train_single(run, 3)
        run["ckpt"].save()
        saved = loopkit.load_checkpoint(run["ckpt"].checkpoints()[-1])
        assert ("scheduler" in saved["step"]) is (where == "step")
        assert ("scheduler" in saved) is (where == "both")
        again = _single(tmp_path / where, scheduler=where, kind=kind)
        again["ckpt"].resume()
        assert again["sched"].state_dict() == run["sched"].state_dict()
        assert again["sched"].get_last_lr() == [1e-2 / 8]


def test_an_accumulates_own_amp_is_saved(tmp_path: Path) -> None:
    """accumulate(amp=fp16) without the Checkpointer's amp=: its GradScaler is in the step's
    entry and comes back on resume."""
    run = _single(tmp_path, kind="accumulate", amp="fp16")
    _train_single(run, 3)
    run["amp"].scaler.update(123.0)  # a scale no fresh scaler has
    run["ckpt"].save()
    again = _single(tmp_path, kind="accumulate", amp="fp16")
    again["ckpt"].resume()
    assert again["amp"].state_dict()["scaler"]["scale"] == 123.0


PAIRS = [(a, b) for a in ("fp32", "bf16", "fp16") for b in ("fp32", "bf16", "fp16") if a != b]


@pytest.mark.parametrize(("saved", "resumed"), PAIRS, ids=[f"{a}_to_{b}" for a, b in PAIRS])
@pytest.mark.parametrize("piece", ["step", "amp"])
def test_a_resume_in_another_precision_is_refused(
    tmp_path: Path, saved: str, resumed: str, piece: str
) -> None:
    """Every change of precision, through step= or amp=: CheckpointError before anything
    loads (weights, scheduler and the amp's state unchanged)."""

    def build(precision: str) -> dict[str, Any]:
        if piece == "step":
            return _single(tmp_path, precision=precision)
        torch.manual_seed(0)
        model = nn.Linear(4, 1)
        amp = loopkit.autocast_step(precision, device_type="cpu")
        ckpt = loopkit.Checkpointer(tmp_path, model=model, amp=amp)
        return {"model": model, "ckpt": ckpt, "amp": amp, "sched": None}

    first = build(saved)
    first["ckpt"].save()
    run = build(resumed)
    with torch.no_grad():
        for p in run["model"].parameters():
            p.add_(1.0)  # not the saved weights: a load would show
    before = (params(run["model"]), run["amp"] and run["amp"].state_dict(),
              run["sched"] and run["sched"].state_dict())  # fmt: skip
    with pytest.raises(loopkit.CheckpointError, match="precision"):
        run["ckpt"].resume()
    assert_bit_equal(before[0], params(run["model"]))
    assert before[1:] == (run["amp"] and run["amp"].state_dict(),
                          run["sched"] and run["sched"].state_dict())  # fmt: skip


def test_a_checkpoint_without_a_recorded_precision_still_resumes(tmp_path: Path) -> None:
    """A file written before precisions were recorded (no 'precision' entry) is not refused
    for it: its GradScaler still decides fp16 or not."""
    run = _single(tmp_path, precision="bf16")
    _train_single(run, 2)
    path = run["ckpt"].save()
    state = torch.load(path, weights_only=True)
    del state["step"]["precision"]
    torch.save(state, path)
    again = _single(tmp_path, precision="bf16")
    assert again["ckpt"].resume() == path and again["step"].updates == 2


def test_a_step_scheduler_a_checkpoint_cannot_hold_is_named_and_left_out(tmp_path: Path) -> None:
    """A scheduler without state_dict/load_state_dict: a warning names it; the rest resumes."""

    class InverseSqrt:  # stateless: its lr follows the optimizer's own (saved) step count
        def __init__(self, optimizer: torch.optim.Optimizer) -> None:
            self.optimizer = optimizer

        def step(self) -> None:
            n = self.optimizer.state_dict()["state"][0]["step"]
            for g in self.optimizer.param_groups:
                g["lr"] = 0.1 / float(n) ** 0.5

    def build() -> tuple[nn.Module, loopkit.step, loopkit.Checkpointer]:
        torch.manual_seed(0)
        model = nn.Linear(2, 1)
        opt = torch.optim.Adam(model.parameters(), lr=0.1)
        step = loopkit.step(model, opt, scheduler=InverseSqrt(opt))
        with pytest.warns(UserWarning, match=r"scheduler \(InverseSqrt\) has no state_dict"):
            ckpt = loopkit.Checkpointer(tmp_path, model=model, optimizer=opt, step=step)
        return model, step, ckpt

    model, step, ckpt = build()
    batch = torch.ones(4, 2)
    for _ in range(3):
        with step as s:
            s.backward(model(batch).pow(2).mean())
    ckpt.save()
    with step as s:
        s.backward(model(batch).pow(2).mean())
    again, step2, ckpt2 = build()
    ckpt2.resume()
    with step2 as s:
        s.backward(again(batch).pow(2).mean())
    pairs = zip(model.parameters(), again.parameters(), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)


def _logged_group(directory: Path, *, logged: bool = True, sinks: int = 1) -> dict[str, Any]:
    """A two-step group whose first step has its own log= (a CSVSink, every 3 micro-steps of
    accumulate=2: flushes fall between updates); the Checkpointer has step= and no extra=."""
    torch.manual_seed(0)
    a, b = nn.Linear(4, 1), nn.Linear(4, 1)
    opt_a, opt_b = torch.optim.SGD(a.parameters(), lr=0.1), torch.optim.SGD(b.parameters(), lr=0.1)
    csv_sinks: list[Any] = [loopkit.CSVSink(directory / f"m{i}.csv") for i in range(sinks)]
    log = loopkit.detach_logging(every=3, sink=csv_sinks) if logged else None
    group = loopkit.steps(loopkit.step(a, opt_a, accumulate=2, log=log),
                          loopkit.step(b, opt_b, accumulate=2))  # fmt: skip
    data = torch.utils.data.TensorDataset(
        torch.randn(48, 4, generator=torch.Generator().manual_seed(1))
    )
    loader = distributed.loader(data, batch_size=4, num_workers=0, seed=0)  # 6 updates
    ckpt = loopkit.Checkpointer(directory / "ck", model=nn.ModuleList([a, b]), step=group,
                                loader=loader, extra={"opt_a": opt_a, "opt_b": opt_b})  # fmt: skip
    return {"models": (a, b), "group": group, "log": log, "ckpt": ckpt, "loader": loader,
            "sinks": csv_sinks}  # fmt: skip


def _train_group(run: dict[str, Any], kill_at: int | None = None) -> None:
    """One pass of both members' micro-steps; a kill leaves at update ``kill_at`` unclosed."""
    a, b = run["models"]
    first, second = run["group"].members
    for _ in range(run["loader"].epoch, 1):
        for (x,) in run["group"].iterate(run["loader"]):
            with first as s:
                s.backward(a(x).pow(2).mean())
            with second as s:
                s.backward(b(x).abs().mean())
            run["ckpt"].maybe_save(every=2)
            if run["group"].updates == kill_at and run["group"].micro_step == 0:
                # The process dies here: its files close unflushed (left open, the handle
                # would be collected, and reported, in whatever test runs next).
                for sink in run["sinks"]:
                    if sink._file is not None:  # a sink of a log that never flushed: unopened
                        sink._file.close()
                return
    if run["log"] is not None:
        run["log"].close()


def test_a_group_members_own_log_resumes_with_the_step(tmp_path: Path) -> None:
    """Checkpointer(step=group) with no extra=: the member's log (its cadence, unflushed values
    and CSV run) resumes from the save at update 4, killed at 5: the uninterrupted CSV."""
    whole = _logged_group(tmp_path / "whole")
    _train_group(whole)
    first = _logged_group(tmp_path / "parts")
    _train_group(first, kill_at=5)
    saved = loopkit.load_checkpoint(first["ckpt"].checkpoints()[-1])
    assert saved["step"]["steps"][0]["log"]["since_flush"] == 2
    assert "log" not in saved["step"]["steps"][1]
    second = _logged_group(tmp_path / "parts")
    second["ckpt"].resume()
    _train_group(second)
    rows = (tmp_path / "whole" / "m0.csv").read_text().splitlines()
    assert len(rows) == 1 + 4 and (tmp_path / "parts" / "m0.csv").read_text().splitlines() == rows


def test_a_missing_or_unused_log_state_is_no_error(tmp_path: Path) -> None:
    """Logging is not training state: saved without the log, resumed with one (the log
    starts afresh); saved with it, resumed without a log (ignored). Both resume the step."""
    for saved_with, resumed_with in ((False, True), (True, False)):
        directory = tmp_path / str(saved_with)
        run = _logged_group(directory, logged=saved_with)
        _train_group(run, kill_at=2)
        again = _logged_group(directory, logged=resumed_with)
        assert again["ckpt"].resume() is not None
        assert again["group"].updates == 2
        assert again["log"] is None or (again["log"].step == 0 and again["log"]._values == {})


def test_a_step_log_state_for_other_sinks_is_refused_before_anything_loads(
    tmp_path: Path,
) -> None:
    """The step's log built with other sinks than when saving: CheckpointError naming the fix,
    and nothing loaded (weights, counters, the log's count)."""
    _train_group(_logged_group(tmp_path), kill_at=2)
    run = _logged_group(tmp_path, sinks=2)
    before = params(run["models"][0]) + params(run["models"][1])
    with pytest.raises(loopkit.CheckpointError, match="same sinks, in the same order"):
        run["ckpt"].resume()
    assert_bit_equal(before, params(run["models"][0]) + params(run["models"][1]))
    assert run["group"].updates == 0 and run["log"].step == 0
