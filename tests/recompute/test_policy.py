"""The checkpoint policies: presets, functions and op lists to checkpoint()'s context_fn."""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy

from loopkit._recompute._policy import RecomputeConfig, context_fn, save_matmuls

aten = torch.ops.aten


def test_full_needs_no_context_and_the_others_get_one() -> None:
    assert context_fn("full") is None
    for policy in ("save_matmuls", lambda *a, **k: True, [aten.mm.default]):
        made = context_fn(policy)
        assert made is not None
        assert len(made()) == 2  # the forward's and the recompute's modes


@pytest.mark.parametrize(
    ("op", "kept"),
    [
        (aten.mm.default, True),
        (aten.addmm.default, True),
        (aten.convolution.default, True),
        (aten.add.Tensor, False),
        (aten.gelu.default, False),
    ],
)
def test_save_matmuls_keeps_matmul_like_outputs_only(op: object, kept: bool) -> None:
    want = CheckpointPolicy.MUST_SAVE if kept else CheckpointPolicy.PREFER_RECOMPUTE
    assert save_matmuls(None, op) is want


@pytest.mark.parametrize(
    ("policy", "exc", "hint"),
    [
        ("some", ValueError, "'save_matmuls'"),
        ([], ValueError, "torch ops"),
        ([1, 2], ValueError, "torch ops"),
        (3, TypeError, "preset name"),
    ],
)
def test_bad_policies_are_refused(policy: object, exc: type[Exception], hint: str) -> None:
    with pytest.raises(exc, match=hint):
        context_fn(policy)  # type: ignore[arg-type]  # deliberately wrong types


def test_configs_compare_by_policy_and_rng_flag() -> None:
    config = RecomputeConfig("full", True)
    assert config.same_as(RecomputeConfig("full", True))
    assert not config.same_as(RecomputeConfig("save_matmuls", True))
    assert not config.same_as(RecomputeConfig("full", False))
