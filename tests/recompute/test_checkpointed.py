"""checkpointed: identical results, measured memory saved, bounded recompute, safe to reapply."""

from __future__ import annotations

import copy
import pickle
from collections.abc import Callable
from typing import Any

import pytest
import torch
from helpers import assert_bit_equal, params
from recompute_helpers import CALLS, Block, X, run_model, saved_bytes, stack
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import loopkit

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


@pytest.mark.parametrize("setup", sorted(SETUPS))
def test_outputs_and_gradients_bit_identical_with_dropout(setup: str) -> None:
    """Every way of checkpointing gives the plain model's outputs and gradients, bit for bit."""
    plain_out, plain_grads = run_model(stack())
    out, grads = run_model(SETUPS[setup](stack()))
    assert torch.equal(plain_out, out)
    assert_bit_equal(plain_grads, grads)


def test_saved_bytes_full_every2_selective() -> None:
    """Full keeps at most 1/4 of the plain bytes; every=2 and save_matmuls sit in between."""
    sizes = {
        name: saved_bytes(SETUPS[name](stack()))
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
    plain_out, plain_grads = run_model(stack())
    model.zero_grad()
    out, grads = run_model(model)
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
