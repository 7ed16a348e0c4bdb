"""loopkit.ema across ranks: DDP with no extra collective and identical averages, FSDP2 with
a per-shard average (uneven shards), both under torchrun (the scenarios of dist_worker.py)."""

from __future__ import annotations

from typing import Any

import pytest


def test_ddp_averages_are_bit_identical_with_no_extra_collective(dist_results: Any) -> None:
    """Counted torch.distributed calls: the loop with ema= makes exactly those without it."""
    for r in dist_results["ema_ddp"]:
        assert r["updates"] == 3
        assert r["with"] == r["without"] and r["same"]


def test_fsdp2_averages_each_shard_and_gathers_to_the_unsharded_reference(
    dist_results: Any,
) -> None:
    """Uneven shards (8 + 7 rows, 1 + 0): no extra collective per update, the gathered
    averages within 1e-6 of one process's, swapped() puts them in and takes them out bit for
    bit, ema.export() gathers that averaged model whole on every rank, and a
    torch.distributed.checkpoint round trip of the shards is exact."""
    ranks = dist_results["ema_fsdp2"]
    if ranks[0]["skipped"]:
        pytest.skip(ranks[0]["skipped"])
    assert [r["shard_rows"] for r in ranks] == [[8, 8, 1, 1], [7, 7, 0, 0]]
    for r in ranks:
        assert r["updates"] == 3 and r["extra_collectives"] == 0
        assert r["max_diff"] < 1e-6 and r["swapped_in"] < 1e-6 and r["restored"]
        assert r["dcp_equal"] and r["export_equal"]  # ema.export(): whole, as swapped in
