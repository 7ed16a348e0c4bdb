"""distributed.wrap's FSDP2 options checked before anything changes; precision= with an FSDP2
MixedPrecisionPolicy (on a one-process group: FSDP2's machinery, no launcher); an FSDP2
model's shards registered again after a backward-free forward. The options at work on two
ranks: tests/test_distributed.py (dist_worker.py's fsdp2_options and own_fully_shard)."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from helpers import mlp
from torch import nn
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    fully_shard,
)

import loopkit
from loopkit import distributed

BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
FP16 = MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)


def _refused(call: Any, error: type[Exception], text: str, model: nn.Module) -> None:
    before = {k: v.clone() for k, v in model.state_dict().items()}
    kind = type(model)
    with pytest.raises(error, match=text):
        call()
    assert type(model) is kind and all(torch.equal(before[k], v) for k, v in
                                       model.state_dict().items())  # fmt: skip


@pytest.mark.parametrize(
    "option",
    [
        {"mp_policy": BF16},
        {"reshard_after_forward": False},
        {"offload_policy": CPUOffloadPolicy(pin_memory=False)},
    ],
)
def test_fsdp_options_without_fsdp_are_refused(option: dict[str, Any]) -> None:
    """mp_policy=, reshard_after_forward=, offload_policy= without fsdp=: a ValueError naming
    the option and fsdp=, before anything changes (DDP would take or ignore them)."""
    model = mlp()
    name = next(iter(option))
    _refused(lambda: distributed.wrap(model, **option), ValueError,
             f"{name}= is an option of FSDP2.*give fsdp=BlockClass", model)  # fmt: skip


def test_no_fully_shard_keyword_is_none() -> None:
    """torch < 2.8 refuses reshard_after_forward=None: the root gets no such keyword unless
    given (fully_shard's own default: the root keeps its parameters on every torch), each
    block a bool, and a given value reaches the root."""
    from loopkit._parallel._fsdp_options import FsdpOptions

    for given in (None, True, False, 2):
        options = FsdpOptions(reshard_after_forward=given, mp_policy=BF16)
        calls = [options.block(i, 3) for i in range(3)] + [options.root()]
        assert all(v is not None for kw in calls for v in kw.values()), calls
        assert options.root() == ({"mp_policy": BF16} if given is None else
                                  {"mp_policy": BF16, "reshard_after_forward": given})  # fmt: skip


def test_ddp_keywords_with_fsdp_are_refused() -> None:
    """DDP's keywords with fsdp= were silently dropped: now a TypeError naming them and
    FSDP2's options."""
    model = mlp()
    _refused(lambda: distributed.wrap(model, fsdp=True, find_unused_parameters=True), TypeError,
             "find_unused_parameters=: DDP's keyword.*mp_policy=", model)  # fmt: skip


@pytest.mark.parametrize(
    ("option", "error", "text"),
    [
        ({"mp_policy": "bf16"}, TypeError, "MixedPrecisionPolicy, got str"),
        ({"offload_policy": True}, TypeError, "CPUOffloadPolicy .or OffloadPolicy., got bool"),
        ({"offload_policy": CPUOffloadPolicy()}, ValueError,
         r"pin_memory=True.*runs on the CPU.*CPUOffloadPolicy\(pin_memory=False\)"),
        ({"reshard_after_forward": 1}, ValueError, "an int >= 2"),
        ({"reshard_after_forward": "yes"}, ValueError, "True, False, None"),
        ({"mesh": [0, 1]}, TypeError, "DeviceMesh"),
    ],
)  # fmt: skip
def test_bad_fsdp_options_are_refused(option: dict[str, Any], error: type, text: str) -> None:
    """Each wrong FSDP2 option: the exception says what was wrong and the fix, before any
    change (a CPU job cannot pin memory for an offload: pin_memory=False)."""
    model = mlp()
    _refused(lambda: distributed.wrap(model, fsdp=nn.Linear, **option), error, text, model)


def test_single_process_takes_the_options_and_says_mp_policy_does_nothing() -> None:
    """One process: the model comes back as it was, with every option; mp_policy= warns that
    the model computes in its own dtype (the other options only place memory)."""
    model = mlp()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        same = distributed.wrap(model, fsdp=nn.Linear, reshard_after_forward=False,
                                offload_policy=CPUOffloadPolicy(pin_memory=False),
                                mesh=None)  # fmt: skip
        assert same is model and not caught
        assert distributed.wrap(model, fsdp=nn.Linear, mp_policy=BF16) is model
    assert [str(w.message)[:40] for w in caught] == ["wrap(mp_policy=) in a single process: th"]
    assert "precision='bf16'" in str(caught[0].message)
    assert next(model.parameters()).dtype == torch.float32


def test_a_mesh_is_checked(process_group: None) -> None:
    """mesh= with replicate=, or a 3-D mesh: refused naming the fix; a 1-D or 2-D mesh of
    every rank is taken."""
    from torch.distributed.device_mesh import init_device_mesh

    flat = init_device_mesh("cpu", (1,))
    model = mlp()
    _refused(lambda: distributed.wrap(model, fsdp=True, mesh=flat, replicate=1), ValueError,
             "give mesh= or replicate=, not both", model)  # fmt: skip
    cube = init_device_mesh("cpu", (1, 1, 1))
    _refused(lambda: distributed.wrap(model, fsdp=True, mesh=cube), ValueError,
             "1-D .FSDP. or 2-D .HSDP.*got 3-D", model)  # fmt: skip
    for mesh in (flat, init_device_mesh("cpu", (1, 1))):
        assert distributed.wrap(model, fsdp=True, mesh=mesh) is model


def _sharded(policy: MixedPrecisionPolicy | None) -> nn.Module:
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    for block in (model[0], model[2]):
        fully_shard(block, mp_policy=policy or MixedPrecisionPolicy())
    fully_shard(model, mp_policy=policy or MixedPrecisionPolicy())
    return model


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(4, 8, generator=g), torch.randn(4, 2, generator=g)) for _ in range(6)]


def _by_hand(policy: MixedPrecisionPolicy | None, precision: str) -> list[torch.Tensor]:
    """The hand-written FSDP2 loop: accumulate 2, clip 0.05, autocast and GradScaler."""
    torch.manual_seed(0)
    model = _sharded(policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)
    scaler = torch.amp.GradScaler("cpu", enabled=precision == "fp16")
    for i, (x, y) in enumerate(_batches()):
        model.set_requires_gradient_sync(i % 2 == 1)
        with torch.autocast("cpu", dtype=dtype, enabled=precision != "fp32"):
            loss = nn.functional.mse_loss(model(x), y)
        scaler.scale(loss / 2).backward()
        if i % 2:
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    return [p.full_tensor() for p in model.parameters()]


def _loopkit(policy: MixedPrecisionPolicy | None, precision: str) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = _sharded(policy)
    step = loopkit.step(model, torch.optim.AdamW(model.parameters(), lr=1e-2), accumulate=2,
                        clip_grad_norm=0.05, precision=precision)  # fmt: skip
    for x, y in step.iterate(_batches()):
        with step as s:
            s.backward(nn.functional.mse_loss(model(x), y))
    return [p.full_tensor() for p in model.parameters()]


@pytest.mark.parametrize(
    ("policy", "precision"),
    [
        (BF16, "fp32"),
        (BF16, "bf16"),
        (FP16, "fp16"),
        (MixedPrecisionPolicy(param_dtype=torch.bfloat16), "bf16"),
    ],
)
def test_precision_composes_with_a_policy_of_its_dtype(
    process_group: None, policy: MixedPrecisionPolicy, precision: str
) -> None:
    """An mp_policy alone, or with precision= of its dtype (autocast; fp16's GradScaler), and
    a bf16 reduce_dtype: the weights of the hand-written FSDP2 loop, bit for bit."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fp16 autocast on a CPU is slow: said elsewhere
        ours, theirs = _loopkit(policy, precision), _by_hand(policy, precision)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))


@pytest.mark.parametrize(
    ("policy", "precision", "fix"),
    [
        (FP16, "bf16", "precision='fp16' with this policy"),
        (BF16, "fp16", "precision='bf16' with this policy"),
    ],
)
def test_precision_over_a_policy_of_another_dtype_is_refused(
    process_group: None, policy: MixedPrecisionPolicy, precision: str, fix: str
) -> None:
    """precision= autocasting to another dtype than the policy gathers in (weights rounded
    twice): a ValueError naming both and the fix, before the step binds anything."""
    model = _sharded(policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with pytest.raises(ValueError, match=f"precision='{precision}' autocasts.*{fix}"):
        loopkit.step(model, opt, precision=precision)
    loopkit.step(model, opt, precision=fix.split("'")[1])  # nothing was bound


def test_the_policy_is_read_from_this_torchs_fsdp2(process_group: None) -> None:
    """check_precision reads FSDP2's private FSDPState._mp_policy (no public getter): it is
    there on this torch, with the policy given, and read without a warning; a torch that
    renames it would fail here rather than skip the check silently."""
    from loopkit._parallel._fsdp_options import _param_dtypes

    model = _sharded(FP16)
    assert model._get_fsdp_state()._mp_policy is FP16  # type: ignore[operator]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _param_dtypes(model) == {torch.float16}


def test_a_policy_it_cannot_read_warns(
    process_group: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A torch whose FSDP2 state holds no _mp_policy: the step warns that precision= is not
    checked against the policy (instead of passing silently), and is built."""
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    model = _sharded(FP16)
    for m in model.modules():
        if hasattr(m, "_get_fsdp_state"):
            monkeypatch.delattr(m._get_fsdp_state(), "_mp_policy")
    assert not hasattr(FSDPState, "_mp_policy")
    with pytest.warns(UserWarning, match="cannot read the FSDP2 MixedPrecisionPolicy"):
        loopkit.step(model, torch.optim.SGD(model.parameters(), lr=0.1), precision="bf16")


def test_a_float16_policy_without_loss_scaling_warns(process_group: None) -> None:
    """A float16 policy and no precision='fp16': a warning that nothing scales the loss."""
    model = _sharded(FP16)
    with pytest.warns(UserWarning, match="nothing scales the loss.*precision='fp16'"):
        loopkit.accumulate(model, torch.optim.SGD(model.parameters(), lr=0.1))


def test_shards_are_registered_again_after_evaluate(process_group: None) -> None:
    """A root that keeps its parameters after its forward (FSDP2's default, wrap(fsdp=True)):
    after evaluate the model holds its shards again, and the ema swaps its average in."""
    from torch.distributed.tensor import DTensor

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    fully_shard(model)
    average = loopkit.ema(model, decay=0.5)
    step = loopkit.step(model, torch.optim.SGD(model.parameters(), lr=0.1), ema=average)
    for x, y in step.iterate(_batches()):
        with step as s:
            s.backward(nn.functional.mse_loss(model(x), y))

    def loss(m: nn.Module, b: Any) -> dict[str, torch.Tensor]:
        return {"loss": nn.functional.mse_loss(m(b[0]), b[1]).reshape(1)}

    trained = loopkit.evaluate(model, _batches(), loss)
    assert all(isinstance(p, DTensor) for p in model.parameters())
    with average.swapped():
        averaged = loopkit.evaluate(model, _batches(), loss)
    with torch.no_grad():
        model(_batches()[0][0])  # a forward of the user's own, no backward
    with average.swapped():
        again = loopkit.evaluate(model, _batches(), loss)
    assert averaged.sums == again.sums != trained.sums


def test_evaluate_as_the_first_forward_leaves_training_possible(process_group: None) -> None:
    """evaluate as an FSDP2 model's first forward (right after a resume): the buffers FSDP2
    gathers parameters into, made then and kept, still serve the training forward after it
    (made under inference_mode they refused every later forward)."""
    torch.manual_seed(0)
    model = _sharded(None)
    step = loopkit.step(model, torch.optim.SGD(model.parameters(), lr=0.1))

    def loss(m: nn.Module, b: Any) -> dict[str, torch.Tensor]:
        return {"loss": nn.functional.mse_loss(m(b[0]), b[1]).reshape(1)}

    before = loopkit.evaluate(model, _batches(), loss)
    for x, y in step.iterate(_batches()):
        with step as s:
            s.backward(nn.functional.mse_loss(model(x), y))
    assert step.updates == 6 and loopkit.evaluate(model, _batches(), loss).sums != before.sums
