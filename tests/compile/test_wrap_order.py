"""distributed.wrap(compile=): compiled in place, in the order with the fewest graph breaks."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
import torch._dynamo
from torch import nn
from torch._dynamo.utils import clear_compilation_metrics, get_compilation_metrics

import loopkit
from loopkit import distributed

EAGER = {"backend": "eager"}


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x)) + x


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(Block(), Block(), nn.Linear(8, 2))


def _compiled_in_place(module: nn.Module) -> bool:
    return "forward" in module.__dict__  # wrap gives the module a compiled forward


def test_one_process_compiles_the_model_in_place_with_its_own_keys() -> None:
    """The same module comes back, compiled (its forward runs through dynamo), its state
    dict keys the uncompiled model's, its output and gradients the eager ones."""
    eager, model = _model(), _model()
    keys = list(model.state_dict())
    torch._dynamo.reset()
    clear_compilation_metrics()
    wrapped = distributed.wrap(model, compile=EAGER)
    assert wrapped is model and _compiled_in_place(model)
    assert list(model.state_dict()) == keys  # no "_orig_mod." anywhere
    x = torch.randn(3, 8)
    out, ref = model(x), eager(x)
    assert get_compilation_metrics(), "the forward was not compiled"
    assert torch.equal(out, ref)
    out.sum().backward()
    ref.sum().backward()
    for p, q in zip(model.parameters(), eager.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)


def test_fsdp_blocks_are_compiled_each_on_their_own() -> None:
    """fsdp=Block: each block compiled (as torchtitan does before sharding), not the root."""
    model = _model()
    distributed.wrap(model, fsdp=Block, compile=EAGER)
    assert [_compiled_in_place(m) for m in model] == [True, True, False]
    assert not _compiled_in_place(model)


def test_checkpointed_first_then_compile_and_the_reverse_is_refused() -> None:
    """loopkit.checkpointed before wrap(compile=) recomputes inside the compiled blocks;
    after it, it is refused with the order (the compiled code would skip the checkpoint)."""
    model = loopkit.checkpointed(_model(), blocks=Block)
    distributed.wrap(model, compile=EAGER)
    assert loopkit.is_checkpointed(model[0])
    model(torch.randn(2, 8)).sum().backward()
    late = _model()
    distributed.wrap(late, fsdp=Block, compile=EAGER)
    with pytest.raises(ValueError, match=r"Apply loopkit\.checkpointed first, then compile"):
        loopkit.checkpointed(late, blocks=Block)


@pytest.mark.parametrize("how", ["torch.compile", "module.compile", "a block"])
def test_a_model_compiled_already_is_refused_before_any_change(how: str) -> None:
    """wrap(compile=) of a compiled model (or one holding a compiled block) says to pass it
    uncompiled; nothing is compiled by the refused call."""
    model: Any = _model()
    if how == "torch.compile":
        model = torch.compile(model, **EAGER)
    elif how == "module.compile":
        model.compile(**EAGER)
    else:
        model[1].compile(**EAGER)
    with pytest.raises(ValueError, match=r"compiled already.*pass it uncompiled"):
        distributed.wrap(model, compile=EAGER)
    if how == "a block":
        assert not _compiled_in_place(model[0]) and not _compiled_in_place(model)


@pytest.mark.parametrize(
    ("value", "error", "words"),
    [(1, TypeError, "must be True, False or a dict"),
     ({"fullgraf": True}, ValueError, "'fullgraf', which is not a keyword of torch.compile")],
)  # fmt: skip
def test_bad_compile_values_are_refused(value: Any, error: type, words: str) -> None:
    """compile= takes True/False or torch.compile's keywords; the model stays uncompiled."""
    model = _model()
    with pytest.raises(error, match=words):
        distributed.wrap(model, compile=value)
    assert not any(_compiled_in_place(m) for m in model.modules())


def test_a_step_on_torch_compile_of_a_ddp_model_warns_with_the_order(process_group: None) -> None:
    """torch.compile(DDP(model)) (Accelerate's and Fabric's order) and DDP(model).compile()
    are said at the step's build, naming wrap(model, compile=True);
    DDP(torch.compile(model)) is not."""
    ddp = nn.parallel.DistributedDataParallel(_model())
    outer = torch.compile(ddp, **EAGER)
    with pytest.warns(UserWarning, match=r"distributed.wrap\(model, compile=True\)"):
        loopkit.step(outer, torch.optim.SGD(outer.parameters(), lr=0.1))
    in_place = nn.parallel.DistributedDataParallel(_model())
    in_place.compile(**EAGER)  # DDP(model).compile(): the same mistake, in place
    with pytest.warns(UserWarning, match=r"compiled in place with \.compile\(\)"):
        loopkit.step(in_place, torch.optim.SGD(in_place.parameters(), lr=0.1))
    inner = distributed.wrap(_model(), compile=EAGER)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loopkit.step(inner, torch.optim.SGD(inner.parameters(), lr=0.1))
    del ddp, outer, inner, in_place


def test_a_deep_copy_runs_its_own_weights() -> None:
    """copy.deepcopy of a wrap(compile=) model (a hand-written EMA's copy) computes with the
    copy's weights, not the original's."""
    import copy

    model = distributed.wrap(_model(), compile=EAGER)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in twin.parameters():
            p.mul_(0.5)
    x = torch.randn(2, 8)
    plain = _model()
    with torch.no_grad():
        for p in plain.parameters():
            p.mul_(0.5)
    assert torch.equal(twin(x), plain(x))
    assert torch.equal(model(x), _model()(x))


def test_under_ddp_and_fsdp2_wrap_compiles_without_breaks_and_trains_as_eager(
    dist_results: dict[str, list[dict[str, Any]]],
) -> None:
    """2 ranks: wrap(compile=) is DDP(compile(m)) (one graph, no break, where
    torch.compile(DDP(m)) breaks 3 times, and the step says so) and FSDP2 with each block
    compiled before sharding (no break); both end bit-identical to the eager runs."""
    for r in dist_results["compile_wrap_order"]:
        weights = {k: v[0] for k, v in r.items() if k != "warned"}
        breaks = {k: v[1] for k, v in r.items() if k != "warned"}
        graphs = {k: v[2] for k, v in r.items() if k != "warned"}
        assert breaks["ddp_wrap"] == 0 and graphs["ddp_wrap"] >= 1
        assert breaks["ddp_outside"] > 0
        assert breaks["fsdp_wrap"] == 0 and graphs["fsdp_wrap"] >= 1
        for compiled, eager in (("ddp_wrap", "ddp_eager"), ("fsdp_wrap", "fsdp_eager")):
            for key, value in weights[eager].items():
                assert torch.equal(weights[compiled][key], value), (compiled, key)
        assert len(r["warned"]) == 1 and "compile=True" in r["warned"][0]


def test_a_forward_set_on_the_instance_is_compiled_and_one_compiled_already_refused() -> None:
    """A patched forward (an adapter's) is the one compiled, not the class's; a forward
    that is torch.compile'd already is refused as compiled."""
    model = nn.Linear(4, 4)
    plain = model.forward
    model.forward = lambda x: plain(x) * 0  # type: ignore[method-assign]
    distributed.wrap(model, compile=EAGER)
    assert torch.equal(model(torch.randn(2, 4)), torch.zeros(2, 4))
    twice = nn.Linear(4, 4)
    twice.forward = torch.compile(twice.forward, **EAGER)  # type: ignore[method-assign]
    with pytest.raises(ValueError, match=r"forward is torch\.compile'd"):
        distributed.wrap(twice, compile=EAGER)


def test_a_wrapped_model_pickles_and_the_copy_runs_its_own_weights(tmp_path: Any) -> None:
    """torch.save(model) of a wrap(compile=) model (every block compiled) loads back
    compiled, with the saved weights and the same outputs."""
    model = distributed.wrap(_model(), fsdp=Block, compile=EAGER)
    torch.save(model, tmp_path / "m.pt")
    back = torch.load(tmp_path / "m.pt", weights_only=False)
    assert _compiled_in_place(back[0]) and back[0].forward.module is back[0]
    x = torch.randn(2, 8)
    assert torch.equal(back(x), model(x))


class _Masked(nn.Module):
    """A block whose forward takes a keyword with a default, as a Trainer's model does."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """The block's own docstring."""
        y = torch.tanh(self.lin(x)) + x
        return y if mask is None else y * mask


class _MaskedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.head = _Masked(), _Masked(), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.head(self.b(self.a(x, mask), mask))


@pytest.mark.parametrize("fsdp", [False, _Masked])
def test_what_inspects_or_traces_the_model_sees_its_own_forward(fsdp: Any) -> None:
    """A wrap(compile=) model (whole, or each block) has its forward's signature, argspec,
    name and docstring; torch.export, torch.jit.trace and torch.fx trace it to the plain
    model's outputs; and it still runs compiled afterwards."""
    import inspect

    torch.manual_seed(0)
    plain = _MaskedNet()
    model = distributed.wrap(copy.deepcopy(plain), fsdp=fsdp, compile=EAGER)
    x, mask = torch.randn(3, 8), (torch.rand(3, 8) > 0.5).float()
    for module, ref in [(model, plain.forward), (model.a, plain.a.forward)]:
        got = module.forward
        assert inspect.signature(got) == inspect.signature(ref)  # a Trainer's column filter
        assert inspect.getfullargspec(got) == inspect.getfullargspec(ref)
        assert (got.__name__, got.__qualname__, got.__doc__) == (
            ref.__name__, ref.__qualname__, ref.__doc__)  # fmt: skip
        assert got.__code__ is ref.__code__ and got.__func__ is ref.__func__
        assert got.__self__ is module
    want = plain(x, mask)
    exported = torch.export.export(model, (x,), {"mask": mask})
    assert torch.equal(exported.module()(x, mask=mask), want)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # torch.jit's, said on each call
        assert torch.equal(torch.jit.trace(model, (x, mask))(x, mask), want)
    assert torch.equal(torch.fx.symbolic_trace(model)(x, mask), want)
    assert list(model.state_dict()) == list(plain.state_dict())
    torch._dynamo.reset()
    clear_compilation_metrics()
    assert torch.equal(model(x, mask), want)
    assert get_compilation_metrics(), "no longer compiled"
