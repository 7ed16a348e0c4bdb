"""track_memory: exact live and peak bytes of what is created inside the block."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

import loopkit


def test_counts_new_storages_until_they_are_freed() -> None:
    """A 4 KiB tensor is 4096 live bytes until deleted; the peak remembers it."""
    with loopkit.track_memory() as mem:
        a = torch.zeros(1024)  # float32: 4096 bytes
        assert mem.live == 4096
        b = torch.ones(256, dtype=torch.float64)  # 2048 bytes
        assert mem.live == 4096 + 2048
        del a
        assert mem.live == 2048
    assert mem.peak == 4096 + 2048
    del b
    assert mem.live == 0  # frees after the block are still seen


def test_views_in_place_ops_and_existing_tensors_are_not_allocations() -> None:
    """Views, in-place updates and views of tensors made outside add nothing."""
    outside = torch.randn(512)
    with loopkit.track_memory() as mem:
        v = outside.view(16, 32).t()
        outside.mul_(2)
        d = outside.detach()
        assert mem.live == 0
        c = outside * 2  # a real new tensor
        assert mem.live == 512 * 4
    assert v.shape == (32, 16) and d.shape == (512,) and c.shape == (512,)


def test_graph_keeps_saved_tensors_alive() -> None:
    """Tensors saved for backward stay counted until backward frees the graph."""
    w = torch.randn(64, 64, requires_grad=True)
    with loopkit.track_memory() as mem:
        h = (w @ w).relu()  # relu saves its output
        loss = h.sum()
        del h
        kept = mem.live
        loss.backward()
        del loss
        after = mem.live
    assert kept >= 64 * 64 * 4
    assert after == 64 * 64 * 4  # only w.grad remains
    mem.reset_peak()
    assert mem.peak == mem.live


def test_entered_twice_is_refused() -> None:
    """A second entry of one track_memory raises and leaves it tracking as before."""
    with loopkit.track_memory() as mem:
        with pytest.raises(RuntimeError, match="already tracking"):
            mem.__enter__()
        a = torch.zeros(256)
        assert mem.live == 1024
    assert not is_in_torch_dispatch_mode()
    del a
