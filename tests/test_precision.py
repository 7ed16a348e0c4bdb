"""autocast_step: bit-exact autocast, fp16 loss scaling with skipped steps, clear errors."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import loopkit


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 1))


def _data(n: int = 6) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 16, generator=g), torch.randn(8, 1, generator=g)) for _ in range(n)]


def _params(m: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in m.parameters()]


def _assert_bit_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)


def test_bf16_matches_hand_written_autocast_bit_for_bit() -> None:
    """Six bf16 training steps through autocast_step equal torch.autocast written by hand."""
    ref, ours = _model(), None
    ours = copy.deepcopy(ref)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = torch.optim.AdamW(ours.parameters(), lr=1e-2)
    amp = loopkit.autocast_step("bf16", device_type="cpu")
    for x, y in _data():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss_ref = nn.functional.mse_loss(ref(x), y)
        loss_ref.backward()
        opt_ref.step()
        opt_ref.zero_grad()
        with amp:
            out = ours(x)
            assert out.dtype == torch.bfloat16  # autocast really is on
            loss = nn.functional.mse_loss(out, y)
        amp.backward(loss)
        assert amp.step(opt) is True
        opt.zero_grad()
    _assert_bit_equal(_params(ref), _params(ours))


def test_fp16_matches_hand_written_grad_scaler_bit_for_bit() -> None:
    """fp16 through autocast_step equals the GradScaler recipe from the PyTorch docs."""
    ref = _model()
    ours = copy.deepcopy(ref)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=1e-2)
    opt = torch.optim.SGD(ours.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu")
    amp = loopkit.autocast_step(torch.float16, device_type="cpu")
    for x, y in _data():
        with torch.autocast("cpu", dtype=torch.float16):
            loss_ref = nn.functional.mse_loss(ref(x), y)
        scaler.scale(loss_ref).backward()
        scaler.step(opt_ref)
        scaler.update()
        opt_ref.zero_grad()
        with amp:
            loss = nn.functional.mse_loss(ours(x), y)
        amp.backward(loss)
        amp.step(opt)
        opt.zero_grad()
    _assert_bit_equal(_params(ref), _params(ours))
    assert amp.scaler is not None and amp.scaler.get_scale() == scaler.get_scale()


@pytest.mark.parametrize("fused", [False, True])
def test_fp16_inf_skips_the_step_and_leaves_weights_unchanged(fused: bool) -> None:
    """An inf in one gradient: step() returns False, no weight moves, the scale backs off."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)
    amp = loopkit.autocast_step("fp16", device_type="cpu")
    assert amp.scaler is not None
    scale_before = amp.scaler.get_scale()
    before = _params(model)
    x, y = _data(1)[0]
    with amp:
        loss = nn.functional.mse_loss(model(x), y)
    amp.backward(loss)
    first = next(model.parameters())
    assert first.grad is not None
    first.grad[0, 0] = float("inf")
    assert amp.step(opt) is False
    _assert_bit_equal(before, _params(model))
    assert amp.scaler.get_scale() == scale_before * 0.5
    assert not opt.state or all(
        float(s["step"]) == 0 for s in opt.state.values()
    )  # the skipped update did not count as an Adam step
    # The next clean step updates again.
    opt.zero_grad()
    with amp:
        loss = nn.functional.mse_loss(model(x), y)
    amp.backward(loss)
    assert amp.step(opt) is True
    assert not torch.equal(before[0], next(model.parameters()).detach())


def test_fp16_step_without_scaled_backward_is_refused_before_any_change() -> None:
    """amp.step with no amp.backward since the last step raises and touches nothing."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp = loopkit.autocast_step("fp16", device_type="cpu")
    x, y = _data(1)[0]
    nn.functional.mse_loss(model(x), y).backward()  # unscaled: the mistake
    before = _params(model)
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    state = amp.state_dict()
    with pytest.raises(RuntimeError, match=r"amp\.backward\(loss\)"):
        amp.step(opt)
    _assert_bit_equal(before, _params(model))
    _assert_bit_equal(grads, [p.grad for p in model.parameters() if p.grad is not None])
    assert amp.state_dict() == state


def test_scaler_state_saves_and_restores() -> None:
    """A restored autocast_step continues with the same scale and growth tracker."""
    amp = loopkit.autocast_step(
        "fp16", device_type="cpu", scaler={"init_scale": 1024.0, "growth_interval": 2}
    )
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    for x, y in _data(3):
        with amp:
            loss = nn.functional.mse_loss(model(x), y)
        amp.backward(loss)
        amp.step(opt)
        opt.zero_grad()
    state = amp.state_dict()
    assert state["scaler"]["scale"] == 2048.0 and state["scaler"]["_growth_tracker"] == 1
    fresh = loopkit.autocast_step("fp16", device_type="cpu")
    fresh.load_state_dict(state)
    assert fresh.state_dict() == state
    with pytest.raises(ValueError, match="fp16"):
        loopkit.autocast_step("bf16", device_type="cpu").load_state_dict(state)


def test_fp32_is_a_true_no_op() -> None:
    """fp32 enters no autocast, owns no scaler, and backward/step are the plain calls."""
    amp = loopkit.autocast_step("fp32")
    with amp:
        assert not torch.is_autocast_enabled("cpu")
        out = nn.Linear(2, 2)(torch.ones(1, 2))
    assert out.dtype == torch.float32
    assert amp.scaler is None and amp.state_dict() == {}
    loss = torch.ones(1, requires_grad=True).sum()
    assert amp.scale(loss) is loss


def test_decorator_and_nesting_restore_state() -> None:
    """@amp runs the function under autocast; nested and exceptional exits restore state."""
    amp = loopkit.autocast_step("bf16", device_type="cpu")

    @amp
    def forward(x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, torch.ones(2, 2))

    assert forward(torch.ones(1, 2)).dtype == torch.bfloat16
    assert not torch.is_autocast_enabled("cpu")
    with amp:
        with torch.autocast("cpu", enabled=False):
            with amp:  # same object, entered again inside a disabled region
                assert torch.is_autocast_enabled("cpu")
            assert not torch.is_autocast_enabled("cpu")
        assert torch.is_autocast_enabled("cpu")
    assert not torch.is_autocast_enabled("cpu")
    with pytest.raises(KeyError), amp:
        raise KeyError("boom")
    assert not torch.is_autocast_enabled("cpu")


@pytest.mark.parametrize(
    ("make", "exc", "hint"),
    [
        (lambda: loopkit.autocast_step("fp8"), ValueError, "'bf16', 'fp16' or 'fp32'"),
        (lambda: loopkit.autocast_step(torch.int8), ValueError, "'bf16', 'fp16' or 'fp32'"),
        (lambda: loopkit.autocast_step(["bf16"]), ValueError, "'bf16'"),
        (lambda: loopkit.autocast_step("bf16", device_type="meta"), ValueError, "precision='fp32'"),
        (lambda: loopkit.autocast_step("bf16", device_type="no such"), ValueError, "'cpu'"),
        (
            lambda: loopkit.autocast_step(
                "bf16", device_type="cpu", scaler=torch.amp.GradScaler("cpu")
            ),
            ValueError,
            "drop the scaler",
        ),
        (
            lambda: loopkit.autocast_step("fp16", device_type="cpu", scaler=3),
            TypeError,
            "GradScaler",
        ),
        (
            lambda: loopkit.autocast_step(
                "fp16", device_type="cpu", scaler=torch.amp.GradScaler("cpu", enabled=False)
            ),
            ValueError,
            "disabled",
        ),
        (
            lambda: loopkit.autocast_step("fp16", device_type="cpu", scaler={"bogus": 1}),
            TypeError,
            "bogus",
        ),
    ],
)
def test_bad_input_is_refused_with_a_fix(
    make: Callable[[], Any], exc: type[Exception], hint: str
) -> None:
    """Unknown precisions, unusable devices and wrong scalers raise at construction."""
    with pytest.raises(exc) as info:
        make()
    assert hint in str(info.value)


def test_step_without_gradients_is_a_clear_error() -> None:
    """An fp16 step whose optimizer saw no backward says so instead of failing inside torch."""
    amp = loopkit.autocast_step("fp16", device_type="cpu")
    used, unused = nn.Linear(2, 1), nn.Linear(2, 1)
    amp.backward(used(torch.ones(1, 2)).sum())
    with pytest.raises(RuntimeError, match="no gradients"):
        amp.step(torch.optim.SGD(unused.parameters(), lr=0.1))


@pytest.mark.parametrize("make_opt", [
    lambda p: torch.optim.SGD(p, lr=0.01),
    lambda p: torch.optim.AdamW(p, lr=0.01),
])  # fmt: skip
def test_an_error_between_unscale_and_step_does_not_leak_into_the_next_batch(
    make_opt: Callable[[Any], torch.optim.Optimizer],
) -> None:
    """Clipping raises after unscale_ on batch 2: batch 3 gets the update of a fresh run."""
    data = _data(3)
    torch.manual_seed(0)
    model = _model()
    fresh = copy.deepcopy(model)
    opt, fresh_opt = make_opt(model.parameters()), make_opt(fresh.parameters())
    amp = loopkit.autocast_step("fp16", device_type="cpu", scaler={"init_scale": 256.0})
    fresh_amp = loopkit.autocast_step("fp16", device_type="cpu", scaler={"init_scale": 256.0})

    def batch(m: nn.Module, o: torch.optim.Optimizer, a: Any, x: Any, y: Any, boom: bool) -> None:
        with a:
            loss = nn.functional.mse_loss(m(x).float(), y)
        a.backward(loss * 1e30 if boom else loss)  # 1e30: the fp16 gradients overflow
        try:
            a.unscale_(o)
            nn.utils.clip_grad_norm_(m.parameters(), 1e6, error_if_nonfinite=True)
            a.step(o)
        except RuntimeError:
            assert boom
        o.zero_grad(set_to_none=True)

    for i, (x, y) in enumerate(data):
        batch(model, opt, amp, x, y, boom=i == 1)
        if i != 1:  # the fresh run never sees the failed batch
            batch(fresh, fresh_opt, fresh_amp, x, y, boom=False)
    _assert_bit_equal(_params(model), _params(fresh))
    assert amp.state_dict()["scaler"]["scale"] == fresh_amp.state_dict()["scaler"]["scale"]


def test_fp16_on_a_cpu_warns_once() -> None:
    """fp16 autocast on a CPU warns (once per process) and names bf16."""
    import loopkit._precision as precision

    precision._warned_fp16_on_cpu = False
    with pytest.warns(UserWarning, match="precision='bf16'"):
        loopkit.autocast_step("fp16", device_type="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loopkit.autocast_step("fp16", device_type="cpu")
        loopkit.autocast_step("bf16", device_type="cpu")


def test_backward_of_a_non_tensor_is_a_clear_error() -> None:
    """amp.backward(3.0) says a tensor is needed, before touching the scaler."""
    amp = loopkit.autocast_step("fp16", device_type="cpu")
    with pytest.raises(TypeError, match="loss must be a tensor"):
        amp.backward(3.0)  # type: ignore[arg-type]
    assert not amp._scaled


def test_unscale_then_another_backward_then_step_matches_grad_scaler() -> None:
    """unscale_(opt0) + clip, then loss1's backward, then step(opt0, opt1): as GradScaler does."""

    def run(use_loopkit: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        m0, m1 = _model(), _model()
        o0 = torch.optim.SGD(m0.parameters(), lr=0.1)
        o1 = torch.optim.SGD(m1.parameters(), lr=0.1)
        x, y = _data(1)[0]
        amp = loopkit.autocast_step("fp16", device_type="cpu", scaler={"init_scale": 256.0})
        scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
        with torch.autocast("cpu", dtype=torch.float16):
            l0 = nn.functional.mse_loss(m0(x).float(), y)
            l1 = nn.functional.mse_loss(m1(x).float(), y)
        if use_loopkit:
            amp.backward(l0)
            amp.unscale_(o0)
            nn.utils.clip_grad_norm_(m0.parameters(), 100.0)
            amp.backward(l1)  # o0's gradients are untouched: its unscale stands
            assert amp.step(o0, o1)
        else:
            scaler.scale(l0).backward()
            scaler.unscale_(o0)
            nn.utils.clip_grad_norm_(m0.parameters(), 100.0)
            scaler.scale(l1).backward()
            scaler.step(o0)
            scaler.step(o1)
            scaler.update()
        return _params(m0) + _params(m1)

    _assert_bit_equal(run(True), run(False))
