"""The guards of a half-ported loop: user code doing what the step does is caught, with its line."""

from __future__ import annotations

import copy
import gc
import inspect
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from helpers import ROOT, batches, deep, loss_fn, mlp, params
from torch import nn

import loopkit
from loopkit import distributed


def _line(marker: str) -> str:
    """``this_file:N`` of the line of this file that holds ``marker`` (a comment tag)."""
    source = Path(__file__).read_text().splitlines()
    hits = [i for i, text in enumerate(source, 1) if text.rstrip().endswith(f"# {marker}")]
    assert len(hits) == 1, marker
    return f"{__file__}:{hits[0]}"


def _setup(every: int = 2, scheduler: bool = False):  # type: ignore[no-untyped-def]
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5) if scheduler else None
    return model, opt, sched, loopkit.step(model, opt, accumulate=every, scheduler=sched)


def _micro(step: loopkit.step, model: nn.Module, batch: object) -> None:
    with step as s:
        s.backward(loss_fn(model, batch))  # type: ignore[arg-type]


def test_users_optimizer_step_is_refused_before_it_changes_anything() -> None:
    """optimizer.step() by user code on an owned optimizer raises naming the line; nothing moves."""
    model, opt, _, step = _setup(every=1)
    data = batches([4, 4])
    _micro(step, model, data[0])  # loopkit's own update works: one real update
    assert step.updates == 1 and opt.state
    loss_fn(model, data[1]).backward()
    weights, state = copy.deepcopy(params(model)), copy.deepcopy(opt.state_dict())
    with pytest.raises(RuntimeError, match="Remove that line") as err:
        opt.step()  # user-step
    assert _line("user-step") in str(err.value)
    assert all(torch.equal(a, b) for a, b in zip(weights, params(model), strict=True))
    assert str(opt.state_dict()) == str(state)
    del step
    gc.collect()
    opt.step()  # once no step owns it, the optimizer is the user's again
    assert not torch.equal(weights[0], params(model)[0])


def test_a_scheduler_stepped_by_user_code_is_refused_at_the_next_update() -> None:
    """scheduler.step() next to loopkit's raises at the window end, names it, updates nothing."""
    model, _, sched, step = _setup(every=2, scheduler=True)
    data = batches([4, 4, 4, 4])
    _micro(step, model, data[0])
    _micro(step, model, data[1])
    assert step.updates == 1 and sched.last_epoch == 1  # type: ignore[union-attr]
    _micro(step, model, data[2])
    sched.step()  # user-sched
    weights = copy.deepcopy(params(model))
    with pytest.raises(RuntimeError, match="schedule would run too fast") as err:
        _micro(step, model, data[3])
    assert _line("user-sched") in str(err.value)
    assert all(torch.equal(a, b) for a, b in zip(weights, params(model), strict=True))
    assert step.updates == 1


def test_a_resumed_scheduler_is_not_taken_for_a_users_step(tmp_path: Path) -> None:
    """A Checkpointer resume moves the scheduler: the next update is not refused."""
    model, opt, sched, step = _setup(every=1, scheduler=True)
    ckpt = loopkit.Checkpointer(tmp_path, model=model, optimizer=opt, scheduler=sched, step=step)
    for batch in batches([4, 4, 4]):
        _micro(step, model, batch)
    ckpt.save()
    model2, opt2, sched2, step2 = _setup(every=1, scheduler=True)
    loopkit.Checkpointer(
        tmp_path, model=model2, optimizer=opt2, scheduler=sched2, step=step2
    ).resume()
    assert sched2.last_epoch == 3  # type: ignore[union-attr]
    _micro(step2, model2, batches([4])[0])
    assert step2.updates == 4 and sched2.last_epoch == 4  # type: ignore[union-attr]


def test_a_scheduler_the_step_does_not_own_is_the_users() -> None:
    """A scheduler not given to the step may be stepped by the loop as before."""
    model, opt, _, step = _setup(every=1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    for batch in batches([4, 4]):
        _micro(step, model, batch)
        sched.step()
    assert step.updates == 2 and sched.last_epoch == 2


@pytest.mark.parametrize("where", ["between micro-steps", "after the last backward"])
def test_zero_grad_inside_a_window_is_refused_with_its_line(where: str) -> None:
    """A zero_grad() that would drop the window's gradients raises, naming the zero_grad line."""
    model, opt, _, step = _setup(every=2)
    a, b = batches([4, 4])
    weights = copy.deepcopy(params(model))
    _micro(step, model, a)
    with pytest.raises(RuntimeError, match="were dropped") as err:
        if where == "between micro-steps":
            opt.zero_grad()
            _micro(step, model, b)
        else:
            with step as s:
                s.backward(loss_fn(model, b))
                opt.zero_grad()
    assert "optimizer.zero_grad() at " in str(err.value) and __file__ in str(err.value)
    assert all(torch.equal(x, y) for x, y in zip(weights, params(model), strict=True))
    assert step.updates == 0


def test_a_zero_grad_before_the_window_opens_is_harmless() -> None:
    """The legacy `zero_grad()` at the top of each iteration is fine where a window opens."""
    model, opt, _, step = _setup(every=1)
    for batch in batches([4, 4, 4]):
        opt.zero_grad()
        _micro(step, model, batch)
    assert step.updates == 3


def test_a_foreign_backward_through_the_model_is_refused() -> None:
    """A GAN's G loss backward through D (D's window open) raises at D's next micro-step."""
    torch.manual_seed(0)
    d, g = nn.Linear(4, 1), nn.Linear(2, 4)
    d_opt = torch.optim.SGD(d.parameters(), lr=0.1)
    g_opt = torch.optim.SGD(g.parameters(), lr=0.1)
    d_step = loopkit.step(d, d_opt, accumulate=2)
    g_step = loopkit.step(g, g_opt, accumulate=2)
    real, z = torch.randn(8, 4), torch.randn(8, 2)
    with d_step as s:
        s.backward(d(real).mean() - d(g(z).detach()).mean())
    with g_step as s:
        s.backward(d(g(z)).mean())  # reaches D's parameters: D's window is open
    with pytest.raises(RuntimeError, match="another loss through this model"), d_step as s:
        s.backward(d(real).mean())


def test_a_hand_written_clip_mid_window_is_refused() -> None:
    """clip_grad_norm_ on a partial window's gradients (left from the old loop) raises."""
    model, _, _, step = _setup(every=2)
    a, b = batches([4, 4])
    _micro(step, model, a)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
    with pytest.raises(RuntimeError, match="changed by code outside"):
        _micro(step, model, b)


def test_two_backward_calls_in_one_micro_step_are_loopkits_own() -> None:
    """s.backward twice in a micro-step is no foreign change."""
    model, _, _, step = _setup(every=2)
    for batch in batches([4, 4]):
        with step as s:
            s.backward(loss_fn(model, batch))
            s.backward(loss_fn(model, batch))
    assert step.updates == 1


def test_a_collected_step_with_an_open_window_warns() -> None:
    """Micro-steps that never became an update are reported when the step goes away."""
    model, _, _, step = _setup(every=4)
    for batch in batches([4, 4, 4]):
        _micro(step, model, batch)  # window-open
    with pytest.warns(loopkit.OpenWindowWarning, match=r"^3 micro-step\(s\).*step.flush\(\)"):
        del step
        gc.collect()


def test_an_open_window_at_exit_is_reported_with_its_line(tmp_path: Path) -> None:
    """A script whose plain loop ends mid-window prints the warning as the process exits."""
    script = tmp_path / "plain.py"
    script.write_text(
        inspect.cleandoc(
            """
            import torch, loopkit
            model = torch.nn.Linear(3, 1)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            step = loopkit.step(model, opt, accumulate=4)
            for x in torch.randn(7, 2, 3):
                with step as s:
                    s.backward(model(x).mean())
            print("updates", step.updates)
            """
        )
    )
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert proc.returncode == 0 and "updates 1" in proc.stdout, proc.stderr
    assert "OpenWindowWarning: 3 micro-step(s)" in proc.stderr
    assert f"window opened at {script}:6" in proc.stderr


def test_iterate_and_flush_leave_nothing_to_report() -> None:
    """A ragged tail closed by iterate() or flush() warns nothing, at any point."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for closing in ("iterate", "flush"):
            model, _, _, step = _setup(every=4)
            data = batches([4] * 7)
            for batch in step.iterate(data) if closing == "iterate" else data:
                _micro(step, model, batch)
            if closing == "flush":
                step.flush()
            assert step.updates == 2
            del step
            gc.collect()


def test_a_window_spanning_two_passes_of_a_loader_warns_at_the_second() -> None:
    """7 batches, accumulate=4, a plain loop over a distributed.loader: the epoch-2 pass warns."""
    model, _, _, step = _setup(every=4)
    dataset = torch.utils.data.TensorDataset(torch.randn(28, 8), torch.randn(28, 1))
    loader = distributed.loader(dataset, batch_size=4, seed=0, num_workers=0)
    val = distributed.loader(dataset, batch_size=7, shuffle=False, num_workers=0)
    seen: list[int] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for epoch in range(2):
            for x, y in loader:
                if len(seen) == 2:
                    list(val)  # another loader's pass mid-window is not a span
                with step as s:  # plain-loop
                    s.backward(nn.functional.mse_loss(model(x), y))
                seen.append(epoch)
    spans = [w for w in caught if issubclass(w.category, loopkit.OpenWindowWarning)]
    assert len(spans) == 1, [str(w.message) for w in caught]
    assert "spans two passes" in str(spans[0].message)
    assert _line("plain-loop") in str(spans[0].message)
    assert spans[0].filename == __file__
    step.flush()


def test_iterate_over_the_same_loader_never_spans() -> None:
    """With step.iterate(loader) each pass's ragged window closes: no warning in two epochs."""
    model, _, _, step = _setup(every=4)
    dataset = torch.utils.data.TensorDataset(torch.randn(28, 8), torch.randn(28, 1))
    loader = distributed.loader(dataset, batch_size=4, seed=0, num_workers=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(2):
            for x, y in step.iterate(loader):
                with step as s:
                    s.backward(nn.functional.mse_loss(model(x), y))
    assert step.updates == 4


@pytest.mark.parametrize("micro_batch", [None, 2])
def test_an_iteration_based_loop_over_iterate_spans_passes_without_warning(
    micro_batch: int | None,
) -> None:
    """step.iterate over an endless chain of a loader's passes, stopped by until: no warning,
    though its windows span passes (the loop chains them on purpose)."""
    model, opt, _, _ = _setup(every=3)
    step = loopkit.step(model, opt, accumulate=3, micro_batch=micro_batch)
    dataset = torch.utils.data.TensorDataset(torch.randn(20, 8), torch.randn(20, 1))
    loader = distributed.loader(dataset, batch_size=4, seed=0, num_workers=0)

    def endless():  # type: ignore[no-untyped-def]
        while True:
            yield from loader

    stop = loopkit.until(step, max_updates=7)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for x, y in step.iterate(endless()):
            with step as s:
                s.backward(nn.functional.mse_loss(model(x), y))
            if stop.check():
                break
    assert step.updates == 7 and loader.epoch >= 4


def test_a_window_left_open_by_an_error_is_not_reported() -> None:
    """An exception inside a micro-step leaves its window open: no OpenWindowWarning on top of
    the error; a later micro-step that succeeds makes it reportable again."""
    model, _, _, step = _setup(every=4)
    data = batches([4, 4, 4])
    _micro(step, model, data[0])
    with pytest.raises(ValueError, match="bad batch"), step as s:
        s.backward(loss_fn(model, data[1]))
        raise ValueError("bad batch")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        del step
        gc.collect()
    model, _, _, step = _setup(every=4)
    with pytest.raises(ValueError), step:
        raise ValueError("skipped batch")
    _micro(step, model, data[2])  # the loop went on: the open window is its own doing
    with pytest.warns(loopkit.OpenWindowWarning, match=r"^2 micro-step\(s\)"):
        del step
        gc.collect()


@deep
def test_a_script_ending_on_an_error_prints_the_error_alone(tmp_path: Path) -> None:
    """An uncaught exception after a window opened: the traceback, and no warning at exit."""
    script = tmp_path / "fails.py"
    script.write_text(
        inspect.cleandoc(
            """
            import torch, loopkit
            model = torch.nn.Linear(3, 1)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            step = loopkit.step(model, opt, accumulate=4)
            for i, x in enumerate(torch.randn(7, 2, 3)):
                with step as s:
                    s.backward(model(x).mean())
                if i == 5:
                    raise KeyError("the user's own error, outside the micro-step")
            """
        )
    )
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert proc.returncode == 1 and "KeyError" in proc.stderr
    assert "OpenWindowWarning" not in proc.stderr, proc.stderr


def _schedulers(opt: torch.optim.Optimizer) -> dict[str, object]:
    lin = torch.optim.lr_scheduler.LinearLR
    return {
        "StepLR": torch.optim.lr_scheduler.StepLR(opt, 2, 0.5),
        "OneCycleLR": torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=40),
        "LambdaLR": torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1 / (1 + k)),
        "SequentialLR": torch.optim.lr_scheduler.SequentialLR(
            opt, [lin(opt, 0.1, total_iters=3), lin(opt, 1.0, 0.1, total_iters=30)],
            milestones=[3],
        ),
    }  # fmt: skip


@pytest.mark.parametrize("kind", ["StepLR", "OneCycleLR", "LambdaLR", "SequentialLR"])
@pytest.mark.parametrize("every", [1, 3])
def test_a_scheduler_restored_by_hand_before_the_loop_is_stepped_on(kind: str, every: int) -> None:
    """scheduler.load_state_dict after the step was built is no foreign step: each update steps
    it once from where it was restored; a foreign step after that is still refused."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    donor = _schedulers(opt)[kind]
    for _ in range(5):
        donor.step()  # type: ignore[attr-defined]
    saved = copy.deepcopy(donor.state_dict())  # type: ignore[attr-defined]
    sched = _schedulers(opt)[kind]
    step = loopkit.step(model, opt, accumulate=every, scheduler=sched)
    sched.load_state_dict(saved)  # type: ignore[attr-defined]
    at = sched.last_epoch  # type: ignore[attr-defined]
    for batch in step.iterate(batches([4] * (2 * every))):
        _micro(step, model, batch)
    assert step.updates == 2 and sched.last_epoch == at + 2  # type: ignore[attr-defined]
    sched.step()  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match="also stepped by your code"):
        for batch in step.iterate(batches([4] * every)):
            _micro(step, model, batch)


@pytest.mark.parametrize("where", ["scheduler=", "extra="])
def test_a_checkpointer_rollback_mid_run_moves_the_scheduler_without_refusal(
    tmp_path: Path, where: str
) -> None:
    """A Checkpointer given the scheduler (not step=) restores it after windows were trained:
    the next updates step it on from the restored position, unrefused."""
    model, opt, sched, step = _setup(every=2, scheduler=True)
    kwargs = {"scheduler": sched} if where == "scheduler=" else {"extra": {"sched": sched}}
    ckpt = loopkit.Checkpointer(tmp_path, model=model, optimizer=opt, **kwargs)  # type: ignore[arg-type]
    for batch in step.iterate(batches([4] * 4)):
        _micro(step, model, batch)
    ckpt.save()
    for batch in step.iterate(batches([4] * 6)):
        _micro(step, model, batch)
    assert sched.last_epoch == 5
    ckpt.resume()  # a rollback, mid-run
    assert sched.last_epoch == 2
    for batch in step.iterate(batches([4] * 4)):
        _micro(step, model, batch)
    assert sched.last_epoch == 4 and step.updates == 7


def test_a_rollback_by_hand_mid_run_is_no_foreign_step() -> None:
    """The loop restores model, optimizer and scheduler by hand after some updates (a
    rollback): the scheduler moved back, which no step() does; the next updates step it on."""
    model, opt, sched, step = _setup(every=2, scheduler=True)
    saved = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()),
             copy.deepcopy(sched.state_dict()))  # fmt: skip
    for batch in step.iterate(batches([4] * 8)):
        _micro(step, model, batch)
    assert sched.last_epoch == 4
    model.load_state_dict(saved[0])
    opt.load_state_dict(saved[1])
    sched.load_state_dict(saved[2])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for batch in step.iterate(batches([4] * 4)):
            _micro(step, model, batch)
    assert sched.last_epoch == 2 and step.updates == 6


@deep
def test_a_refused_window_end_leaves_no_warning_after_its_error(tmp_path: Path) -> None:
    """A scheduler.step() refused at a window's end leaves the window open; the script that
    ends on that error prints the error alone, no OpenWindowWarning."""
    script = tmp_path / "refused.py"
    script.write_text(
        inspect.cleandoc(
            """
            import torch, loopkit
            model = torch.nn.Linear(3, 1)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            sched = torch.optim.lr_scheduler.StepLR(opt, 1)
            step = loopkit.step(model, opt, accumulate=2, scheduler=sched)
            try:
                for x in torch.randn(4, 2, 3):
                    with step as s:
                        s.backward(model(x).mean())
                    sched.step()
            except RuntimeError as err:
                print("refused:", "also stepped by your code" in str(err))
            """
        )
    )
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert proc.returncode == 0 and "refused: True" in proc.stdout, proc.stderr
    assert "OpenWindowWarning" not in proc.stderr, proc.stderr
