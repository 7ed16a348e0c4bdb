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


def _skipping_group(every: int = 3) -> tuple[nn.Module, nn.Module, loopkit.step, loopkit.step, Any]:
    G, D = _gan()
    d_step = loopkit.step(D, _opt(D), accumulate=every)
    g_step = loopkit.step(G, _opt(G), accumulate=every, frozen=[D])
    return G, D, d_step, g_step, loopkit.steps(d_step, g_step)


def _train_skipping(
    batches: list[Any], every: int, ask: Any = None, g_on: Any = None
) -> tuple[nn.Module, nn.Module, loopkit.step, loopkit.step, Any]:
    """D on every batch, G on each window's first batch only; ``ask(group)`` after both."""
    G, D, d_step, g_step, group = _skipping_group(every)
    for i, (real, noise) in enumerate(group.iterate(batches)):
        with d_step as s:
            s.backward(D(real).mean())
        if (g_on or (lambda i: i % every == 0))(i):
            with g_step as s:
                s.backward(D(G(noise)).mean())
        if ask is not None and ask(group):
            break
    return G, D, d_step, g_step, group


def _loop_control(tmp_path: Path, max_updates: int) -> tuple[dict[str, Any], Any]:
    """What a loop asks after each batch: maybe_save, a cadence and until, built at the first
    call on the group; ``seen`` holds them and the updates the cadence fired at."""
    seen: dict[str, Any] = {"fired": []}

    def ask(group: Any) -> bool:
        if "stop" not in seen:
            seen["ckpt"] = loopkit.Checkpointer(tmp_path, model=nn.Linear(1, 1), step=group)
            seen["stop"] = loopkit.until(group, max_updates=max_updates, signals=())
            seen["cadence"] = loopkit.cadence(group, updates=1)
        seen["ckpt"].maybe_save(every=1)
        if seen["cadence"].due():
            seen["fired"].append(group.updates)
        return bool(seen["stop"].check())

    return seen, ask


def test_loop_control_sees_the_end_of_a_window_whose_last_batch_skips_a_member(
    tmp_path: Path,
) -> None:
    """until, cadence and maybe_save after the batch's micro-steps see each boundary; the
    weights are those of the same loop without them (G's window closed after the batch)."""
    data = _data(12)
    seen, ask = _loop_control(tmp_path, max_updates=3)

    G, D, d_step, g_step, group = _train_skipping(data, 3, ask)
    assert seen["stop"].reason == "max_updates" and seen["fired"] == [1, 2, 3]
    assert [p.name for p in seen["ckpt"].checkpoints()] == [f"ckpt-{u:010d}.pt" for u in (1, 2, 3)]
    assert (group.updates, d_step.updates, g_step.updates, group.micro_step) == (3, 3, 3, 0)
    G_ref, D_ref, *_ = _train_skipping(data[:9], 3)
    assert_bit_equal(params(G), params(G_ref))
    assert_bit_equal(params(D), params(D_ref))


def test_a_member_never_entered_in_a_window_leaves_the_boundary_visible() -> None:
    """G on the first batch of the odd windows only, never in the even ones: every window's
    end is seen after the batch's micro-steps, G counts its own windows."""
    ends = []

    def ask(group: Any) -> bool:
        ends.append(group.settle() == 0)
        return False

    *_, d_step, g_step, group = _train_skipping(_data(8), 2, ask, lambda i: i % 4 == 2)
    assert ends == [False, True] * 4
    assert (group.updates, d_step.updates, g_step.updates) == (4, 4, 2)


def test_a_member_entered_after_the_boundary_was_read_is_refused() -> None:
    """On a window's last batch, group.settle() (loop control) closes G's window: G entered
    after it raises before its micro-step opens, and the loop goes on; reading
    group.micro_step changes nothing."""
    G, D, d_step, g_step, group = _skipping_group(2)
    for i, (real, noise) in enumerate(group.iterate(_data(4))):
        with d_step as s:
            s.backward(D(real).mean())
        if i == 0:
            with g_step as s:
                s.backward(D(G(noise)).mean())
        if i == 1:
            assert group.micro_step == 1 and g_step.updates == 0  # a read: no side effect
            assert group.settle() == 0 and g_step.updates == 1
            with pytest.raises(RuntimeError, match="after the group closed its window"):
                g_step.__enter__()
            assert g_step.micro_step == 0 and not g_step.accumulator._inside
    assert (group.updates, d_step.updates, g_step.updates) == (2, 2, 1)


def test_leaving_the_loop_on_a_windows_last_batch_counts_that_window_once() -> None:
    """A break before the group closes G's window: flush() closes it, with no second count."""
    *_, d_step, g_step, group = _train_skipping(_data(6), 2, lambda group: group.updates == 2)
    assert g_step.micro_step == 1  # nothing settled the group: G's window is still open
    group.flush()
    assert (group.updates, d_step.updates, g_step.updates) == (2, 2, 2)


def _both_members(
    batches: list[Any], ask: Any = None, top: bool = False, every: int = 2, on: Any = None
) -> tuple[nn.Module, nn.Module, Any]:
    """D and G on each window's first batch only (or where ``on(i)``); ``ask(group)`` after
    both (``top``: before them)."""
    G, D, d_step, g_step, group = _skipping_group(every)
    for i, (real, noise) in enumerate(group.iterate(batches)):
        if top and ask is not None and ask(group):
            break
        if (on or (lambda i: i % every == 0))(i):
            with d_step as s:
                s.backward(D(real).mean())
            with g_step as s:
                s.backward(D(G(noise)).mean())
        if not top and ask is not None and ask(group):
            break
    return G, D, group


def test_a_windows_last_batch_entering_no_member_is_closed_for_loop_control(
    tmp_path: Path,
) -> None:
    """No member on a window's last batch: until, cadence and maybe_save asked after the
    batch still see its boundary, and the weights are those of the loop without them."""
    data = _data(9)
    seen, ask = _loop_control(tmp_path, max_updates=2)

    G, D, group = _both_members(data, ask, every=3)
    assert seen["stop"].reason == "max_updates" and seen["fired"] == [1, 2]
    assert [p.name for p in seen["ckpt"].checkpoints()] == [f"ckpt-{u:010d}.pt" for u in (1, 2)]
    assert group.updates == 2 and group.micro_step == 0
    G_ref, D_ref, _ = _both_members(data[:6], every=3)
    assert_bit_equal(params(G), params(G_ref))
    assert_bit_equal(params(D), params(D_ref))


def test_a_member_entered_after_a_read_closed_a_memberless_last_batch_is_refused() -> None:
    """Loop control asked after the micro-steps: settle() on a last batch with no member yet
    closes both windows, so a member entered afterwards raises and the loop goes on."""
    _, D, d_step, g_step, group = _skipping_group(2)
    for i, (real, _) in enumerate(group.iterate(_data(4))):
        if i % 2 == 0:
            with d_step as s:
                s.backward(D(real).mean())
            assert group.settle() == 1  # asked after the micro-step: the loop asks after
        else:
            assert group.settle() == 0 and d_step.updates == i // 2 + 1
            with pytest.raises(RuntimeError, match="no member had been entered on"):
                d_step.__enter__()
            assert d_step.micro_step == 0 and not d_step.accumulator._inside
    assert (group.updates, d_step.updates, g_step.updates) == (2, 2, 0)


@pytest.mark.parametrize("every_batch", [True, False])
def test_loop_control_asked_at_the_top_of_the_body_closes_no_window(every_batch: bool) -> None:
    """until/cadence asked before the micro-steps: on a window's last batch that read closes
    nothing (the members entered after it are not refused), whatever the batch trains."""
    data, seen, opened = _data(6), [], []
    on = (lambda i: True) if every_batch else None

    def ask(group: Any) -> bool:
        if not seen:
            seen.extend([loopkit.until(group, max_updates=9, signals=()),
                         loopkit.cadence(group, updates=1)])  # fmt: skip
        opened.append(group.micro_step)
        return bool(seen[1].due()) and bool(seen[0].check())

    G, D, group = _both_members(data, ask, top=True, on=on)
    # Each window's last batch begins with both windows open (1), the next one with none.
    assert opened == [0, 1, 0, 1, 0, 1] and group.updates == 3
    G_ref, D_ref, _ = _both_members(data, on=on)
    assert_bit_equal(params(G), params(G_ref))
    assert_bit_equal(params(D), params(D_ref))


class _ActorCritic(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk, self.actor, self.critic = nn.Linear(4, 8), nn.Linear(8, 2), nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, detach: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.trunk(x))
        return self.actor(h), self.critic(h.detach() if detach else h)


def _actor_critic(frozen: bool = False, every: int = 2) -> Any:
    """Actor (trunk + actor head) and critic (its head) steps on one model, and the data."""
    model = _ActorCritic().double()
    opt_a = torch.optim.SGD([*model.trunk.parameters(), *model.actor.parameters()], lr=0.1)
    opt_c = torch.optim.SGD(model.critic.parameters(), lr=0.1)
    a_step = loopkit.step(model, opt_a, accumulate=every)
    c_step = loopkit.step(model, opt_c, accumulate=every, frozen=[model.trunk] if frozen else [])
    g = torch.Generator().manual_seed(5)
    data = [torch.randn(5, 4, generator=g, dtype=torch.float64) for _ in range(2 * every)]
    return model, copy.deepcopy(model), data, (a_step, c_step)


def _train_actor_critic(model: nn.Module, data: list[Any], a_step: Any, c_step: Any,
                        detach: bool = False) -> None:  # fmt: skip
    for x in loopkit.steps(a_step, c_step).iterate(data):
        with a_step as s:
            s.backward(model(x)[0].pow(2).mean())
        with c_step as s:
            s.backward((model(x, detach)[1] - 1).pow(2).mean())


def test_a_members_loss_reaching_another_members_parameters_is_refused() -> None:
    """Actor and critic share a trunk, no frozen=: refused at the critic's first backward,
    with nothing back-propagated (the critic head has no gradient, the trunk only the actor's)."""
    model, start, data, steps = _actor_critic()
    with pytest.raises(RuntimeError, match=r"frozen=\[shared_module\]") as info:
        _train_actor_critic(model, data, *steps)
    assert "steps[1] (_ActorCritic)" in str(info.value)
    assert all(p.grad is None for p in model.critic.parameters())
    start(data[0])[0].pow(2).mean().div(2).backward()  # the actor's micro-step, normalized
    assert_bit_equal([p.grad for p in model.trunk.parameters()],
                     [p.grad for p in start.trunk.parameters()])  # fmt: skip


@pytest.mark.parametrize("mistake", ["G without frozen=[D]", "D on an undetached fake"])
def test_a_gan_whose_backward_reaches_the_other_model_is_refused(mistake: str) -> None:
    """The two GAN slips the group cannot normalize: refused, naming frozen= and detach."""
    G, D = _gan()
    d_step = loopkit.step(D, _opt(D), accumulate=2)
    g_step = loopkit.step(G, _opt(G), accumulate=2, frozen=[] if "frozen" in mistake else [D])
    noise = _data(1)[0][1]
    for _ in loopkit.steps(d_step, g_step).iterate([0]):
        with pytest.raises(RuntimeError, match=r"frozen=.*detach"):
            with d_step as s:
                fake = G(noise)
                s.backward(D(fake if "undetached" in mistake else fake.detach()).mean())
            with g_step as s:
                s.backward(D(fake).mean())
    assert all(p.grad is None for p in G.parameters())


def _trunk_reference(start: nn.Module, data: list[torch.Tensor], every: int) -> list[torch.Tensor]:
    """float64 by hand: the actor trains trunk and head, the critic its head on the trunk as
    it is at its micro-step (updated by the actor's step on a window's last batch)."""
    ref = copy.deepcopy(start)
    opt_a = torch.optim.SGD([*ref.trunk.parameters(), *ref.actor.parameters()], lr=0.1)
    opt_c = torch.optim.SGD(ref.critic.parameters(), lr=0.1)
    for i, x in enumerate(data):
        last = (i + 1) % every == 0
        (ref(x)[0].pow(2).mean() / every).backward()
        if last:
            opt_a.step()
            opt_a.zero_grad(set_to_none=True)
        v = ref.critic(torch.tanh(ref.trunk(x)).detach())
        ((v - 1).pow(2).mean() / every).backward()
        if last:
            opt_c.step()
            opt_c.zero_grad(set_to_none=True)
    return params(ref)


@pytest.mark.parametrize("how", ["frozen trunk", "detached features"])
def test_a_shared_trunk_given_to_one_optimizer_trains_exactly(how: str) -> None:
    """The fixes the refusal names: each equals the float64 updates made by hand."""
    model, start, data, steps = _actor_critic(frozen=how == "frozen trunk")
    _train_actor_critic(model, data, *steps, detach=how == "detached features")
    torch.testing.assert_close(params(model), _trunk_reference(start, data, 2), rtol=0, atol=1e-12)


class _CheckpointedActorCritic(_ActorCritic):
    """The trunk under a reentrant checkpoint, whose parameters autograd hides until backward."""

    def forward(self, x: torch.Tensor, detach: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        from torch.utils.checkpoint import checkpoint

        h = checkpoint(self.trunk, x.requires_grad_(True), use_reentrant=True).tanh()
        features = h.detach().requires_grad_(True) if detach else h  # reentrant: an input with grad
        return self.actor(h), checkpoint(self.critic, features, use_reentrant=True)


def test_a_shared_trunk_behind_a_reentrant_checkpoint_is_refused() -> None:
    """checkpoint(use_reentrant=True) hides the trunk from the graph walk: the critic's loss
    still reaches it, so the group refuses, naming the reentrant checkpoint."""
    model = _CheckpointedActorCritic().double()
    opt_a = torch.optim.SGD([*model.trunk.parameters(), *model.actor.parameters()], lr=0.1)
    opt_c = torch.optim.SGD(model.critic.parameters(), lr=0.1)
    a_step, c_step = (
        loopkit.step(model, opt_a, accumulate=2),
        loopkit.step(model, opt_c, accumulate=2),
    )
    data = [torch.randn(5, 4, dtype=torch.float64) for _ in range(2)]
    with pytest.raises(RuntimeError, match=r"reentrant checkpoint") as info:
        _train_actor_critic(model, data, a_step, c_step)
    assert "steps[1]" in str(info.value) and "trunk" in str(info.value)
    assert all(p.grad is None for p in model.critic.parameters())


def test_a_reentrant_checkpoint_of_a_members_own_parameters_trains_exactly() -> None:
    """A critic head under a reentrant checkpoint on detached features reaches only its own
    parameters: accepted, and equal to the float64 updates made by hand."""
    model = _CheckpointedActorCritic().double()
    start = copy.deepcopy(model)
    opt_a = torch.optim.SGD([*model.trunk.parameters(), *model.actor.parameters()], lr=0.1)
    opt_c = torch.optim.SGD(model.critic.parameters(), lr=0.1)
    a_step, c_step = (
        loopkit.step(model, opt_a, accumulate=2),
        loopkit.step(model, opt_c, accumulate=2),
    )
    g = torch.Generator().manual_seed(5)
    data = [torch.randn(5, 4, generator=g, dtype=torch.float64) for _ in range(4)]
    _train_actor_critic(model, data, a_step, c_step, detach=True)
    ref = _ActorCritic().double()
    ref.load_state_dict(start.state_dict())
    torch.testing.assert_close(params(model), _trunk_reference(ref, data, 2), rtol=0, atol=1e-12)


@pytest.mark.parametrize("micro_batch", [None, 3])
def test_members_logs_get_the_samples_and_epoch_axes(micro_batch: int | None) -> None:
    """Each member's log gets the epoch and the samples the group handed out (whole batches
    once, chunks or not), as a single step's does; the group's state carries them."""
    from loopkit import distributed

    G, D = _gan()
    dataset = torch.utils.data.TensorDataset(torch.randn(40, 2), torch.randn(40, 4))
    loader = distributed.loader(dataset, batch_size=8, seed=0, num_workers=0)
    axes: list[dict[str, float]] = []

    def sink(metrics: dict[str, float], *, step: int, axes: Any) -> None:
        seen.append(dict(axes))

    seen = axes
    log = loopkit.detach_logging(every=1, sink=sink)
    d_step = loopkit.step(D, _opt(D), accumulate=2, log=log, micro_batch=micro_batch)
    # A GAN's generator trains through D (frozen=); with chunks, two independent members.
    frozen = [D] if micro_batch is None else []
    g_step = loopkit.step(G, _opt(G), accumulate=2, micro_batch=micro_batch, frozen=frozen)
    group = loopkit.steps(d_step, g_step)
    for epoch in range(2):
        for real, noise in group.iterate(loader):
            with d_step as s:
                s.backward(D(real).pow(2).mean())
            with g_step as s:
                out = D(G(noise)) if frozen else G(noise)
                s.backward(out.pow(2).mean())
        assert axes[-1]["epoch"] == epoch and axes[-1]["samples"] == 40 * (epoch + 1)
    assert axes[-1]["samples"] == 80
    assert g_step.seen.samples == d_step.seen.samples == 80
    fresh = loopkit.steps(loopkit.step(D, _opt(D), accumulate=2),
                          loopkit.step(G, _opt(G), accumulate=2, frozen=frozen))  # fmt: skip
    fresh.load_state_dict(group.state_dict())
    assert fresh.members[0].seen.samples == fresh.members[1].seen.samples == 80


def test_a_log_shared_by_two_members_is_refused() -> None:
    """Each member records its loss as "loss": one log given to both would average the
    critic's and the generator's losses into one number, so the group refuses it, naming the
    fix; the same critic step then joins a group whose members have a log each."""
    gen, critic = nn.Linear(8, 2), nn.Linear(2, 1)
    shared = loopkit.detach_logging(every=2, sink=None)
    d_step = loopkit.step(critic, torch.optim.SGD(critic.parameters(), lr=0.1), log=shared)
    g_step = loopkit.step(
        gen, torch.optim.SGD(gen.parameters(), lr=0.1), log=shared, frozen=[critic]
    )
    with pytest.raises(ValueError, match=r"steps 0 and 1 share one log .* its own detach_logging"):
        loopkit.steps(d_step, g_step)
    own = loopkit.step(gen, torch.optim.SGD(gen.parameters(), lr=0.1), log=2, frozen=[critic])
    loopkit.steps(d_step, own)  # one log each: taken
