"""Messages of the step's refusals: a direct loss.backward() named by its line, the class the
user built named as written."""

from __future__ import annotations

import copy
import sys

import pytest
import torch
from torch import nn

import loopkit


def _model_opt() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _loss(model: nn.Module) -> torch.Tensor:
    return model(torch.randn(6, 4)).pow(2).mean()


@pytest.mark.parametrize("every", [1, 3])
def test_a_direct_loss_backward_is_named_by_its_line_with_the_fix(every: int) -> None:
    """loss.backward() in `with step`: refused at that micro-step, naming file:line and the fix."""
    model, opt = _model_opt()
    before = [p.detach().clone() for p in model.parameters()]
    step = loopkit.step(model, opt, accumulate=every)
    with pytest.raises(RuntimeError) as info, step:
        loss = _loss(model)
        line = sys._getframe().f_lineno + 1
        loss.backward()
    said = str(info.value)
    assert f"{__file__}:{line} calls .backward() on a loss directly" in said
    assert "call s.backward(loss) instead" in said
    assert "two optimizers" not in said and "one optimizer" not in said
    # Refused at its own micro-step, the window dropped: nothing trained, nothing left over.
    assert (step.updates, step.micro_step) == (0, 0)
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before, strict=True))


def test_a_direct_backward_is_not_joined_to_a_later_s_backward() -> None:
    """Micro-step 1 by loss.backward(), micro-step 2 by s.backward: refused at the first."""
    model, opt = _model_opt()
    step = loopkit.step(model, opt, accumulate=2)
    with pytest.raises(RuntimeError, match=r"calls \.backward\(\) on a loss directly"), step:
        _loss(model).backward()
    with step as s:  # the next window starts clean and trains as usual
        s.backward(_loss(model))
    assert step.micro_step == 1 and step.updates == 0
    assert step.flush() and step.updates == 1


def test_two_steps_of_one_model_keep_the_advice_about_one_optimizer() -> None:
    """No direct backward in the code: the other step's backward through the model is said."""
    model, _ = _model_opt()
    body = loopkit.step(model, torch.optim.SGD(model[0].parameters(), lr=0.1))
    head = loopkit.step(model, torch.optim.SGD(model[2].parameters(), lr=0.1))
    with body as s:
        s.backward(_loss(model))  # also writes the head's gradients
    with pytest.raises(RuntimeError, match="give both parameter groups to one optimizer"), head:
        pass


@pytest.mark.parametrize(
    ("build", "named", "enter"),
    [
        (lambda m, o: loopkit.step(m, o, accumulate=2), "loopkit.step", "`with step as s:`"),
        (lambda m, o: loopkit.accumulate(m, o, every=2), "loopkit.accumulate", "`with acc:`"),
    ],
)
def test_a_step_built_inside_the_loop_is_named_as_the_user_built_it(
    build: object, named: str, enter: str
) -> None:
    """loopkit.step(...) rebuilt each iteration: the message says loopkit.step, not accumulate."""
    model, opt = _model_opt()
    assert callable(build)
    with pytest.raises(RuntimeError) as info:
        for _ in range(2):
            step = build(model, opt)
            with step:
                step.backward(_loss(model))
    step.flush()  # the first one's window, left open by the refusal
    said = str(info.value)
    assert f"already bound to a {named} that is mid-window" in said
    assert f"Build the {named} once, before the loop, and enter it ({enter})" in said


class _Framework:
    """What Accelerate's Accelerator and Lightning's Fabric do in backward(loss)."""

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def manual_backward(self, loss: torch.Tensor) -> None:
        loss.backward()


class _Trainer:
    """A port that keeps its framework on self (self.accelerator.backward(loss))."""

    def __init__(self) -> None:
        self.accelerator = _Framework()
        self.model, self.opt = _model_opt()
        self.step = loopkit.step(self.model, self.opt)
        self.line = 0  # the framework's backward call, as the method sets it

    def by_attribute(self) -> None:
        with self.step:
            loss = _loss(self.model)
            self.line = sys._getframe().f_lineno + 1
            self.accelerator.backward(loss)

    def by_manual_backward(self) -> None:
        with self.step:
            loss = _loss(self.model)
            self.line = sys._getframe().f_lineno + 1
            self.accelerator.manual_backward(loss)


def test_a_framework_s_backward_left_in_a_port_is_named_by_its_line() -> None:
    """accelerator.backward(loss), self.accelerator.backward, manual_backward: file:line named."""
    model, opt = _model_opt()
    step = loopkit.step(model, opt)
    accelerator = _Framework()
    with pytest.raises(RuntimeError) as info, step:
        line = sys._getframe().f_lineno + 1
        accelerator.backward(_loss(model))
    assert f"{__file__}:{line} calls .backward() on a loss directly" in str(info.value)
    assert "two optimizers" not in str(info.value)
    for how in ("by_attribute", "by_manual_backward"):
        trainer = _Trainer()
        with pytest.raises(RuntimeError) as info:
            getattr(trainer, how)()
        assert f"{__file__}:{trainer.line} calls .backward() on a loss directly" in str(info.value)
        assert trainer.step.updates == 0


@pytest.mark.parametrize("every", [1, 2, 3])
def test_a_direct_backward_after_s_backward_is_refused_naming_its_line(every: int) -> None:
    """s.backward then loss.backward() in a window: refused at its line, no doubled gradient."""
    model, opt = _model_opt()
    before = [p.detach().clone() for p in model.parameters()]
    step = loopkit.step(model, opt, accumulate=every)
    with pytest.raises(RuntimeError) as info:
        for micro in range(every):
            with step as s:
                loss = _loss(model)
                s.backward(loss, retain_graph=True)
                line = sys._getframe().f_lineno + 2
                if micro == every - 1:  # the window's last micro-step
                    loss.backward()
    said = str(info.value)
    assert f"{__file__}:{line} calls .backward() on a loss directly" in said
    assert said.index(f"{line} calls") < said.index("zero_grad") and "GAN" not in said
    assert "The window was not updated" in said
    assert step.updates == 0
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before, strict=True))


def test_several_own_backwards_with_accumulate_1_are_the_batch_s_gradient() -> None:
    """Two s.backward calls in one micro-step (retain_graph) add up as one loss: not refused."""
    model, _ = _model_opt()
    ref = copy.deepcopy(model)
    torch.manual_seed(1)
    x = torch.randn(6, 4)
    step = loopkit.step(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with step as s:
        out = model(x)
        s.backward(out.pow(2).mean(), retain_graph=True)
        s.backward(out.abs().mean())
    ref_out = ref(x)
    ref_out.pow(2).mean().backward(retain_graph=True)
    ref_out.abs().mean().backward()
    torch.optim.SGD(ref.parameters(), lr=0.1).step()
    assert step.updates == 1
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters(), strict=True))


def _clipped_and_noised(model: nn.Module, x: torch.Tensor) -> None:
    """The user's own edits of the gradients after the backward: a clip and added noise."""
    nn.utils.clip_grad_norm_(model.parameters(), 0.05)
    for p in model.parameters():
        assert p.grad is not None
        p.grad.add_(0.01 * torch.ones_like(p.grad))
    del x


def _hand_loop(ref: nn.Module, xs: list[torch.Tensor]) -> nn.Module:
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for x in xs:
        ref(x).pow(2).mean().backward()
        _clipped_and_noised(ref, x)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return ref


def test_the_users_own_gradient_edits_with_accumulate_1_are_the_update_s() -> None:
    """With accumulate=1 (the window is its one micro-step) a hand clip or added noise after
    s.backward is the update's, as in a hand loop, on every step: not refused, and the
    weights equal the hand loop's bit for bit."""
    model, opt = _model_opt()
    torch.manual_seed(1)
    xs = [torch.randn(6, 4) for _ in range(3)]
    ref = _hand_loop(copy.deepcopy(model), xs)
    step = loopkit.step(model, opt)
    for x in xs:
        with step as s:
            s.backward(model(x).pow(2).mean())
            _clipped_and_noised(model, x)
    assert step.updates == 3
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters(), strict=True))
