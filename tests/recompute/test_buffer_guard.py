"""Buffers written by a checkpointed forward (BatchNorm running statistics, counters) are
written once, and the recompute sees the values the forward saw."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from helpers import assert_bit_equal, deep, params
from torch import nn

import loopkit


class CallCounter(nn.Module):
    """Counts its training calls in a buffer, in place or by rebinding it."""

    def __init__(self, rebind: bool = False) -> None:
        super().__init__()
        self.rebind = rebind
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            if self.rebind:
                self.calls = self.calls + 1
            else:
                self.calls += 1
        return x


class Scaled(nn.Module):
    """Its output depends on a buffer it updates: the recompute must see the forward's input."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.register_buffer("ema", torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            with torch.no_grad():
                self.ema.mul_(0.9).add_(x.detach().abs().mean(0), alpha=0.1)
        return self.fc(x) / self.ema.clone()  # a copy: the next forward writes ema again


def _norm(kind: str, c: int) -> nn.Module:
    return {
        "bn1d": lambda: nn.BatchNorm1d(c),
        "lazy_bn1d": lambda: nn.LazyBatchNorm1d(),
        "bn2d": lambda: nn.BatchNorm2d(c),
        "bn_cumulative": lambda: nn.BatchNorm2d(c, momentum=None),
        "instancenorm": lambda: nn.InstanceNorm2d(c, track_running_stats=True),
    }[kind]()


class NormBlock(nn.Module):
    """A linear/conv, a norm that tracks running statistics, and a call counter."""

    def __init__(self, kind: str, c: int = 6) -> None:
        super().__init__()
        self.conv = nn.Linear(c, c) if "1d" in kind else nn.Conv2d(c, c, 3, padding=1)
        self.norm = _norm(kind, c)
        self.count = CallCounter()
        self.count_rebind = CallCounter(rebind=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.count_rebind(self.count(self.norm(self.conv(x)))))


def _norm_net(kind: str, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    head: nn.Module = nn.Linear(6, 2) if "1d" in kind else nn.Conv2d(6, 2, 1)
    return nn.Sequential(NormBlock(kind), NormBlock(kind), head)


def _norm_input(kind: str, seed: int) -> torch.Tensor:
    shape = (8, 6) if "1d" in kind else (4, 6, 5, 5)
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _train_steps(
    model: nn.Module, kind: str, steps: int = 3
) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    """Trains ``steps`` SGD steps; returns the weights, the buffers and an eval output."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    grads: list[torch.Tensor] = []
    model.train()
    for i in range(steps):
        model(_norm_input(kind, i)).pow(2).mean().backward()
        grads += [p.grad.clone() for p in model.parameters() if p.grad is not None]
        opt.step()
        opt.zero_grad(set_to_none=True)
    model.eval()
    with torch.no_grad():
        out = model(_norm_input(kind, 99))
    return grads + params(model), [b.clone() for b in model.buffers()], out


@pytest.mark.parametrize("policy", ["full", "save_matmuls"])
@pytest.mark.parametrize("kind", ["bn1d", "lazy_bn1d", "bn2d", "bn_cumulative", "instancenorm"])
def test_buffers_written_in_forward_are_written_once(kind: str, policy: str) -> None:
    """Running stats, num_batches_tracked and counters: as after plain steps, bit for bit."""
    ref_weights, ref_buffers, ref_eval = _train_steps(_norm_net(kind), kind)
    model = loopkit.checkpointed(_norm_net(kind), blocks=NormBlock, policy=policy)
    weights, buffers, out = _train_steps(model, kind)
    assert_bit_equal(ref_weights, weights)  # gradients at every step, then the weights
    assert_bit_equal(ref_buffers, buffers)
    assert torch.equal(ref_eval, out)
    assert int(model[0].count.calls) == int(model[0].count_rebind.calls) == 3
    if kind != "instancenorm":
        assert int(model[0].norm.num_batches_tracked) == 3


class Bottleneck(nn.Module):
    """A ResNet basic block with a strided 1x1 downsample, BatchNorm after every conv."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(y)) + self.down(x))


def _resnet(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        Bottleneck(8, 16, 2),
        Bottleneck(16, 16, 1),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, 10),
    )


@pytest.mark.parametrize(
    "apply",
    [
        lambda m: loopkit.checkpointed(m, blocks=Bottleneck),
        lambda m: loopkit.checkpointed(m, blocks=Bottleneck, policy="save_matmuls"),
        lambda m: loopkit.checkpointed(m),
    ],
    ids=["blocks", "blocks_save_matmuls", "whole_model"],
)
def test_resnet_trained_through_step_matches_plain(apply: Callable[[nn.Module], nn.Module]) -> None:
    """A checkpointed ResNet trained by loopkit.step: weights, buffers, eval logits identical."""
    x = torch.randn(16, 3, 12, 12, generator=torch.Generator().manual_seed(5))
    y = torch.randint(0, 10, (16,), generator=torch.Generator().manual_seed(6))
    results = []
    for model in (_resnet(), apply(_resnet())):
        step = loopkit.step(model, torch.optim.AdamW(model.parameters(), lr=1e-2), accumulate=2)
        model.train()
        for i in range(4):
            with step as s:
                s.backward(nn.functional.cross_entropy(model(x[i::4]), y[i::4]))
        model.eval()
        with torch.no_grad():
            logits = model(x)
        results.append((params(model), [b.clone() for b in model.buffers()], logits))
    assert_bit_equal(results[0][0], results[1][0])
    assert_bit_equal(results[0][1], results[1][1])
    assert torch.equal(results[0][2], results[1][2])
    assert int(results[1][1][-1]) == 4  # the last num_batches_tracked: one per micro-step


@pytest.mark.parametrize("policy", ["full", "save_matmuls"])
@pytest.mark.parametrize(
    "make",
    [
        lambda: Scaled(8),
        lambda: nn.utils.parametrizations.spectral_norm(nn.Linear(8, 8)),
        lambda: nn.utils.spectral_norm(nn.Linear(8, 8)),
    ],
    ids=["ema_scaled", "spectral_norm", "spectral_norm_hook"],
)
def test_recompute_sees_the_buffers_the_forward_saw(
    make: Callable[[], nn.Module], policy: str
) -> None:
    """Outputs depending on a buffer the forward updates: gradients and buffers bit-identical."""

    def run(checkpoint: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), make(), nn.Tanh(), make())
        if checkpoint:
            loopkit.checkpointed(model, policy=policy)
        out: list[torch.Tensor] = []
        for i in range(3):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(i))
            model(x).pow(2).sum().backward()
            out += [p.grad.clone() for p in model.parameters()]
        return out + [b.clone() for b in model.buffers()]

    assert_bit_equal(run(False), run(True))


def test_decorated_forward_and_function_guard_their_modules() -> None:
    """@checkpointed on a forward covers self's buffers; on a function, the modules passed to it."""

    class DecoratedBlock(NormBlock):
        @loopkit.checkpointed
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x)

    @loopkit.checkpointed
    def apply_block(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return block(x)

    torch.manual_seed(0)
    plain = NormBlock("bn2d")
    torch.manual_seed(0)
    decorated = DecoratedBlock("bn2d")
    by_function = copy.deepcopy(plain)
    x = _norm_input("bn2d", 0)
    grads = []
    for run in (plain, decorated, lambda t: apply_block(by_function, t)):
        run(x).pow(2).mean().backward()
    for m in (plain, decorated, by_function):
        grads.append([p.grad for p in m.parameters()] + list(m.buffers()))
    assert_bit_equal(grads[0], grads[1])  # type: ignore[arg-type]
    assert_bit_equal(grads[0], grads[2])  # type: ignore[arg-type]
    assert int(decorated.norm.num_batches_tracked) == int(by_function.count.calls) == 1


def test_two_forwards_then_retained_double_backward() -> None:
    """Two forwards before one backward, then a second backward with retain_graph: as plain."""

    def net() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(NormBlock("bn1d"), Scaled(6), NormBlock("bn1d"))

    def run(model: nn.Module) -> list[torch.Tensor]:
        loss = model(_norm_input("bn1d", 1)).mean() + model(_norm_input("bn1d", 2)).pow(2).mean()
        loss.backward(retain_graph=True)
        first = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
        loss.backward()  # recomputes each region again, from the same buffer values
        return first + [p.grad.clone() for p in model.parameters()] + list(model.buffers())  # type: ignore[union-attr]

    ref = run(net())
    assert_bit_equal(ref, run(loopkit.checkpointed(net(), blocks=(NormBlock, Scaled))))


def test_module_switched_to_train_after_a_checkpointed_eval_step() -> None:
    """BatchNorm run in eval (grad on) and then in train: the later writes are still caught."""

    def run(model: nn.Sequential) -> list[torch.Tensor]:
        model.eval()
        model(_norm_input("bn2d", 1)).mean().backward()
        model.train()
        model(_norm_input("bn2d", 2)).mean().backward()
        model(_norm_input("bn2d", 3)).mean().backward()
        return [p.grad for p in model.parameters()] + list(model.buffers())  # type: ignore[misc]

    ref = run(_norm_net("bn2d"))
    assert_bit_equal(ref, run(loopkit.checkpointed(_norm_net("bn2d"), blocks=NormBlock)))


@pytest.mark.parametrize("early_stop", [True, False])
def test_buffers_restored_with_and_without_early_stop(early_stop: bool) -> None:
    """Whether torch stops the recompute early (raising out of it) or runs it to the end."""
    ref = _norm_net("bn2d")
    ref(_norm_input("bn2d", 0)).mean().backward()
    model = loopkit.checkpointed(_norm_net("bn2d"), blocks=NormBlock)
    with torch.utils.checkpoint.set_checkpoint_early_stop(early_stop):
        model(_norm_input("bn2d", 0)).mean().backward()
    assert_bit_equal(list(ref.buffers()), list(model.buffers()))
    assert_bit_equal([p.grad for p in ref.parameters()], [p.grad for p in model.parameters()])  # type: ignore[misc]


def test_buffer_guard_adds_no_host_sync() -> None:
    """A checkpointed BatchNorm step reads the device exactly as often as a plain one."""
    counts = []
    for model in (_resnet(), loopkit.checkpointed(_resnet(), blocks=Bottleneck)):
        model(torch.randn(2, 3, 8, 8)).sum().backward()  # the first call copies every buffer
        with loopkit.count_host_syncs() as syncs:
            model(torch.randn(2, 3, 8, 8)).sum().backward()
        counts.append(syncs.count)
    assert counts[0] == counts[1]


@deep
@pytest.mark.parametrize("graph_break", [False, True])
def test_checkpointed_then_compiled_writes_buffers_once(graph_break: bool) -> None:
    """checkpointed, then torch.compile: gradients and BatchNorm buffers as the plain model's."""

    class Breaking(NormBlock):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if graph_break:  # the region cannot be traced: torch runs this checkpoint eagerly
                torch._dynamo.graph_break()
            return super().forward(x)

    def net() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(Breaking("bn2d"), Breaking("bn2d"))

    ref = net()
    ref(_norm_input("bn2d", 0)).pow(2).mean().backward()
    inner = loopkit.checkpointed(net(), blocks=Breaking)
    compiled = torch.compile(inner, backend="aot_eager")
    compiled(_norm_input("bn2d", 0)).pow(2).mean().backward()
    assert_bit_equal(list(ref.buffers()), list(inner.buffers()))
    assert_bit_equal([p.grad for p in ref.parameters()], [p.grad for p in inner.parameters()])  # type: ignore[misc]
