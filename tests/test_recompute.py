"""checkpointed: identical results, measured memory saved, bounded recompute, safe to reapply."""

from __future__ import annotations

import copy
import pickle
from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers import assert_bit_equal, params
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import loopkit

CALLS = {"forward": 0}


class Block(nn.Module):
    """A pre-norm MLP block with dropout and a residual, like a transformer's."""

    def __init__(self, d: int = 64, h: int = 256) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, h)
        self.act = nn.GELU()
        self.drop = nn.Dropout(0.1)
        self.fc2 = nn.Linear(h, d)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        CALLS["forward"] += 1
        return x + scale * self.fc2(self.drop(self.act(self.fc1(self.norm(x)))))


def stack(seed: int = 0) -> nn.Sequential:
    """Eight identical blocks and a head."""
    torch.manual_seed(seed)
    return nn.Sequential(*[Block() for _ in range(8)], nn.Linear(64, 1))


X = torch.randn(32, 64, generator=torch.Generator().manual_seed(3))

SETUPS: dict[str, Callable[[nn.Module], nn.Module]] = {
    "none": lambda m: m,
    "full": lambda m: loopkit.checkpointed(m, blocks=Block),
    "every2": lambda m: loopkit.checkpointed(m, blocks=Block, every=2),
    "save_matmuls": lambda m: loopkit.checkpointed(m, blocks=Block, policy="save_matmuls"),
    "callable": lambda m: loopkit.checkpointed(
        m, blocks=Block, policy=lambda ctx, op, *a, **k: op.overloadpacket is torch.ops.aten.addmm
    ),
    "op_list": lambda m: loopkit.checkpointed(
        m, blocks=lambda mod: isinstance(mod, Block), policy=[torch.ops.aten.addmm.default]
    ),
    "whole_model": lambda m: loopkit.checkpointed(m),
}


def _run(model: nn.Module, seed: int = 7) -> tuple[torch.Tensor, list[torch.Tensor]]:
    torch.manual_seed(seed)  # the same dropout masks for every variant
    out = model(X)
    out.sum().backward()
    return out.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("setup", sorted(SETUPS))
def test_outputs_and_gradients_bit_identical_with_dropout(setup: str) -> None:
    """Every way of checkpointing gives the plain model's outputs and gradients, bit for bit."""
    plain_out, plain_grads = _run(stack())
    out, grads = _run(SETUPS[setup](stack()))
    assert torch.equal(plain_out, out)
    assert_bit_equal(plain_grads, grads)


def _saved_bytes(model: nn.Module) -> int:
    with loopkit.track_memory() as mem:
        out = model(X).sum()
        kept = mem.live
    out.backward()
    return kept


def test_saved_bytes_full_every2_selective() -> None:
    """Full keeps at most 1/4 of the plain bytes; every=2 and save_matmuls sit in between."""
    sizes = {
        name: _saved_bytes(SETUPS[name](stack()))
        for name in ("none", "full", "every2", "save_matmuls")
    }
    assert sizes["full"] <= sizes["none"] / 4, sizes
    assert sizes["full"] < sizes["every2"] < sizes["none"], sizes
    assert sizes["full"] < sizes["save_matmuls"] < sizes["none"], sizes


def test_track_memory_sees_what_saved_tensor_hooks_see() -> None:
    """Cross-check: on the plain model the tracker agrees with saved_tensors_hooks' count."""
    model = stack()
    seen: dict[int, int] = {}
    param_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in param_ptrs and s.data_ptr() != X.untyped_storage().data_ptr():
            seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), loopkit.track_memory() as mem:
        out = model(X).sum()
        kept = mem.live
    out_bytes = out.untyped_storage().nbytes()
    assert kept - out_bytes == sum(seen.values())


def _flops(model: nn.Module) -> int:
    with FlopCounterMode(display=False) as counter:
        model(X).sum().backward()
    return int(counter.get_total_flops())


def test_recompute_costs_at_most_one_forward() -> None:
    """Full checkpointing adds at most one forward of FLOPs; save_matmuls adds less."""
    plain = _flops(stack())
    with FlopCounterMode(display=False) as fwd_counter, torch.no_grad():
        stack()(X)
    forward = fwd_counter.get_total_flops()
    full = _flops(SETUPS["full"](stack()))
    selective = _flops(SETUPS["save_matmuls"](stack()))
    assert plain < full <= plain + forward
    assert selective < full
    assert selective >= plain


def _forward_calls(model: nn.Module, fn: Callable[[], Any]) -> int:
    CALLS["forward"] = 0
    fn()
    return CALLS["forward"]


def test_no_recompute_when_no_backward_can_happen() -> None:
    """Under no_grad, inference_mode, or with nothing requiring grad, blocks run once."""
    model = SETUPS["full"](stack())
    assert _forward_calls(model, lambda: model(X).sum().backward()) == 16  # forward + recompute
    with torch.no_grad():
        assert _forward_calls(model, lambda: model(X)) == 8
    with torch.inference_mode():
        assert _forward_calls(model, lambda: model(X)) == 8
    model.requires_grad_(False)
    assert _forward_calls(model, lambda: model(X)) == 8


def test_inputs_without_grad_still_checkpoint_when_parameters_need_it() -> None:
    """The first block's input needs no grad, but its parameters do: it is checkpointed."""
    block = loopkit.checkpointed(Block())
    assert _forward_calls(block, lambda: block(X).sum().backward()) == 2


def test_applying_twice_or_nested_never_recomputes_twice() -> None:
    """Reapplied or nested checkpointing recomputes once, not twice."""
    model = SETUPS["full"](stack())
    loopkit.checkpointed(model, blocks=Block)  # again, same settings
    assert _forward_calls(model, lambda: model(X).sum().backward()) == 16
    loopkit.checkpointed(model)  # the whole model around the checkpointed blocks
    assert _forward_calls(model, lambda: model(X).sum().backward()) == 16
    plain_out, plain_grads = _run(stack())
    model.zero_grad()
    out, grads = _run(model)
    assert torch.equal(out, plain_out)
    assert_bit_equal(grads, plain_grads)


def test_reapplying_with_another_policy_is_refused_without_change() -> None:
    """A second, different policy is an error, and leaves every block as it was."""
    model = SETUPS["every2"](stack())
    before = [loopkit.is_checkpointed(m) for m in model]
    with pytest.raises(ValueError, match="already checkpointed"):
        loopkit.checkpointed(model, blocks=Block, policy="save_matmuls")
    assert [loopkit.is_checkpointed(m) for m in model] == before


def test_decorators_on_functions_and_forward() -> None:
    """@checkpointed on a function and on a forward method; keyword arguments pass through."""

    class Decorated(Block):
        @loopkit.checkpointed(policy="save_matmuls")
        def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
            return super().forward(x, scale=scale)

    torch.manual_seed(0)
    plain = Block()
    torch.manual_seed(0)
    dec = Decorated()

    @loopkit.checkpointed
    def twice(block: nn.Module, x: torch.Tensor, *, debug: bool = False) -> torch.Tensor:
        assert debug is True  # a kwarg named like a checkpoint option reaches the function
        return block(block(x))

    x = X.clone().requires_grad_()
    torch.manual_seed(1)
    ref = plain(plain(x, scale=0.5), scale=0.5)
    torch.manual_seed(1)
    got = dec(dec(x, scale=0.5), scale=0.5)
    assert torch.equal(ref, got)
    assert loopkit.is_checkpointed(twice) and not loopkit.is_checkpointed(plain)
    torch.manual_seed(1)
    got = twice(plain, x, debug=True)
    torch.manual_seed(1)
    assert torch.equal(got, plain(plain(x)))


def test_composes_with_autocast_bit_for_bit() -> None:
    """Under bf16 autocast_step the recompute runs in bf16 too: gradients are identical."""
    amp = loopkit.autocast_step("bf16", device_type="cpu")
    results = []
    for model in (stack(), SETUPS["full"](stack())):
        torch.manual_seed(7)
        with amp:
            out = model(X)
        assert out.dtype == torch.bfloat16
        out.float().sum().backward()
        results.append([p.grad for p in model.parameters()])
    assert_bit_equal(results[0], results[1])  # type: ignore[arg-type]


def test_composes_with_step_and_accumulation() -> None:
    """Training a checkpointed model through loopkit.step gives the plain model's weights."""
    trained = []
    for setup in ("none", "every2"):
        model = SETUPS[setup](stack())
        step = loopkit.step(
            model,
            torch.optim.AdamW(model.parameters(), lr=1e-3),
            precision="bf16",
            accumulate=2,
            clip_grad_norm=1.0,
        )
        torch.manual_seed(11)
        for _ in range(4):
            with step as s:
                s.backward(model(X).float().pow(2).mean())
        trained.append(params(model))
    assert_bit_equal(trained[0], trained[1])


def test_deepcopy_pickle_and_state_dict_keys() -> None:
    """Names and state_dict keys are unchanged; deepcopy and pickle keep the checkpointing."""
    plain = stack()
    model = SETUPS["full"](stack())
    assert list(model.state_dict()) == list(plain.state_dict())
    assert isinstance(model[0], Block) and type(model[0]).__name__ == "Block"
    for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert all(loopkit.is_checkpointed(m) for m in list(clone)[:8])
        assert clone[0] is not model[0]
        assert _forward_calls(clone, lambda c=clone: c(X).sum().backward()) == 16
        assert_bit_equal(params(clone), params(model))


@pytest.mark.parametrize(
    ("call", "exc", "hint"),
    [
        (lambda: loopkit.checkpointed(3), TypeError, "module or a function"),
        (lambda: loopkit.checkpointed(stack(), blocks=Block, every=0), ValueError, "every"),
        (lambda: loopkit.checkpointed(stack(), blocks=nn.Conv2d), ValueError, "matches no"),
        (lambda: loopkit.checkpointed(stack(), blocks="Block"), TypeError, "predicate"),
        (lambda: loopkit.checkpointed(stack(), policy="some"), ValueError, "'save_matmuls'"),
        (lambda: loopkit.checkpointed(stack(), policy=[1, 2]), ValueError, "torch ops"),
        (lambda: loopkit.checkpointed(stack(), every=2), TypeError, "needs blocks="),
        (lambda: loopkit.checkpointed(lambda x: x, blocks=Block), TypeError, "module"),
        (lambda: loopkit.checkpointed(stack(), preserve_rng_state=1), TypeError, "True or False"),
    ],
)
def test_bad_input_is_refused(call: Callable[[], Any], exc: type[Exception], hint: str) -> None:
    """Wrong targets, counts, selections and policies raise with the fix in the message."""
    with pytest.raises(exc) as info:
        call()
    assert hint in str(info.value)


# --- Buffers written by the forward (BatchNorm running statistics, counters) ---------------


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


# --- Compiled modules --------------------------------------------------------------------


def _compiled_cases() -> dict[str, Callable[[], tuple[nn.Module, list[nn.Module]]]]:
    def wrapper() -> tuple[nn.Module, list[nn.Module]]:
        m = stack()
        return torch.compile(m, backend="eager"), list(m)

    def in_place() -> tuple[nn.Module, list[nn.Module]]:
        m = stack()
        m.compile(backend="eager")
        return m, list(m)

    def wrapper_blocks() -> tuple[nn.Module, list[nn.Module]]:
        m = stack()
        return torch.compile(m, backend="eager"), list(m)

    def compiled_block() -> tuple[nn.Module, list[nn.Module]]:
        m = stack()
        m[3].compile(backend="eager")
        return m, list(m)

    def wrapped_block() -> tuple[nn.Module, list[nn.Module]]:
        m = stack()
        m[5] = torch.compile(m[5], backend="eager")
        return m, [*list(m)[:5], m[5]._orig_mod, *list(m)[6:]]

    return {
        "wrapper": wrapper,
        "in_place": in_place,
        "wrapper_blocks": wrapper_blocks,
        "compiled_block": compiled_block,
        "wrapped_block": wrapped_block,
    }


@pytest.mark.parametrize("case", sorted(_compiled_cases()))
def test_compiled_modules_are_refused_without_change(case: str) -> None:
    """A compiled module, or blocks= inside one, is refused ("first, then compile"), unchanged."""
    model, blocks = _compiled_cases()[case]()
    classes = [type(m) for m in (model, *blocks)]
    with pytest.raises(ValueError, match=r"Apply loopkit\.checkpointed first, then compile"):
        if case in ("wrapper", "in_place"):
            loopkit.checkpointed(model)
        else:
            loopkit.checkpointed(model, blocks=Block)
    assert [type(m) for m in (model, *blocks)] == classes
    assert not any(loopkit.is_checkpointed(m) for m in (model, *blocks))
    _, grads = _run(model)  # still the plain model
    _, plain_grads = _run(stack())
    assert_bit_equal(plain_grads, grads)


def test_checkpointed_then_compiled_saves_memory_and_reapplies_as_no_op() -> None:
    """The right order works: bytes kept drop, gradients match; re-applying changes nothing."""
    plain = stack()
    model = loopkit.checkpointed(stack(), blocks=Block)
    compiled = torch.compile(model, backend="eager")
    assert _saved_bytes(compiled) <= _saved_bytes(torch.compile(plain, backend="eager")) / 4
    assert loopkit.checkpointed(compiled, blocks=Block) is compiled  # every block already is
    with pytest.raises(ValueError, match="another policy"):
        loopkit.checkpointed(compiled, blocks=Block, policy="save_matmuls")
    with pytest.raises(ValueError, match="then compile"):
        loopkit.checkpointed(compiled)  # the whole model was not checkpointed before compiling
    block = torch.compile(loopkit.checkpointed(Block()), backend="eager")
    assert loopkit.is_checkpointed(block)  # seen through the compile wrapper
    assert loopkit.checkpointed(block) is block
    plain.zero_grad()
    model.zero_grad()
    assert_bit_equal(_run(plain)[1], _run(compiled)[1])


# --- KV caches (transformers) ------------------------------------------------------------


class ListCache:
    """A KV cache with transformers' Cache API: update appends, get_seq_length counts."""

    def __init__(self) -> None:
        self.keys: list[torch.Tensor] = []

    def update(self, k: torch.Tensor) -> torch.Tensor:
        self.keys.append(k)
        return torch.cat(self.keys, dim=1)

    def get_seq_length(self) -> int:
        return sum(k.shape[1] for k in self.keys)


class CachedAttention(nn.Module):
    """Writes its keys to the cache it is given, then attends over all of them."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.q, self.k = nn.Linear(d, d), nn.Linear(d, d)

    def forward(
        self,
        x: torch.Tensor,
        cache: ListCache | None = None,
        past_key_values: ListCache | None = None,
        use_cache: bool = False,
    ) -> torch.Tensor:
        keys = self.k(x)
        for c in (cache, past_key_values):
            if c is not None:
                keys = c.update(keys)
        return torch.softmax(self.q(x) @ keys.transpose(1, 2), -1) @ keys


@pytest.mark.parametrize(
    ("call", "hint"),
    [
        (lambda m, x, c: m(x, past_key_values=c), "past_key_values= (ListCache)"),
        (lambda m, x, c: m(x, c), "positional argument 1 (ListCache)"),
        (lambda m, x, c: m(x, use_cache=True), "use_cache=True"),
    ],
    ids=["keyword", "positional", "use_cache"],
)
def test_kv_cache_in_a_grad_call_is_refused_before_writing(
    call: Callable[[nn.Module, torch.Tensor, ListCache], torch.Tensor], hint: str
) -> None:
    """A cache or use_cache=True in a grad-mode checkpointed call raises; nothing is written."""
    model = loopkit.checkpointed(CachedAttention())
    x, cache = torch.randn(2, 5, 16), ListCache()
    with pytest.raises(ValueError, match=r"model\.config\.use_cache = False") as info:
        call(model, x, cache)
    assert hint in str(info.value)
    assert cache.keys == []
    with torch.no_grad():  # generation: no recompute, the cache works
        model(x, past_key_values=cache)
        model(x[:, :1], past_key_values=cache)
    assert cache.get_seq_length() == 6


def _gpt2(impl: str) -> nn.Module:
    transformers = pytest.importorskip("transformers", reason="transformers is in the dev extra")
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=128, attn_implementation=impl
    )
    model: nn.Module = transformers.GPT2LMHeadModel(config)
    return model


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_gpt2_default_config_gradients_match_plain(impl: str) -> None:
    """GPT2 (use_cache=True by default): its blocks checkpointed, gradients are bit-identical."""
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    plain = _gpt2(impl)
    model = copy.deepcopy(plain)
    with pytest.warns(UserWarning, match="config.use_cache = False"):
        loopkit.checkpointed(model, blocks=GPT2Block)
    assert model.config.use_cache is False and plain.config.use_cache is True
    x = torch.randint(0, 100, (2, 94), generator=torch.Generator().manual_seed(1))
    for m in (plain, model):
        torch.manual_seed(3)  # the same dropout masks
        m(x, labels=x).loss.backward()
    assert_bit_equal([p.grad for p in plain.parameters()], [p.grad for p in model.parameters()])  # type: ignore[misc]
    with torch.no_grad():  # generation still gets its cache
        out = model(x, use_cache=True)
    assert out.past_key_values.get_seq_length() == 94
    with pytest.raises(ValueError, match="use_cache"):
        model(x, use_cache=True)  # in grad mode: refused before any block runs twice


def test_gpt2_use_cache_turned_off_with_one_warning() -> None:
    """The warning comes once: applying again finds use_cache already False."""
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    model = _gpt2("eager")
    with pytest.warns(UserWarning):
        loopkit.checkpointed(model, blocks=GPT2Block)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loopkit.checkpointed(model, blocks=GPT2Block)
