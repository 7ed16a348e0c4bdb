"""Small models, data and reference loops shared by the tests."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

import torch
from torch import nn

Batch = tuple[torch.Tensor, torch.Tensor]


def mlp(seed: int = 0, width: int = 32) -> nn.Module:
    """A small MLP with no batch-dependent layers (so large-batch equivalence is exact)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, width), nn.GELU(), nn.Linear(width, 1))


def batches(sizes: Sequence[int], seed: int = 1) -> list[Batch]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, 8, generator=g), torch.randn(n, 1, generator=g)) for n in sizes]


def loss_fn(model: nn.Module, batch: Batch) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


def params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def twin(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model)


def large_batch_reference(
    model: nn.Module,
    make_opt: Callable[[nn.Module], torch.optim.Optimizer],
    windows: Sequence[Sequence[Batch]],
    clip: float | None = None,
) -> tuple[list[torch.Tensor], list[float]]:
    """One optimizer step per window on the concatenation of its micro-batches."""
    opt = make_opt(model)
    norms: list[float] = []
    for window in windows:
        x = torch.cat([b[0] for b in window])
        y = torch.cat([b[1] for b in window])
        loss_fn(model, (x, y)).backward()
        if clip is not None:
            norms.append(float(nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return params(model), norms


def split(items: Sequence[Batch], every: int) -> list[list[Batch]]:
    return [list(items[i : i + every]) for i in range(0, len(items), every)]


def assert_close(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor], atol: float = 1e-6) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=atol)


def assert_bit_equal(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y), (x - y).abs().max()


def launch_env() -> dict[str, str]:
    """This process's environment without launcher variables, one thread per process."""
    import os

    launcher = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in launcher}
    env["OMP_NUM_THREADS"] = "1"
    return env


def counted_ddp(model: nn.Module) -> tuple[nn.parallel.DistributedDataParallel, list[int]]:
    """Wrap in DDP with the default all-reduce as a comm hook that records each bucket."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    ddp = nn.parallel.DistributedDataParallel(model)
    calls: list[int] = []

    # No annotations: DDP compares them with dist.GradBucket, and here they would be strings.
    def hook(state, bucket):  # type: ignore[no-untyped-def]
        calls.append(bucket.index())
        return allreduce_hook(state, bucket)

    ddp.register_comm_hook(None, hook)
    return ddp, calls
