"""Block selection: outermost matches only, every k-th counted from 1, the path above each."""

from __future__ import annotations

import pytest
from torch import nn

from loopkit._blocks import select_blocks, select_blocks_with_paths


class Layer(nn.Module):
    """A block that holds another block: only the outer one is selected."""

    def __init__(self, inner: bool = False) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 2)
        self.inner = Layer() if inner else None


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(2, 2), nn.Sequential(*[Layer(inner=True) for _ in range(5)]))


def test_outermost_matches_in_order() -> None:
    model = _model()
    assert select_blocks(model, Layer) == list(model[1])


@pytest.mark.parametrize(("every", "picked"), [(1, [0, 1, 2, 3, 4]), (2, [1, 3]), (5, [4])])
def test_every_is_a_stride_counted_from_one(every: int, picked: list[int]) -> None:
    model = _model()
    assert select_blocks(model, Layer, every) == [model[1][i] for i in picked]


def test_paths_start_at_the_model() -> None:
    model = _model()
    (block, above), *_ = select_blocks_with_paths(model, Layer)
    assert block is model[1][0] and above == (model, model[1])


def test_tuple_and_predicate_select_like_a_class() -> None:
    model = _model()
    by_class = select_blocks(model, Layer)
    assert select_blocks(model, (Layer, nn.Conv2d)) == by_class
    assert select_blocks(model, lambda m: isinstance(m, Layer)) == by_class


@pytest.mark.parametrize(
    ("blocks", "exc", "hint"),
    [
        (nn.Conv2d, ValueError, "matches no submodule"),
        ((), TypeError, "predicate"),
        ((Layer, int), TypeError, "predicate"),
        ("Layer", TypeError, "predicate"),
    ],
)
def test_bad_selection_is_refused(blocks: object, exc: type[Exception], hint: str) -> None:
    with pytest.raises(exc, match=hint):
        select_blocks(_model(), blocks)  # type: ignore[arg-type]  # deliberately wrong types
