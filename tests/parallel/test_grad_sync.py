"""no_sync: counted all-reduces on a real DDP model, no-op on plain and compiled modules."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from helpers import batches, counted_ddp, loss_fn, mlp, params, twin

import loopkit


def test_plain_module_is_a_no_op() -> None:
    """On a plain module no_sync changes nothing: same gradients as without it."""
    model = mlp()
    ref = twin(model)
    batch = batches([4])[0]
    with loopkit.no_sync(model):
        loss_fn(model, batch).backward()
    loss_fn(ref, batch).backward()
    for a, b in zip(model.parameters(), ref.parameters(), strict=True):
        assert a.grad is not None and b.grad is not None and torch.equal(a.grad, b.grad)


def test_unwraps_torch_compile() -> None:
    """A torch.compile wrapper is seen through to the module inside."""
    model = mlp()
    compiled = torch.compile(model)
    assert loopkit.no_sync(compiled).model is model


def test_ddp_forward_and_backward_inside_skip_the_all_reduce(process_group: None) -> None:
    """Forward and backward inside no_sync: zero all-reduces; the next synced step: one."""
    ddp, calls = counted_ddp(mlp())
    data = batches([4, 4])
    with loopkit.no_sync(ddp):
        loss_fn(ddp, data[0]).backward()
    assert calls == []
    loss_fn(ddp, data[1]).backward()
    assert calls == [0]


def test_ddp_forward_outside_still_synchronizes(process_group: None) -> None:
    """The documented rule: a forward outside no_sync makes its backward all-reduce anyway."""
    ddp, calls = counted_ddp(mlp())
    loss = loss_fn(ddp, batches([4])[0])
    with loopkit.no_sync(ddp):
        loss.backward()
    assert calls == [0]


def test_ddp_restores_the_previous_setting(process_group: None) -> None:
    """Leaving no_sync restores require_backward_grad_sync as it was, not blindly True."""
    ddp, _ = counted_ddp(mlp())
    ddp.require_backward_grad_sync = False
    with loopkit.no_sync(ddp):
        assert ddp.require_backward_grad_sync is False
    assert ddp.require_backward_grad_sync is False
    ddp.require_backward_grad_sync = True
    with pytest.raises(KeyError), loopkit.no_sync(ddp):
        raise KeyError("boom")
    assert ddp.require_backward_grad_sync is True
    with loopkit.no_sync(ddp, enabled=False):
        assert ddp.require_backward_grad_sync is True


def test_accumulate_makes_one_all_reduce_per_update(process_group: None) -> None:
    """accumulate(every=4) over 8 micro-batches: 2 all-reduces, not 8; same parameters."""
    model = mlp()
    plain = twin(model)
    ddp, calls = counted_ddp(model)
    data = batches([4] * 8)
    acc = loopkit.accumulate(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), every=4)
    for batch in data:
        with acc:
            acc.backward(loss_fn(ddp, batch))
    assert len(calls) == 2 and acc.updates == 2
    ref = loopkit.accumulate(plain, torch.optim.SGD(plain.parameters(), lr=0.1), every=4)
    for batch in data:
        with ref:
            ref.backward(loss_fn(plain, batch))
    for a, b in zip(params(ddp.module), params(plain), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_ragged_flush_under_ddp_reduces_by_hand(process_group: None) -> None:
    """A window closed by flush() after a no_sync micro-step still gets one all-reduce."""
    ddp, calls = counted_ddp(mlp())
    acc = loopkit.accumulate(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1), every=4)
    sent: list[int] = []
    real_all_reduce = dist.all_reduce

    def counting_all_reduce(*args: Any, **kwargs: Any) -> Any:
        sent.append(1)
        return real_all_reduce(*args, **kwargs)

    for batch in batches([4] * 2):
        with acc:
            acc.backward(loss_fn(ddp, batch))
    assert calls == []
    dist.all_reduce = counting_all_reduce  # type: ignore[assignment]
    try:
        assert acc.flush() is True
    finally:
        dist.all_reduce = real_all_reduce
    # The gradients go through the model's own comm hook (its one bucket, once); one more
    # all-reduce carries the float64 bookkeeping (presence counts, window sizes).
    assert calls == [0] and sent == [1, 1]


def test_fsdp2_restores_the_previous_setting(process_group: None) -> None:
    """FSDP2: set_requires_gradient_sync(False) inside, the previous value restored after."""
    from torch.distributed.fsdp import fully_shard

    model = mlp()
    try:
        fully_shard(model)
    except Exception as err:  # pragma: no cover - depends on the torch build
        pytest.skip(f"FSDP2 does not run on this CPU/gloo build: {err}")
    groups = model._get_fsdp_state()._fsdp_param_groups  # type: ignore[operator]

    def flags() -> list[bool]:
        return [g.reduce_grads for g in groups]

    with loopkit.no_sync(model):
        assert flags() == [False]
    assert flags() == [True]
    model.set_requires_gradient_sync(False)  # type: ignore[operator]
    with loopkit.no_sync(model):
        assert flags() == [False]
    assert flags() == [False]  # not blindly True


@pytest.mark.parametrize("hook", ["none", "python", "builtin ALLREDUCE", "builtin FP16_COMPRESS"])
def test_the_by_hand_path_divides_first_exactly_when_ddp_does(
    process_group: None, hook: str
) -> None:
    """DDP divides a bucket before reducing it only without a comm hook; a built-in C++ hook,
    which leaves no Python trace in _comm_hooks, averages by itself as a Python one does."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    from loopkit._parallel._grad_sync import divides_first

    ddp: Any = torch.nn.parallel.DistributedDataParallel(mlp())
    if hook == "python":
        ddp.register_comm_hook(None, allreduce_hook)
    elif hook.startswith("builtin"):
        ddp._register_builtin_comm_hook(getattr(dist.BuiltinCommHookType, hook.split()[1]))
    assert divides_first(ddp) is (hook == "none")
