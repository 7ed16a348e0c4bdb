"""count_host_syncs: sees every kind of host read, and nothing else."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import loopkit

_x = torch.randn(4)
_s = torch.tensor(1.5)


@pytest.mark.parametrize(
    "read",
    [
        lambda: _s.item(),
        lambda: _x.tolist(),
        lambda: _x.numpy(),
        lambda: float(_s),
        lambda: int(_s),
        lambda: bool(_s > 0),
        lambda: f"{_s:.2f}",
        lambda: _x.nonzero(),
        lambda: torch.equal(_x, _x),
        lambda: [1, 2, 3][torch.tensor(1)],
    ],
)
def test_each_kind_of_read_counts_once(read: Callable[[], object]) -> None:
    """Every way of reading tensor data on the host is one sync, never two."""
    with loopkit.count_host_syncs() as syncs:
        read()
    assert syncs.count == 1, syncs.events


def test_device_side_work_counts_nothing() -> None:
    """Arithmetic, reductions, casts and detaching stay on the device: zero syncs."""
    w = torch.randn(4, 4, requires_grad=True)
    with loopkit.count_host_syncs() as syncs:
        y = (w @ w).relu().sum()
        y.backward()
        _ = y.detach().float().to(torch.bfloat16)
        torch.stack([y.detach(), y.detach()]).mean()
    assert syncs.count == 0, syncs.events


def test_ignored_tensors_are_not_counted() -> None:
    """Reads of tensors passed in ignore= (host-resident by design) do not count."""
    kept, other = torch.tensor(1.0), torch.tensor(2.0)
    with loopkit.count_host_syncs(ignore=frozenset({id(kept)})) as syncs:
        kept.item()
        other.item()
    assert syncs.events == {"Tensor.item": 1}
