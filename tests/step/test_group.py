"""Several models and optimizers in one loop: loopkit.steps, frozen modules, several backwards."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import assert_bit_equal, params
from torch import nn

import loopkit

F = nn.functional


def _gan(seed: int = 0) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(seed)
    G = nn.Sequential(nn.Linear(4, 16), nn.LeakyReLU(0.2), nn.Linear(16, 2))
    D = nn.Sequential(nn.Linear(2, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
    return G, D


def _data(n: int = 7, size: int = 6) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(size, 2, generator=g), torch.randn(size, 4, generator=g))
            for _ in range(n)]  # fmt: skip


def _opt(m: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(m.parameters(), lr=1e-2, betas=(0.5, 0.999))


def _loopkit_gan(
    G: nn.Module, D: nn.Module, data: list[Any], every: int, precision: str = "fp32"
) -> tuple[loopkit.step, loopkit.step]:
    """The DCGAN loop of pytorch/examples, in the user's own shape."""
    d_step = loopkit.step(D, _opt(D), accumulate=every, precision=precision)
    g_step = loopkit.step(G, _opt(G), accumulate=every, precision=precision, frozen=[D])
    for real, noise in loopkit.steps(d_step, g_step).iterate(data):
        with d_step as s:
            label = torch.ones(real.shape[0], 1)
            s.backward(F.binary_cross_entropy_with_logits(D(real).float(), label))
            fake = G(noise)
            label.fill_(0.0)  # in place, between the two backward passes
            s.backward(F.binary_cross_entropy_with_logits(D(fake.detach()).float(), label))
        with g_step as s:
            label.fill_(1.0)
            s.backward(F.binary_cross_entropy_with_logits(D(fake).float(), label))
    return d_step, g_step


def _hand_written_gan(G: nn.Module, D: nn.Module, data: list[Any], every: int) -> None:
    """The reference: requires_grad toggled by hand, each window normalized by its true size."""
    d_opt, g_opt = _opt(D), _opt(G)
    windows = [data[k : k + every] for k in range(0, len(data), every)]
    for window in windows:
        d_opt.zero_grad(set_to_none=True)
        g_opt.zero_grad(set_to_none=True)
        n = len(window)
        for k, (real, noise) in enumerate(window):
            label = torch.ones(real.shape[0], 1)
            (F.binary_cross_entropy_with_logits(D(real), label) / every).backward()
            fake = G(noise)
            label.fill_(0.0)
            (F.binary_cross_entropy_with_logits(D(fake.detach()), label) / every).backward()
            if k == n - 1:
                for p in D.parameters():
                    p.grad.mul_(every / n)
                d_opt.step()
            for p in D.parameters():
                p.requires_grad_(False)
            label.fill_(1.0)
            (F.binary_cross_entropy_with_logits(D(fake), label) / every).backward()
            for p in D.parameters():
                p.requires_grad_(True)
            if k == n - 1:
                for p in G.parameters():
                    p.grad.mul_(every / n)
                g_opt.step()


@pytest.mark.parametrize("every", [1, 2, 3])
def test_the_dcgan_loop_equals_the_hand_written_reference(every: int) -> None:
    """7 batches (a ragged last window), D and G each updated on the same batches, exactly."""
    G, D = _gan()
    G_ref, D_ref = copy.deepcopy(G), copy.deepcopy(D)
    data = _data()
    d_step, g_step = _loopkit_gan(G, D, data, every)
    _hand_written_gan(G_ref, D_ref, data, every)
    windows = -(-len(data) // every)
    assert (d_step.updates, g_step.updates) == (windows, windows)
    torch.testing.assert_close(params(D), params(D_ref), rtol=0, atol=1e-6)
    torch.testing.assert_close(params(G), params(G_ref), rtol=0, atol=1e-6)


def test_frozen_modules_get_no_gradient_in_the_step() -> None:
    """Inside G's step D's .grad is bitwise unchanged by G's backward; requires_grad is back."""
    G, D = _gan()
    d_step = loopkit.step(D, _opt(D), accumulate=2)
    g_step = loopkit.step(G, _opt(G), accumulate=2, frozen=[D])
    real, noise = _data(1)[0]
    with d_step as s:  # D's window stays open (1 of 2): its gradients must survive G's step
        s.backward(D(real).mean())
    before = [p.grad.clone() for p in D.parameters()]
    with g_step as s:
        assert not any(p.requires_grad for p in D.parameters())
        s.backward(D(G(noise)).mean())
    assert_bit_equal([p.grad for p in D.parameters()], before)
    assert all(p.requires_grad for p in D.parameters())
    assert all(p.grad is not None for p in G.parameters())


def test_an_error_inside_the_step_restores_every_requires_grad() -> None:
    """An exception in G's step: D's flags are as they were (one was off), training goes on."""
    G, D = _gan()
    D[0].bias.requires_grad_(False)  # a user's own choice, kept
    flags = [p.requires_grad for p in D.parameters()]
    d_step = loopkit.step(D, _opt(D))
    g_step = loopkit.step(G, _opt(G), frozen=[D])
    real, noise = _data(1)[0]
    with pytest.raises(ValueError, match="boom"), g_step as s:
        s.backward(D(G(noise)).mean())
        raise ValueError("boom")
    assert [p.requires_grad for p in D.parameters()] == flags
    for step, loss in ((d_step, lambda: D(real).mean()), (g_step, lambda: D(G(noise)).mean())):
        with step as s:
            s.backward(loss())
    assert (d_step.updates, g_step.updates) == (1, 1)


@pytest.mark.filterwarnings("ignore:fp16 autocast on a CPU")
def test_an_fp16_overflow_in_d_skips_only_d() -> None:
    """An inf in D's window skips D's update; G updates and its scheduler steps as usual."""
    G, D = _gan()
    d_step = loopkit.step(D, _opt(D), precision="fp16")
    g_opt = _opt(G)
    g_sched = torch.optim.lr_scheduler.StepLR(g_opt, step_size=1, gamma=0.5)
    g_step = loopkit.step(G, g_opt, precision="fp16", scheduler=g_sched, frozen=[D])
    small = {"scaler": torch.amp.GradScaler("cpu", init_scale=256.0).state_dict()}
    for amp in (d_step.amp, g_step.amp):  # no start-up back-off: every window can update
        amp.load_state_dict(small)
    for i, (real, noise) in enumerate(loopkit.steps(d_step, g_step).iterate(_data(4))):
        if i == 2:
            d_before = params(D)
        with d_step as s:
            loss = D(real).float().mean()
            s.backward(loss * float("inf") if i == 2 else loss)
        if i == 2:
            assert_bit_equal(params(D), d_before)
        with g_step as s:
            s.backward(D(G(noise)).float().mean())
    assert (d_step.updates, d_step.skipped) == (3, 1)
    assert (g_step.updates, g_step.skipped) == (4, 0) and g_sched.last_epoch == 4


def test_several_backward_calls_equal_one_on_the_summed_loss() -> None:
    """Two backward passes in a micro-step are that micro-step's contribution, normalized once."""
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    twin = copy.deepcopy(model)
    a = loopkit.step(model, torch.optim.SGD(model.parameters(), lr=0.1), accumulate=2)
    b = loopkit.step(twin, torch.optim.SGD(twin.parameters(), lr=0.1), accumulate=2)
    g = torch.Generator().manual_seed(1)
    for x, y in [(torch.randn(4, 3, generator=g), torch.randn(4, 3, generator=g))] * 3:
        with a as s:
            s.backward(model(x).pow(2).mean())
            s.backward(model(y).abs().mean(), inputs=list(model.parameters()))
        with b as s:
            s.backward(twin(x).pow(2).mean() + twin(y).abs().mean())
    b.flush()
    a.flush()
    assert a.updates == b.updates == 2
    torch.testing.assert_close(params(model), params(twin), rtol=0, atol=1e-7)


def test_weight_belongs_to_the_first_backward_of_a_micro_step() -> None:
    """A second backward with its own weight= is refused before anything changes."""
    model = nn.Linear(3, 1)
    s = loopkit.step(model, torch.optim.SGD(model.parameters(), lr=0.1), accumulate=2)
    with s as st:
        st.backward(model(torch.ones(2, 3)).sum(), weight=2)
        grads = [p.grad.clone() for p in model.parameters()]
        with pytest.raises(ValueError, match="first backward only"):
            st.backward(model(torch.ones(2, 3)).sum(), weight=2)
        assert_bit_equal([p.grad for p in model.parameters()], grads)


def test_a_group_refuses_mismatched_clocks_and_shared_parameters() -> None:
    """Different accumulate= or a parameter in two optimizers: a clear refusal."""
    G, D = _gan()
    with pytest.raises(ValueError, match="same accumulate="):
        loopkit.steps(loopkit.step(D, _opt(D), accumulate=2), loopkit.step(G, _opt(G)))
    shared = torch.optim.SGD([*G.parameters(), *D[0].parameters()], lr=0.1)
    with pytest.raises(ValueError, match="giving it only to that step's optimizer"):
        loopkit.steps(loopkit.step(D, _opt(D)), loopkit.step(G, shared))
    with pytest.raises(ValueError, match="cannot freeze what it trains"):
        loopkit.step(G, _opt(G), frozen=[G[0]])
    with pytest.raises(TypeError, match=r"loopkit\.step"):
        loopkit.steps(loopkit.step(D, _opt(D)), "g_step")  # type: ignore[arg-type]


def test_the_clock_closes_a_window_of_a_step_not_entered_on_its_last_batch() -> None:
    """G trained on every other batch: its windows still end with D's, on the same batches."""
    G, D = _gan()
    d_step = loopkit.step(D, _opt(D), accumulate=2)
    g_step = loopkit.step(G, _opt(G), accumulate=2, frozen=[D])
    group = loopkit.steps(d_step, g_step)
    ends = []
    for i, (real, noise) in enumerate(group.iterate(_data(5))):
        with d_step as s:
            s.backward(D(real).mean())
        if i % 2 == 0:  # batches 0, 2, 4: G's windows are [0], [2], [4]
            with g_step as s:
                s.backward(D(G(noise)).mean())
        ends.append((d_step.micro_step, g_step.micro_step))
    # G's open window at batches 1 and 3 is closed by the clock right after the batch.
    assert ends == [(1, 1), (0, 1), (1, 1), (0, 1), (0, 0)]
    assert (d_step.updates, g_step.updates, group.updates) == (3, 3, 3)
    assert g_step.micro_step == 0


def test_a_group_checkpoints_and_resumes_every_member(tmp_path: Path) -> None:
    """Checkpointer(step=group): saved at a window boundary, resumed bit for bit."""
    data = _data(8)

    def build() -> tuple[nn.Module, nn.Module, loopkit.step, loopkit.step, Any]:
        G, D = _gan()
        d_step = loopkit.step(D, _opt(D), accumulate=2)
        g_step = loopkit.step(G, _opt(G), accumulate=2, frozen=[D])
        group = loopkit.steps(d_step, g_step)
        # One model slot, one optimizer slot: a group's models and optimizers go in as one
        # ModuleList and as extra= (optimizers are Stateful).
        ckpt = loopkit.Checkpointer(
            tmp_path, model=nn.ModuleList([G, D]), step=group,
            extra={"d_opt": d_step.optimizer, "g_opt": g_step.optimizer},
        )  # fmt: skip
        return G, D, d_step, g_step, (group, ckpt)

    def train(built: Any, batches: list[Any], save_at: int | None = None) -> None:
        G, D, d_step, g_step, (group, ckpt) = built
        for real, noise in group.iterate(batches):
            with d_step as s:
                s.backward(D(real).mean())
            with g_step as s:
                s.backward(D(G(noise)).mean())
            if save_at is not None and group.updates == save_at and group.micro_step == 0:
                ckpt.save()
                return

    whole = build()
    train(whole, data)
    first = build()
    train(first, data, save_at=2)  # stops after 4 batches, saved as update 2
    second = build()
    assert second[4][1].resume() is not None
    assert (second[2].updates, second[3].updates, second[4][0].updates) == (2, 2, 2)
    train(second, data[4:])
    for a, b in ((whole[0], second[0]), (whole[1], second[1])):
        assert_bit_equal(params(a), params(b))
