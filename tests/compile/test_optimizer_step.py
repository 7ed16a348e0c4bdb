"""compile_optimizer=: the optimizer step compiled once, lrs as tensors only inside it."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch._dynamo
from helpers import deep
from torch import nn
from torch._dynamo.utils import clear_compilation_metrics, get_compilation_metrics

import loopkit

BACKEND = {"backend": "aot_eager"}  # dynamo's guards and recompiles; no code generation
# The compiled step computes lr-derived factors as tensors (the eager one as Python floats):
# the same update within float rounding, not bit for bit.
RTOL, ATOL = 1e-5, 1e-6


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 2))


def _train(
    make_opt: Callable[[nn.Module], torch.optim.Optimizer],
    compiled: bool,
    *,
    updates: int = 6,
    sched: Callable[[torch.optim.Optimizer], Any] | None = None,
    precision: str = "fp32",
    **kw: Any,
) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    model = _model()
    opt = make_opt(model)
    scheduler = sched(opt) if sched else None
    step = loopkit.step(model, opt, accumulate=2, scheduler=scheduler, precision=precision,
                        compile_optimizer=BACKEND if compiled else False, **kw)  # fmt: skip
    g = torch.Generator().manual_seed(1)
    for _ in range(2 * updates):
        with step as s:
            x, y = torch.randn(4, 6, generator=g), torch.randn(4, 2, generator=g)
            s.backward(nn.functional.mse_loss(model(x), y))
    return model, opt, scheduler


def _step_compiles() -> int:
    """Compilations (first and re-) of the compiled optimizer step's frame."""
    return sum(1 for e in get_compilation_metrics() if e.co_name == "_step")


def _cosine(opt: torch.optim.Optimizer) -> Any:
    return torch.optim.lr_scheduler.CosineAnnealingLR(opt, 10)


OPTIMIZERS = {
    "AdamW": lambda m: torch.optim.AdamW(m.parameters(), lr=0.01, weight_decay=0.1),
    "Adam": lambda m: torch.optim.Adam(m.parameters(), lr=0.01),
    "SGD momentum": lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9),
    "RMSprop": lambda m: torch.optim.RMSprop(m.parameters(), lr=0.01),
    # Dynamo fails on SGD's first momentum step with two groups: the first update is eager.
    "SGD momentum two groups": lambda m: torch.optim.SGD(
        [{"params": m[0].parameters(), "lr": 0.1}, {"params": m[2].parameters()}],
        lr=0.05,
        momentum=0.9,
    ),
    "two groups": lambda m: torch.optim.AdamW(
        [{"params": m[0].parameters(), "lr": 0.02}, {"params": m[2].parameters()}], lr=0.01
    ),
}


@deep
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_updates_match_the_eager_optimizer_and_a_scheduler_never_recompiles(name: str) -> None:
    """Weights and optimizer state within float rounding of the eager step; the lrs the
    scheduler set are the eager run's floats; the step compiles as often over 6 updates as
    over 2, and never for a changed lr (a float lr recompiles it)."""
    make = OPTIMIZERS[name]
    eager, eager_opt, eager_sched = _train(make, False, sched=_cosine)
    torch._dynamo.reset()
    clear_compilation_metrics()
    _train(make, True, updates=2, sched=_cosine)
    after_two = _step_compiles()
    torch._dynamo.reset()
    clear_compilation_metrics()
    model, opt, sched = _train(make, True, updates=6, sched=_cosine)
    assert 1 <= _step_compiles() == after_two
    # None for a changed lr (dynamo's guard on a float lr reads "param_groups[0]['lr'] == x").
    reasons = [e.recompile_reason or "" for e in get_compilation_metrics()]
    assert not [r for r in reasons if "['lr']" in r], reasons
    for p, q in zip(model.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=RTOL, atol=ATOL)
    for a, b in zip(opt.state.values(), eager_opt.state.values(), strict=True):
        for k in a:
            torch.testing.assert_close(a[k], b[k], rtol=RTOL, atol=ATOL)
    lrs = [g["lr"] for g in opt.param_groups]
    assert lrs == [g["lr"] for g in eager_opt.param_groups]
    assert all(type(lr) is float for lr in lrs)  # outside the compiled call: floats
    assert sched.state_dict() == eager_sched.state_dict()


@deep
def test_a_hand_compiled_step_with_a_float_lr_recompiles_where_this_one_does_not() -> None:
    """The reference: torch.compile(optimizer.step) with a scheduler compiles its frames
    more than once; compile_optimizer=True compiles once."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = _cosine(opt)
    torch._dynamo.reset()
    clear_compilation_metrics()
    compiled = torch.compile(opt.step, **BACKEND)
    for _ in range(4):
        model(torch.ones(2, 6)).sum().backward()
        compiled()
        opt.zero_grad()
        sched.step()
    recompiled = [e for e in get_compilation_metrics() if e.recompile_reason]
    assert any("lr" in (e.recompile_reason or "") for e in recompiled)
    torch._dynamo.reset()
    clear_compilation_metrics()
    _train(OPTIMIZERS["AdamW"], True, updates=4, sched=_cosine)
    assert not [e for e in get_compilation_metrics() if e.recompile_reason]


def test_fp16_loss_scaling_steps_through_the_compiled_step() -> None:
    """fp16 with its GradScaler: the compiled step equals the eager one within rounding."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fp16 on a CPU is slow: said once, not tested here
        eager, _, _ = _train(OPTIMIZERS["Adam"], False, precision="fp16", updates=3)
        model, _, _ = _train(OPTIMIZERS["Adam"], True, precision="fp16", updates=3)
    for p, q in zip(model.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=RTOL, atol=ATOL)


def test_no_scheduler_order_warning_and_a_checkpoint_round_trip(tmp_path: Any) -> None:
    """A checkpoint of a compiled-optimizer run holds float lrs; resumed into an eager step
    (and the reverse) it continues as the uninterrupted eager run, within rounding."""

    def build(compiled: bool, where: str = "ref") -> tuple[nn.Module, Any, loopkit.Checkpointer]:
        model = _model()
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        step = loopkit.step(model, opt, scheduler=_cosine(opt),
                            compile_optimizer=BACKEND if compiled else False)  # fmt: skip
        return model, step, loopkit.Checkpointer(tmp_path / where, model=model, step=step)

    def train(step: Any, model: nn.Module, seed: int, n: int) -> None:
        g = torch.Generator().manual_seed(seed)
        for _ in range(n):
            with step as s:
                s.backward(model(torch.randn(3, 6, generator=g)).pow(2).mean())

    ref_model, ref_step, _ = build(False)
    train(ref_step, ref_model, 1, 3)
    train(ref_step, ref_model, 2, 3)
    for first in (True, False):
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message=r".*lr_scheduler\.step\(\)` before")
            model, step, ckpt = build(first, f"saved-compiled-{first}")
            train(step, model, 1, 3)
            ckpt.save()
        saved = torch.load(ckpt.checkpoints()[-1], weights_only=False)
        groups = saved["optimizer"]["param_groups"]
        assert all(type(g["lr"]) is float for g in groups)
        model, step, ckpt = build(not first, f"saved-compiled-{first}")
        assert ckpt.resume() is not None
        train(step, model, 2, 3)
        for p, q in zip(model.parameters(), ref_model.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=RTOL, atol=ATOL)


class _FloatLrAdamW(torch.optim.AdamW):
    """A subclass with a step of its own that reads the lr as a float."""

    def step(self, closure: Any = None) -> Any:
        assert all(isinstance(g["lr"], float) for g in self.param_groups)
        return super().step(closure)


REFUSED = {
    "LBFGS": (lambda m: torch.optim.LBFGS(m.parameters()), None, TypeError, "tensor learning"),
    "subclass with its own step": (lambda m: _FloatLrAdamW(m.parameters()), None, TypeError,
                                   "_FloatLrAdamW's step may need a float lr"),
    "fused": (lambda m: torch.optim.Adam(m.parameters(), fused=True), None, ValueError,
              r"fused=True\) is one fused kernel"),
    "foreach": (lambda m: torch.optim.AdamW(m.parameters(), foreach=True), None, ValueError,
                "capturable=True"),
    "OneCycleLR": (lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
                   lambda o: torch.optim.lr_scheduler.OneCycleLR(o, 1.0, total_steps=10),
                   ValueError, "cycle_momentum=False"),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_what_cannot_work_is_refused_with_why_before_any_change(name: str) -> None:
    """An optimizer needing float lrs, a fused one, Adam's foreach without capturable, and a
    scheduler that cycles momentum: refused at build, the optimizer's groups untouched."""
    make, sched, error, words = REFUSED[name]
    model = _model()
    opt = make(model)
    scheduler = sched(opt) if sched else None
    before = [dict(g) for g in opt.param_groups]
    with pytest.raises(error, match=words):
        loopkit.step(model, opt, scheduler=scheduler, compile_optimizer=True)
    assert [dict(g) for g in opt.param_groups] == before
    loopkit.step(model, opt, scheduler=scheduler)  # the optimizer was not claimed


@pytest.mark.parametrize(
    ("value", "error", "words"),
    [("yes", TypeError, "must be True, False or a dict"),
     ({"mdoe": "max-autotune"}, ValueError, "'mdoe', which is not a keyword of torch.compile")],
)  # fmt: skip
def test_bad_compile_optimizer_values_are_refused(value: Any, error: type, words: str) -> None:
    """A value that is not True/False/a dict of torch.compile's keywords: said, with the fix."""
    model = _model()
    with pytest.raises(error, match=words):
        loopkit.accumulate(model, torch.optim.SGD(model.parameters(), lr=0.1),
                           compile_optimizer=value)  # fmt: skip


@deep
def test_the_ninth_optimizer_of_a_process_is_compiled_too() -> None:
    """Each compiled step has its own cache: ten steps built one after another (a sweep, a
    GAN's members) each compile theirs, none recompiles another's or falls back to eager
    past dynamo's recompile limit (8)."""
    torch._dynamo.reset()
    for _ in range(10):
        clear_compilation_metrics()
        _train(OPTIMIZERS["AdamW"], True, updates=2, sched=_cosine)
        metrics = get_compilation_metrics()
        assert _step_compiles() == 1 and not [e for e in metrics if e.recompile_reason]


# Each update compiled or eager as the uninterrupted run made it: compiled and eager updates
# differ in the last bits (dynamo's eager backend shows it and compiles fastest).
FAST = {"backend": "eager"}
RESUMED = {
    "AdamW two groups": OPTIMIZERS["two groups"],
    "SGD momentum two groups": OPTIMIZERS["SGD momentum two groups"],
    "SGD": lambda m: torch.optim.SGD(m.parameters(), lr=0.05),  # no state at all
    "Adagrad": lambda m: torch.optim.Adagrad(m.parameters(), lr=0.05),  # state from __init__
    # A parameter without a gradient (and so without state) until update 3.
    "AdamW, one parameter used late": lambda m: torch.optim.AdamW(m.parameters(), lr=0.01),
}


def _segment(make: Callable[[nn.Module], torch.optim.Optimizer], start: int, stop: int,
             saved: Any = None) -> tuple[nn.Module, torch.optim.Optimizer, Any]:  # fmt: skip
    """Updates ``start`` to ``stop`` of one run (accumulate=2, a cosine lr), in fresh objects
    that load ``saved`` (a killed run's state, loaded by hand) first."""
    model = _model()
    late = make is RESUMED["AdamW, one parameter used late"]
    if late:
        model.register_parameter("late", nn.Parameter(torch.zeros(2)))
    opt = make(model)
    sched = _cosine(opt)
    if saved is not None:
        model.load_state_dict(saved[0])
        opt.load_state_dict(saved[1])
        sched.load_state_dict(saved[2])
    step = loopkit.step(model, opt, accumulate=2, scheduler=sched, compile_optimizer=FAST)
    g = torch.Generator().manual_seed(1)
    for i in range(2 * stop):
        x, y = torch.randn(4, 6, generator=g), torch.randn(4, 2, generator=g)
        if i >= 2 * start:
            with step as s:
                out = model(x) + (model.late if late and i >= 4 else 0)
                s.backward(nn.functional.mse_loss(out, y))
    return model, opt, copy.deepcopy((model.state_dict(), opt.state_dict(), sched.state_dict()))


@deep
@pytest.mark.parametrize(
    ("name", "kills"),
    [("AdamW two groups", (1, 3)), ("SGD momentum two groups", (1,)), ("SGD", (2,)),
     ("Adagrad", (2,)), ("AdamW, one parameter used late", (1, 3))],
)  # fmt: skip
def test_a_run_resumed_with_its_state_loaded_by_hand_ends_bit_identical(
    name: str, kills: tuple[int, ...]
) -> None:
    """Killed after update 1 (before its first compiled update) or later, each time resumed
    into fresh objects whose state is loaded by hand: every update runs compiled or eager
    as in the uninterrupted run (one that creates a late parameter's state too), so
    weights and optimizer state end bit for bit."""
    make = RESUMED[name]
    ref, ref_opt, _ = _segment(make, 0, 5)
    saved = None
    for start, stop in zip((0, *kills), (*kills, 5), strict=True):
        model, opt, saved = _segment(make, start, stop, saved)
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.equal(p, q), name
    for a, b in zip(opt.state.values(), ref_opt.state.values(), strict=True):
        assert all(torch.equal(torch.as_tensor(a[k]), torch.as_tensor(b[k])) for k in a), name


@deep
def test_a_steps_group_killed_before_its_first_compiled_update_resumes_bit_identical(
    tmp_path: Any,
) -> None:
    """A loopkit.steps group (AdamW under a cosine lr, SGD with momentum), accumulate=2,
    saved by a Checkpointer after every update, killed after update 1 (the eager one) and
    resumed: every member's weights and state end as the uninterrupted run's."""
    from loopkit import distributed

    g = torch.Generator().manual_seed(3)
    data = torch.utils.data.TensorDataset(torch.randn(40, 6, generator=g),
                                          torch.randn(40, 2, generator=g))  # fmt: skip

    def run(where: str, stop: int | None = None) -> list[torch.Tensor]:
        torch.manual_seed(0)
        a, b = _model(), _model()
        opt_a = torch.optim.AdamW(a.parameters(), lr=0.01, weight_decay=0.1)
        opt_b = torch.optim.SGD(b.parameters(), lr=0.05, momentum=0.9)
        group = loopkit.steps(
            loopkit.step(a, opt_a, accumulate=2, scheduler=_cosine(opt_a), compile_optimizer=FAST),
            loopkit.step(b, opt_b, accumulate=2, compile_optimizer=FAST),
        )  # fmt: skip
        loader = distributed.loader(data, batch_size=4, seed=1)
        both = nn.ModuleDict({"a": a, "b": b})
        ckpt = loopkit.Checkpointer(tmp_path / where, model=both, step=group, loader=loader)
        ckpt.resume()
        for _ in ckpt.epochs(1):
            for x, y in group.iterate(loader):
                for model, member in zip((a, b), group.members, strict=True):
                    with member as s:
                        s.backward(nn.functional.mse_loss(model(x), y))
                ckpt.maybe_save(every=1)
                if stop is not None and group.updates == stop:
                    return []
        states = [t for o in (opt_a, opt_b) for st in o.state.values() for t in st.values()]
        return [*a.parameters(), *b.parameters(), *states]

    ref = run("ref")
    run("killed", stop=1)
    got = run("killed")
    assert len(got) == len(ref)
    assert all(torch.equal(p, q) for p, q in zip(got, ref, strict=True))


def _with_new_defaults(base: type[torch.optim.Optimizer], hooked: bool) -> type:
    """A subclass of ``base`` that only sets its own defaults; ``hooked``: as torch leaves it
    when its first instance is built before any of ``base`` (its class's step replaced by
    torch's profiling wrapper of the inherited one)."""

    class Defaults(base):  # type: ignore[misc, valid-type]
        def __init__(self, params: Any, **kwargs: Any) -> None:
            super().__init__(params, **{"lr": 0.02, **kwargs})

    if hooked:
        Defaults.step = torch.optim.Optimizer.profile_hook_step(base.step)  # type: ignore[method-assign]
        Defaults.step.hooked = True  # type: ignore[attr-defined]
    return Defaults


@pytest.mark.parametrize("hooked", [False, True])
def test_a_subclass_with_only_new_defaults_is_compiled_whatever_was_built_first(
    hooked: bool,
) -> None:
    """Subclasses (and a subclass of a subclass) of AdamW and SGD with no step of their own
    are taken, whether or not torch wrapped their class's step for its profiling hooks; one
    that overrides step, at any depth, is refused with the reason."""
    for base in (torch.optim.AdamW, torch.optim.SGD):
        sub = _with_new_defaults(base, hooked)
        for cls in (sub, _with_new_defaults(sub, hooked)):
            model = _model()
            loopkit.step(model, cls(model.parameters()), compile_optimizer=FAST)

    class Deeper(_FloatLrAdamW):  # no step of its own, but its parent overrides AdamW's
        pass

    for cls in (Deeper, _with_new_defaults(Deeper, hooked)):
        model = _model()
        with pytest.raises(TypeError, match=r"may need a float lr \(it runs _FloatLrAdamW\.step"):
            loopkit.step(model, cls(model.parameters()), compile_optimizer=FAST)
