"""loopkit.ema: an fp32 average, updated once per real optimizer update, checked against the
float64 closed form; swapped() restores bit for bit; it resumes with the Checkpointer."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import batches, loss_fn, mlp
from torch import nn

import loopkit
from loopkit._ema._decay import decay_at


def _bn_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.GELU(), nn.Linear(16, 1))


def _closed_form(
    start: list[torch.Tensor], after_updates: list[list[torch.Tensor]], decays: list[float]
) -> list[torch.Tensor]:
    """The average in float64: s <- d s + (1 - d) p, once per recorded update."""
    shadow = [t.double() for t in start]
    for params, d in zip(after_updates, decays, strict=True):
        shadow = [d * s + (1 - d) * p.double() for s, p in zip(shadow, params, strict=True)]
    return shadow


def _train(
    model: nn.Module,
    average: loopkit.ema,
    sizes: list[int],
    *,
    accumulate: int = 4,
    precision: str = "fp32",
    poison: Callable[[int], bool] = lambda i: False,
) -> tuple[loopkit.step, list[list[torch.Tensor]]]:
    """Train with ema=; the trainable parameters after each real update."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = loopkit.step(model, opt, accumulate=accumulate, precision=precision, ema=average)
    after: list[list[torch.Tensor]] = []
    for i, batch in enumerate(step.iterate(batches(sizes))):
        with step as s:
            loss = loss_fn(model, batch)
            s.backward(loss * float("inf") if poison(i) else loss)
        if step.updated:
            after.append([p.detach().clone() for p in model.parameters()])
    return step, after


def test_decay_follows_timm_model_ema_v3() -> None:
    """Without warm-up the decay is constant; with it the first update copies (0) and the
    k-th is min(decay, 1 - (1 + (k - 1)/gamma)^-power), as timm's ModelEmaV3."""
    assert [decay_at(k, 0.999, False, 1.0, 2 / 3) for k in (1, 2, 50)] == [0.999] * 3
    assert decay_at(1, 0.999, True, 1.0, 2 / 3) == 0.0
    assert decay_at(2, 0.999, True, 1.0, 2 / 3) == pytest.approx(1 - 2 ** (-2 / 3))
    assert decay_at(11, 0.999, True, 2.0, 1.0) == pytest.approx(1 - 1 / 6)
    assert decay_at(10**9, 0.999, True, 1.0, 2 / 3) == 0.999


def test_ten_batches_in_windows_of_four_give_three_updates_of_the_closed_form() -> None:
    """10 batches, accumulate=4, the ragged tail: 3 averages (none per micro-step), equal to
    the float64 closed form within 1e-6 (warm-up on); BatchNorm statistics copied, not
    averaged."""
    model = _bn_model()
    start = [p.detach().clone() for p in model.parameters()]
    average = loopkit.ema(model, decay=0.99, warmup=True)
    step, after = _train(model, average, [6] * 10)
    assert step.updates == average.updates == average.seen == len(after) == 3
    decays = [decay_at(k, 0.99, True, 1.0, 2 / 3) for k in (1, 2, 3)]
    for got, want in zip(average.shadow, _closed_form(start, after, decays), strict=True):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-6)
    for copied, live in zip(average.buffers, model.buffers(), strict=True):
        assert torch.equal(copied, live)  # the last update's statistics, as they are


@pytest.mark.filterwarnings("ignore:fp16 autocast on a CPU")
def test_an_fp16_skipped_window_neither_averages_nor_advances_the_warm_up() -> None:
    """fp16 on the CPU with an inf loss in the second window: that update is skipped, the
    average counts only the real ones, and the warm-up's next decay is the 2nd, not the 3rd."""
    model = mlp()
    start = [p.detach().clone() for p in model.parameters()]
    average = loopkit.ema(model, decay=0.99, warmup=True)
    step, after = _train(model, average, [4] * 12, precision="fp16", poison=lambda i: i == 5)
    assert (step.updates, step.skipped) == (2, 1)
    assert average.updates == average.seen == 2
    decays = [decay_at(k, 0.99, True, 1.0, 2 / 3) for k in (1, 2)]
    for got, want in zip(average.shadow, _closed_form(start, after, decays), strict=True):
        torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-6)


def test_a_bf16_model_keeps_an_fp32_average_that_moves() -> None:
    """bf16 weights at 1.0 that train to 0.5, decay 0.9999, 1000 updates: the fp32 average
    moves 0.048 as the float64 closed form does (1e-5); a bf16 copy averaged the same way
    (AveragedModel deep-copies the model in its dtype) does not move at all."""
    param = nn.Parameter(torch.ones(64, dtype=torch.bfloat16))
    model = nn.Module()
    model.w = param
    average = loopkit.ema(model, decay=0.9999)
    low = param.detach().clone()
    want = torch.ones(64, dtype=torch.float64)
    with torch.no_grad():
        param.fill_(0.5)
    for _ in range(1000):
        average.update()
        low.lerp_(param.detach(), 1 - 0.9999)
        want = 0.9999 * want + 0.0001 * 0.5
    assert average.shadow[0].dtype == torch.float32
    torch.testing.assert_close(average.shadow[0].double(), want, rtol=1e-5, atol=0)
    assert 1 - float(average.shadow[0][0]) == pytest.approx(0.0476, abs=1e-3)
    assert float(low[0]) == 1.0


def test_every_n_averages_on_every_nth_real_update() -> None:
    """every=2 over 5 updates: 2 averages, at the 2nd and 4th (the closed form of those)."""
    model = mlp()
    start = [p.detach().clone() for p in model.parameters()]
    average = loopkit.ema(model, decay=0.9, every=2)
    step, after = _train(model, average, [4] * 5, accumulate=1)
    assert (step.updates, average.seen, average.updates) == (5, 5, 2)
    want = _closed_form(start, [after[1], after[3]], [0.9, 0.9])
    for got, w in zip(average.shadow, want, strict=True):
        torch.testing.assert_close(got.double(), w, rtol=0, atol=1e-6)


def test_swapped_puts_the_average_in_and_restores_bit_for_bit_after_an_exception() -> None:
    """Inside: the model holds the average (its buffers too); after a raise inside, every
    parameter and buffer is the training one, bit for bit; a model of another shape is
    refused before anything changes."""
    model = _bn_model()
    average = loopkit.ema(model, decay=0.5)
    _train(model, average, [6] * 8, accumulate=2)
    training = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ZeroDivisionError), average.swapped() as inside:
        assert inside is model
        for p, s in zip(model.parameters(), average.shadow, strict=True):
            assert torch.equal(p, s)
        model(torch.randn(4, 8))  # BatchNorm in train mode writes its statistics
        raise ZeroDivisionError
    for k, v in model.state_dict().items():
        assert torch.equal(v, training[k]), k
    with pytest.raises(ValueError, match="same architecture"), average.swapped(mlp()):
        pass
    for k, v in model.state_dict().items():
        assert torch.equal(v, training[k]), k


def test_swapped_around_evaluate_inside_a_cadence_measures_the_average() -> None:
    """cadence + swapped + evaluate: the metric of a copy holding the average, exactly; the
    training weights come back."""
    model = mlp()
    average = loopkit.ema(model, decay=0.8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = loopkit.step(model, opt, accumulate=2, ema=average)
    every = loopkit.cadence(step, updates=2)
    held_out = batches([5, 7])

    def mse(m: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"mse": (m(b[0]) - b[1]).pow(2).mean(dim=1)}

    seen = []
    for batch in step.iterate(batches([4] * 8)):
        with step as s:
            s.backward(loss_fn(model, batch))
        if every.due():
            training = [p.detach().clone() for p in model.parameters()]
            with average.swapped():
                seen.append(loopkit.evaluate(model, held_out, mse)["mse"])
            assert all(torch.equal(p, t) for p, t in zip(model.parameters(), training, strict=True))
            copy = mlp()
            with torch.no_grad():
                for p, s in zip(copy.parameters(), average.shadow, strict=True):
                    p.copy_(s)
            assert seen[-1] == loopkit.evaluate(copy, held_out, mse)["mse"]
    assert len(seen) == 2 and seen[0] != seen[1]


def test_standalone_update_and_the_refusals() -> None:
    """ema.update() after optimizer.step() in a hand loop; owned by a step, update() is
    refused, and so are the same average twice, another model's ema and bad settings (nothing
    changed by a refusal)."""
    model = mlp()
    average = loopkit.ema(model, decay=0.9)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    start = [p.detach().clone() for p in model.parameters()]
    loss_fn(model, batches([4])[0]).backward()
    opt.step()
    assert average.update() and average.updates == 1
    want = _closed_form(start, [[p.detach() for p in model.parameters()]], [0.9])
    for got, w in zip(average.shadow, want, strict=True):
        torch.testing.assert_close(got.double(), w, rtol=0, atol=1e-7)
    step = loopkit.step(model, opt, ema=average)
    with pytest.raises(RuntimeError, match=r"remove the ema\.update"):
        average.update()
    assert average.updates == 1 and step.updates == 0
    with pytest.raises(ValueError, match="given twice"):
        loopkit.step(model, opt, ema=[average, average])
    other = mlp(seed=1)
    with pytest.raises(ValueError, match="does not update"):
        loopkit.step(model, opt, ema=loopkit.ema(other))
    with pytest.raises(TypeError, match=r"loopkit\.ema"):
        loopkit.step(model, opt, ema=object())  # type: ignore[arg-type]
    for bad, kind in (({"decay": 1.0}, ValueError), ({"decay": -0.1}, ValueError),
                      ({"every": 0}, ValueError), ({"warmup": 1}, TypeError),
                      ({"warmup_power": 0.0}, ValueError)):  # fmt: skip
        with pytest.raises(kind):
            loopkit.ema(model, **bad)  # type: ignore[arg-type]
    moved = mlp()
    stale = loopkit.ema(moved)
    moved.to("meta")  # new parameter objects: the ema's would never change again
    with pytest.raises(RuntimeError, match="replaced after its ema was built"):
        stale.update()
    assert stale.seen == 0
    frozen = nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        loopkit.ema(frozen)


def test_a_gan_generator_member_keeps_its_own_average() -> None:
    """In a loopkit.steps group the generator's ema averages once per generator update, the
    float64 closed form of the generator's weights after each (the critic's none of it)."""
    d, g = nn.Linear(4, 1), nn.Linear(3, 4)
    start = [p.detach().clone() for p in g.parameters()]
    average = loopkit.ema(g, decay=0.9)
    d_step = loopkit.step(d, torch.optim.SGD(d.parameters(), lr=0.1), accumulate=2)
    g_step = loopkit.step(g, torch.optim.SGD(g.parameters(), lr=0.1), accumulate=2,
                          frozen=[d], ema=average)  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    data = [(torch.randn(4, 4, generator=gen), torch.randn(4, 3, generator=gen)) for _ in range(5)]
    after: list[list[torch.Tensor]] = []
    for real, z in loopkit.steps(d_step, g_step).iterate(data):
        with d_step as s:
            s.backward(d(g(z).detach()).mean() - d(real).mean())
        with g_step as s:
            s.backward(-d(g(z)).mean())
        if g_step.updated:
            after.append([p.detach().clone() for p in g.parameters()])
    assert g_step.updates == average.updates == len(after) == 3
    for got, want in zip(average.shadow, _closed_form(start, after, [0.9] * 3), strict=True):
        torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-6)


def _run(tmp: Path, updates: int | None, resume: bool, extra: bool) -> tuple[Any, ...]:
    """2 epochs, accumulate=2, until saving where it stops; the ema with the step (or under
    extra=, updated by hand)."""
    torch.manual_seed(0)
    model = _bn_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    average = loopkit.ema(model, decay=0.9, warmup=True)
    step = loopkit.step(model, opt, accumulate=2, ema=None if extra else average)
    data = torch.utils.data.TensorDataset(torch.randn(40, 8), torch.randn(40, 1))
    loader = loopkit.distributed.loader(data, batch_size=6, seed=0, num_workers=0)
    ckpt = loopkit.Checkpointer(tmp, model=model, optimizer=opt, step=step, loader=loader,
                                extra={"ema": average} if extra else None)  # fmt: skip
    stop = loopkit.until(step, max_epochs=2, max_updates=updates, checkpointer=ckpt)
    if resume:
        ckpt.resume()
    for _ in stop.epochs(loader):
        for batch in step.iterate(loader):
            with step as s:
                s.backward(loss_fn(model, batch))
            if extra and step.updated:
                average.update()
            if stop.check():
                break
    return average, model


@pytest.mark.parametrize("extra", [False, True], ids=["step-ema", "extra-ema"])
def test_a_resume_is_bit_identical_with_the_average(tmp_path: Path, extra: bool) -> None:
    """Stopped after 3 updates and resumed in fresh objects: the average, its counters and
    the weights equal the uninterrupted run's bit for bit (the ema saved with the step, or
    under extra= when updated by hand)."""
    whole, whole_model = _run(tmp_path / "a", None, False, extra)
    _run(tmp_path / "b", 3, False, extra)
    resumed, resumed_model = _run(tmp_path / "b", None, True, extra)
    assert (resumed.updates, resumed.seen) == (whole.updates, whole.seen) == (8, 8)
    for a, b in zip(whole.shadow + whole.buffers, resumed.shadow + resumed.buffers, strict=True):
        assert torch.equal(a, b)
    for a, b in zip(whole_model.state_dict().values(), resumed_model.state_dict().values(),
                    strict=True):  # fmt: skip
        assert torch.equal(a, b)


def test_a_checkpoint_that_does_not_fit_the_ema_changes_nothing(tmp_path: Path) -> None:
    """Saved without an ema, resumed with one (and the other way), or another decay: a
    CheckpointError before anything is loaded."""
    _run(tmp_path, 2, False, extra=False)
    model = _bn_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    step = loopkit.step(model, opt, accumulate=2)
    with pytest.raises(loopkit.CheckpointError, match="holds the step's ema"):
        loopkit.Checkpointer(tmp_path, model=model, optimizer=opt, step=step).resume()
    other = loopkit.ema(model, decay=0.5, warmup=True)
    step = loopkit.step(model, opt, accumulate=2, ema=other)
    with pytest.raises(loopkit.CheckpointError, match="decay="):
        loopkit.Checkpointer(tmp_path, model=model, optimizer=opt, step=step).resume()
    assert other.updates == 0 and step.updates == 0
    _run(tmp_path / "by_hand", 2, False, extra=True)  # the ema saved under extra=, not the step's
    owned = loopkit.ema(model, decay=0.9, warmup=True)
    step = loopkit.step(model, opt, accumulate=2, ema=owned)
    no_ema = "built with ema= but the checkpoint holds no"
    with pytest.raises(loopkit.CheckpointError, match=no_ema):
        loopkit.Checkpointer(tmp_path / "by_hand", model=model, optimizer=opt, step=step).resume()
    assert owned.updates == 0 and step.updates == 0
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    with pytest.raises(loopkit.CheckpointError, match="decay="):
        other.load_state_dict(_run(tmp_path / "c", 1, False, extra=False)[0].state_dict())
    assert other.updates == 0


def test_one_update_is_one_foreach_kernel_per_dtype() -> None:
    """Profiled: fp32 weights, one _foreach_lerp_ (plus one _foreach_copy_ for the buffers);
    mixed bf16/fp32 weights, a lerp for the fp32 ones and a mul and an add for the others."""

    def ops(average: loopkit.ema) -> list[str]:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            average.update()
        return sorted(e.name for e in prof.events()
                      if e.name.startswith("aten::") and e.cpu_parent is None)  # fmt: skip

    assert ops(loopkit.ema(mlp())) == ["aten::_foreach_lerp_"]
    assert ops(loopkit.ema(_bn_model())) == ["aten::_foreach_copy_", "aten::_foreach_lerp_"]
    mixed = mlp()
    mixed[2].to(torch.bfloat16)
    assert ops(loopkit.ema(mixed)) == ["aten::_foreach_add_", "aten::_foreach_lerp_",
                                       "aten::_foreach_mul_"]  # fmt: skip


def test_an_update_makes_as_many_python_calls_for_any_number_of_parameters() -> None:
    """An update's checks (the model still holds the averaged tensors, on the average's
    device) and its kernel take the same Python calls for 4 parameters as for 40: a plain
    tensor is its own local tensor, found once at construction (each update called a
    function per parameter for it before), and the model's first parameter is found by its
    registries, not by ``get_parameter``'s calls."""
    import sys

    def calls(width: int) -> int:
        torch.manual_seed(0)
        model = nn.Sequential(*(nn.Linear(3, 3) for _ in range(width)))
        average = loopkit.ema(model, decay=0.9)
        average.update()  # the first builds what is built once
        seen = [0]

        def count(frame: Any, event: str, arg: Any) -> None:
            seen[0] += event == "call"

        sys.setprofile(count)
        try:
            average.update()
        finally:
            sys.setprofile(None)
        assert average.updates == 2
        return seen[0]

    assert calls(2) == calls(20)


def test_a_block_wrapped_after_the_ema_was_built_is_still_averaged() -> None:
    """A block wrapped later by a module that forwards its names (torch's checkpoint wrapper,
    as torch.compile of one block does) holds the same parameters: the per-update check that
    the model still trains them finds them through the wrapper and the average moves (a
    reviewer's reproduction of the registry read alone: it refused every update)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = mlp()
    average = loopkit.ema(model, decay=0.9)
    model[0] = checkpoint_wrapper(model[0])
    step = loopkit.step(model, torch.optim.SGD(model.parameters(), lr=0.1), ema=average)
    start = [t.clone() for t in average.shadow]
    for batch in batches([4, 4]):
        with step as s:
            s.backward(loss_fn(model, batch))
    assert step.updates == 2 and average.updates == 2
    assert all(not torch.equal(a, b) for a, b in zip(start, average.shadow, strict=True))


def test_accumulate_alone_takes_an_ema_too() -> None:
    """loopkit.accumulate(..., ema=) in a legacy loop: 5 micro-batches in windows of 2 and a
    flushed tail make 3 averages, the closed form of the weights after each update."""
    model = mlp()
    start = [p.detach().clone() for p in model.parameters()]
    average = loopkit.ema(model, decay=0.7)
    acc = loopkit.accumulate(model, torch.optim.SGD(model.parameters(), lr=0.1), every=2,
                             ema=average)  # fmt: skip
    after = []
    for batch in batches([3, 3, 3, 3, 3]):
        with acc:
            acc.backward(loss_fn(model, batch))
        if acc.updated:
            after.append([p.detach().clone() for p in model.parameters()])
    assert acc.flush()
    after.append([p.detach().clone() for p in model.parameters()])
    assert acc.updates == average.updates == 3
    for got, want in zip(average.shadow, _closed_form(start, after, [0.7] * 3), strict=True):
        torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("every", [1, 3])
def test_several_decays_on_one_step_each_follow_their_closed_form(every: int) -> None:
    """ema=[slow, fast, warm]: each is updated once per real update (none per micro-step),
    each within float rounding of its float64 closed form (improved-diffusion's ema_rate)."""
    model = mlp()
    decays = (0.99, 0.5, 0.9)
    start = [p.detach().clone() for p in model.parameters()]
    averages = [loopkit.ema(model, decay=d) for d in decays]
    step, after = _train(model, averages, [4] * 9, accumulate=every)  # type: ignore[arg-type]
    assert step.updates == len(after) == -(-9 // every)
    for average, d in zip(averages, decays, strict=True):
        assert average.updates == step.updates
        want = _closed_form(start, after, [d] * len(after))
        for got, w in zip(average.shadow, want, strict=True):
            torch.testing.assert_close(got.double(), w, rtol=0, atol=1e-6)


def test_several_averages_resume_bit_identical_and_refuse_another_count(tmp_path: Path) -> None:
    """A step's list of averages is saved with it; the resumed run's averages equal the
    uninterrupted run's bit for bit, and a resume with one average fewer is refused."""

    def run(directory: Path, stop: int | None, emas: int = 2) -> list[loopkit.ema]:
        model = mlp()
        averages = [loopkit.ema(model, decay=d) for d in (0.9, 0.6)][:emas]
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        step = loopkit.step(model, opt, accumulate=2, ema=averages)
        ckpt = loopkit.Checkpointer(directory, model=model, optimizer=opt, step=step)
        ckpt.resume()
        data = batches([4] * 12)[2 * step.updates :]
        for batch in step.iterate(data):
            with step as s:
                s.backward(loss_fn(model, batch))
            ckpt.maybe_save(every=1)
            if stop is not None and step.updates == stop:
                break
        return averages

    whole = run(tmp_path / "a", None)
    run(tmp_path / "b", 3)
    resumed = run(tmp_path / "b", None)
    for a, b in zip(whole, resumed, strict=True):
        assert a.updates == b.updates == 6
        assert all(torch.equal(x, y) for x, y in zip(a.shadow, b.shadow, strict=True))
    with pytest.raises(loopkit.CheckpointError, match="holds 2 ema"):
        run(tmp_path / "b", None, emas=1)


def test_an_average_follows_the_run_into_a_rebuilt_step() -> None:
    """A second phase builds a new step (other accumulate=, micro_batch=) with the same ema,
    the first step still alive: the average goes on over every real update of both."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    average = loopkit.ema(model, decay=0.8)
    start = [p.detach().clone() for p in model.parameters()]
    after: list[list[torch.Tensor]] = []
    first = loopkit.step(model, opt, accumulate=2, ema=average)
    second = loopkit.step(model, opt, accumulate=1, micro_batch=2, ema=average)
    for step, sizes in ((first, [4] * 4), (second, [4] * 3), (first, [4] * 2)):
        for batch in step.iterate(batches(sizes)):
            with step as s:
                s.backward(loss_fn(model, batch))
            if step.updated:
                after.append([p.detach().clone() for p in model.parameters()])
    assert average.updates == len(after) == 2 + 3 + 1
    want = _closed_form(start, after, [0.8] * len(after))
    for got, w in zip(average.shadow, want, strict=True):
        torch.testing.assert_close(got.double(), w, rtol=0, atol=1e-6)


@pytest.mark.parametrize("fused", [False, True])
def test_a_hand_written_phase_may_update_an_average_a_step_was_given(fused: bool) -> None:
    """After a step's phase, a hand phase on another optimizer (fused or not) calls
    ema.update() after its own optimizer.step(): allowed (new weights); a second is refused."""
    model = mlp()
    average = loopkit.ema(model, decay=0.5)
    step = loopkit.step(model, torch.optim.SGD(model.parameters(), lr=0.1), ema=average)
    for batch in step.iterate(batches([4, 4])):
        with step as s:
            s.backward(loss_fn(model, batch))
    with pytest.raises(RuntimeError, match=r"remove the ema\.update"):
        average.update()  # the step counted these weights already
    hand = torch.optim.Adam(model.parameters(), lr=1e-3, fused=fused)
    loss_fn(model, batches([4])[0]).backward()
    hand.step()
    assert average.update() and average.updates == 3
    with pytest.raises(RuntimeError, match=r"remove the ema\.update"):
        average.update()  # the same weights twice


@pytest.mark.parametrize("fused", [False, True])
def test_an_average_never_updated_warns_where_it_is_used(fused: bool) -> None:
    """An ema neither given to the step nor updated by hand, while its model trained (by a
    fused optimizer too): its swapped()/state_dict() warns once; one that is updated, or whose
    model did not train (evaluated through swapped() before training), not."""
    model = mlp()
    forgotten = loopkit.ema(model, decay=0.9)
    given = loopkit.ema(model, decay=0.9)
    step = loopkit.step(model, torch.optim.AdamW(model.parameters(), lr=0.1, fused=fused),
                        ema=given)  # fmt: skip
    untouched = loopkit.ema(mlp(seed=3))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(2):  # swapped twice before training: still the initial weights
            with untouched.swapped(), forgotten.swapped():
                pass
        untouched.state_dict()
    for batch in step.iterate(batches([4, 4])):
        with step as s:
            s.backward(loss_fn(model, batch))
    with pytest.warns(UserWarning, match="never been updated"), forgotten.swapped():
        pass
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        forgotten.state_dict()  # told once
        with given.swapped():
            pass
        given.state_dict()


def test_an_average_of_a_compiled_block_keeps_the_blocks_own_names(tmp_path: Path) -> None:
    """A model with a torch.compile'd block: the average is saved under the block's own names
    (no _orig_mod.) and resumes into the same model without compile, bit for bit."""

    def build(compiled: bool) -> tuple[nn.Module, loopkit.ema, loopkit.step]:
        torch.manual_seed(0)
        block = nn.Linear(8, 8)
        model = nn.Sequential(
            torch.compile(block, backend="aot_eager") if compiled else block, nn.Linear(8, 1)
        )
        average = loopkit.ema(model, decay=0.9)
        step = loopkit.step(model, torch.optim.SGD(model.parameters(), lr=0.1), ema=average)
        return model, average, step

    model, average, step = build(compiled=True)
    assert sorted(average.named_shadow()) == ["0.bias", "0.weight", "1.bias", "1.weight"]
    for batch in step.iterate(batches([4, 4])):
        with step as s:
            s.backward(loss_fn(model, batch))
    loopkit.Checkpointer(tmp_path, model=model, step=step).save()
    plain, restored, plain_step = build(compiled=False)
    loopkit.Checkpointer(tmp_path, model=plain, step=plain_step).resume()
    assert restored.updates == 2
    assert all(torch.equal(a, b) for a, b in zip(average.shadow, restored.shadow, strict=True))
    with restored.swapped(plain):
        pass
