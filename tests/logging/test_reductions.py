"""detach_logging's reductions and cross-rank row layout, as pure functions: no process group.

Two ranks are simulated by building each one's row and merging the rows, as every rank
does with the rows an all-gather hands it.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from helpers import AtenOps

import loopkit
from loopkit._logging._exchange import (
    CAPACITY,
    fingerprint,
    first_row,
    merge_first_rows,
    merge_rows,
    row,
    union,
)
from loopkit._logging._reductions import (
    Value,
    fsum,
    known_one_dtype,
    merge,
    partial_floats,
    partials,
    reduce_local,
    stacked,
)

CPU = torch.device("cpu")


def _how(table: dict[str, str]) -> Callable[[str], str]:
    return lambda name: table.get(name, "mean")


def _gathered(ranks: list[dict[str, list[Value]]], how: dict[str, str]) -> list[list[float]]:
    """The rows of the first gather, as every rank would read them."""
    return [
        first_row(sorted((n, how.get(n, "mean")) for n in v), partials(v, _how(how)), CPU).tolist()
        for v in ranks
    ]


@pytest.mark.parametrize(
    ("how", "logged", "expected"),
    [
        ("mean", [(2, 3.0), (1, 4.0)], 7 / 3),  # a mean travels as (count, sum)
        ("sum", [(2, 3.0), (1, 4.0)], 7.0),
        ("max", [(2, 3.0), (1, 4.0)], 4.0),
        ("min", [(2, 3.0), (1, 4.0)], 3.0),
        ("last", [(5, 1.0), (1, 3.0)], 2.0),  # the mean of each rank's last value
    ],
)
def test_merge_combines_count_and_statistic_pairs(
    how: str, logged: list[tuple[float, float]], expected: float
) -> None:
    """Each reduction merges the ranks' (count, statistic) pairs as documented."""
    assert merge(how, logged) == pytest.approx(expected)


@pytest.mark.parametrize("how", ["max", "min"])
@pytest.mark.parametrize("where", [0, 1, 2])
def test_max_and_min_return_nan_wherever_it_is(how: str, where: int) -> None:
    """Python's max/min depend on where a NaN is; these give NaN from any position."""
    vals = [1.0, 2.0, 3.0]
    vals[where] = math.nan
    assert math.isnan(partial_floats(vals, how))
    assert math.isnan(merge(how, [(1, v) for v in vals]))


def test_fsum_is_exact_and_follows_ieee_at_the_edges() -> None:
    """Exactly rounded for finite values; inf - inf is NaN and overflow is inf, as in torch."""
    assert fsum([1e16, 1.0, -1e16]) == 1.0
    assert math.isnan(fsum([math.inf, -math.inf]))
    assert fsum([1e308, 1e308]) == math.inf


def test_stacked_widens_each_value_before_stacking() -> None:
    """int64 and float32 values of one metric are widened alone, not rounded to float32."""
    t = stacked([torch.tensor(16_777_217), torch.tensor(1.0)])
    assert t.dtype == torch.float64 and t.tolist() == [16_777_217.0, 1.0]


def test_local_reduction_keeps_first_seen_order_and_matches_by_hand() -> None:
    """Tensors and Python numbers reduce alike; the result keeps the recording order."""
    values: dict[str, list[Value]] = {
        "z": [torch.tensor(1.0), torch.tensor(4.0)],
        "a": [2.0, 6.0],
    }
    out = reduce_local(values, _how({"a": "max"}))
    assert list(out) == ["z", "a"] and out == {"z": 2.5, "a": 6.0}


def test_fingerprint_is_exact_in_a_float64_and_tells_reductions_apart() -> None:
    """48 bits, the same on every call, different when a reduction differs."""
    mine = [("loss", "mean")]
    assert fingerprint(mine) == fingerprint(list(mine)) < 2**48
    assert fingerprint(mine) != fingerprint([("loss", "max")])


def test_row_places_counts_then_statistics_by_slot() -> None:
    """prefix, counts, statistics; a metric this rank did not log keeps count 0."""
    stats: dict[str, tuple[int, Value]] = {"b": (3, torch.tensor(6.0)), "c": (1, 2.5)}
    got = row([7.0], stats, ["a", "b", "c"], 4, CPU).tolist()
    assert got == [7.0, 0.0, 3.0, 1.0, 0.0, 0.0, 6.0, 2.5, 0.0]


def test_two_ranks_with_the_same_metrics_merge_in_one_gather() -> None:
    """Equal fingerprints: the first gather is the whole exchange, and it equals one rank's
    reduction over every value of both ranks."""
    how = {"s": "sum", "mx": "max", "mn": "min"}
    ranks: list[dict[str, list[Value]]] = [
        {
            "m": [torch.tensor(1.0), torch.tensor(2.0)],
            "s": [1.0, 2.0],
            "mx": [torch.tensor(3.0)],
            "mn": [torch.tensor(5.0)],
        },
        {
            "mn": [torch.tensor(-1.0)],
            "mx": [torch.tensor(9.0)],
            "s": [4.0],
            "m": [torch.tensor(6.0)],
        },
    ]
    rows = _gathered(ranks, how)
    mine = sorted((n, how.get(n, "mean")) for n in ranks[0])
    merged = merge_first_rows(list(ranks[0]), mine, rows)
    assert merged == {"m": 3.0, "s": 7.0, "mx": 9.0, "mn": -1.0}
    assert list(merged) == ["m", "s", "mx", "mn"]  # this rank's first-seen order


def test_ranks_with_different_metrics_gather_again_over_the_union() -> None:
    """A metric logged on one rank only is reduced over that rank; names follow this rank's."""
    ranks: list[dict[str, list[Value]]] = [
        {"loss": [torch.tensor(1.0), torch.tensor(3.0)]},
        {"loss": [torch.tensor(5.0)], "acc": [0.5, 1.0]},
    ]
    rows = _gathered(ranks, {})
    assert merge_first_rows(["loss"], [("loss", "mean")], rows) is None
    layout = union([sorted((n, "mean") for n in v) for v in ranks])
    assert layout == [("acc", "mean"), ("loss", "mean")]
    order = [n for n, _ in layout]
    rows = [row([], partials(v, _how({})), order, len(order), CPU).tolist() for v in ranks]
    merged = merge_rows(["loss"], layout, rows, start=0, slots=len(order))
    assert merged == {"loss": 3.0, "acc": 0.75} and list(merged) == ["loss", "acc"]


def test_more_metrics_than_fit_take_the_union_path() -> None:
    """Past CAPACITY metrics the first row carries no slots, and the merge asks for more."""
    many: dict[str, list[Value]] = {f"m{i:02d}": [float(i)] for i in range(CAPACITY + 1)}
    rows = _gathered([many, many], {})
    assert merge_first_rows(list(many), sorted((n, "mean") for n in many), rows) is None


def test_a_metric_reduced_two_ways_is_refused_naming_the_rank() -> None:
    """Two ranks that reduce one metric differently cannot be merged: say which and how."""
    with pytest.raises(RuntimeError, match=r"'acc' is reduced with 'max' .* 'mean' on rank 1"):
        union([[("acc", "max")], [("acc", "mean")]])


def test_a_local_flush_sums_exactly_where_a_float64_sum_rounds() -> None:
    """Values are read to the host and summed exactly rounded: float64 values that cancel and
    int64 counters past 2**53 come out as the exact sum (a float64 sum on the device rounds
    both)."""
    cancel = [torch.tensor(v, dtype=torch.float64) for v in (1e16, 1.0, -1e16, 1.0)]
    counts = [torch.tensor(2**53), *[torch.tensor(1)] * 8]
    values: dict[str, list[Value]] = {"x": list(cancel), "n": list(counts)}
    out = reduce_local(values, _how({"n": "sum"}))
    assert out == {"x": 0.5, "n": float(2**53 + 8)}
    assert out["n"] == math.fsum([2**53, *[1] * 8])


def test_a_local_flush_is_one_stack_and_one_read_per_device() -> None:
    """However many metrics share a device and dtype, the flush stacks their values once and
    reads them in one transfer (no per-metric reduction on the device)."""
    values: dict[str, list[Value]] = {
        "loss": [torch.tensor(float(i)) for i in range(5)],
        "acc": [torch.tensor(1.0)] * 3,
        "lr": [0.1, 0.2],
    }
    with AtenOps() as seen, loopkit.count_host_syncs() as syncs:
        out = reduce_local(values, _how({"acc": "max", "lr": "last"}))
    assert seen.ops == ["stack"] and syncs.count == 1, (seen.ops, syncs.events)
    assert out == {"loss": 2.0, "acc": 1.0, "lr": 0.2}


@pytest.mark.parametrize("how", ["mean", "sum", "max", "min", "last"])
def test_mixed_dtypes_on_one_device_reduce_as_their_float64_values(how: str) -> None:
    """int64, bool, bf16 and float64 metrics (and a metric switching dtype) read in one
    transfer give what their float64 values reduce to: no promotion to a common dtype."""
    values: dict[str, list[Value]] = {
        "n": [torch.tensor(16_777_217), torch.tensor(3)],
        "hit": [torch.tensor(True), torch.tensor(False)],
        "q": [torch.tensor(0.5, dtype=torch.bfloat16), torch.tensor(0.25, dtype=torch.float64)],
    }
    out = reduce_local(values, _how(dict.fromkeys(values, how)))
    for name, vals in values.items():
        floats = [float(v) for v in vals]
        expected = {
            "mean": math.fsum(floats) / len(floats), "sum": math.fsum(floats),
            "max": max(floats), "min": min(floats), "last": floats[-1],
        }[how]  # fmt: skip
        assert out[name] == expected and type(out[name]) is float, (name, out)


def test_a_flush_of_several_dtypes_costs_two_ops_per_dtype_not_one_per_value() -> None:
    """A float32 loss beside an int64 count and a bf16 accuracy: each dtype's values are
    stacked and widened once, joined, and read once (a kernel launch per value would cost a
    GPU flush far more than it saves), and the values come back in their metrics' order."""
    n = 100
    values: dict[str, list[Value]] = {
        "loss": [torch.tensor(i / 8) for i in range(n)],
        "tokens": [torch.tensor(2**40 + i) for i in range(n)],
        "acc": [torch.tensor(i % 2 / 2, dtype=torch.bfloat16) for i in range(n)],
        "last": [torch.tensor(float(i), dtype=torch.float64) for i in range(n)],
    }
    how = _how({"tokens": "sum", "acc": "max", "last": "last"})
    with AtenOps() as seen, loopkit.count_host_syncs() as syncs:
        out = reduce_local(values, how)
    assert len(seen.ops) <= 2 * 4 + 1 and syncs.count == 1, (seen.ops, syncs.events)
    assert out == {
        "loss": math.fsum(i / 8 for i in range(n)) / n,
        "tokens": float(n * 2**40 + n * (n - 1) // 2),
        "acc": 0.5,
        "last": float(n - 1),
    }


def test_one_dtype_is_known_from_the_kinds_and_what_the_checked_path_added() -> None:
    """A kept value has its metric's kind's dtype or one the checked path added: one dtype
    among them is known without reading a value; a metric with no kind yet, or a resumed
    interval (None), is not known."""
    f32 = (torch.float32, CPU, True)
    i64 = (torch.int64, CPU, True)
    number = (None, None, None)
    assert known_one_dtype(set(), {"loss": f32, "lr": number}, ["loss", "lr"])
    assert known_one_dtype({torch.float32}, {"loss": f32}, ["loss"])
    assert not known_one_dtype({torch.int64}, {"loss": f32}, ["loss"])  # a kind replaced
    assert not known_one_dtype(set(), {"loss": f32, "n": i64}, ["loss", "n"])
    assert known_one_dtype(set(), {"loss": f32, "n": i64}, ["loss"])  # n kept nothing
    assert not known_one_dtype(set(), {"loss": f32}, ["loss", "new"])
    assert not known_one_dtype(None, {"loss": f32}, ["loss"])
