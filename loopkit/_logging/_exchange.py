"""detach_logging's cross-rank flush: every rank's statistics in one all-gather.

Each rank sends a fixed-size row: a fingerprint of its sorted (name, reduction) pairs, its
number of metrics, then ``CAPACITY`` counts and ``CAPACITY`` statistics, slot ``i`` for its
``i``-th metric in sorted-name order. When every row has the same fingerprint and the
metrics fit, that one gather is the whole exchange. Otherwise (metrics logged on some ranks
only, or more than fit) the ranks swap their (name, reduction) lists and gather again over
the union. Every rank decides from the same gathered rows, so all take the same branch.
Only ``reduce_across_ranks`` talks to other ranks; the rest is layout and merge.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

from .. import _ranks
from ._reductions import HowOf, Value, Values, merge, partials

# Metrics that fit the one fixed-size gather of a cross-rank flush; more take the slower,
# name-exchanging path (still correct).
CAPACITY = 32
# The first row's prefix: the fingerprint and the number of metrics.
_PREFIX = 2

Layout = list[tuple[str, str]]
"""(name, reduction) pairs in slot order."""


def reduce_across_ranks(values: Values, how: HowOf) -> dict[str, float]:
    """Every rank's partial statistics in one all-gather, then one read to the host."""
    device = _ranks.comm_device()
    stats = partials(values, how)
    mine = sorted((name, how(name)) for name in values)
    # Host-device sync: the one read per flush.
    rows = _ranks.gather_rows(first_row(mine, stats, device)).tolist()
    merged = merge_first_rows(list(values), mine, rows)
    if merged is not None:
        return merged
    # Different metrics on different ranks: agree on the union, then gather over it.
    layout = union(_ranks.gather_objects(mine))
    local = row([], stats, [name for name, _ in layout], len(layout), device)
    # Host-device sync: the second read of a flush whose ranks logged different metrics.
    rows = _ranks.gather_rows(local).tolist()
    return merge_rows(list(values), layout, rows, start=0, slots=len(layout))


def first_row(
    mine: Layout, stats: dict[str, tuple[int, Value]], device: torch.device
) -> torch.Tensor:
    """This rank's row of the first gather (its slots empty when its metrics do not fit)."""
    order = [name for name, _ in mine] if len(mine) <= CAPACITY else []
    return row([fingerprint(mine), float(len(mine))], stats, order, CAPACITY, device)


def merge_first_rows(
    names: list[str], mine: Layout, rows: Sequence[Sequence[float]]
) -> dict[str, float] | None:
    """The merged metrics of the first gather; None when the ranks must gather again."""
    head = rows[0][:_PREFIX]
    if head[1] > CAPACITY or any(r[:_PREFIX] != head for r in rows):
        return None
    return merge_rows(names, mine, rows, start=_PREFIX, slots=CAPACITY)


def merge_rows(
    names: list[str], layout: Layout, rows: Sequence[Sequence[float]], start: int, slots: int
) -> dict[str, float]:
    """Merge the ranks' rows: this rank's metrics in its first-seen order, then the others'."""
    out: dict[str, float] = {}
    for i, (name, how) in enumerate(layout):
        # (count, statistic) of each rank that logged it: a count of 0 means it did not.
        logged = [(r[start + i], r[start + slots + i]) for r in rows if r[start + i] > 0]
        out[name] = merge(how, logged)
    return {**{name: out[name] for name in names}, **out}


def union(everyone: list[Layout]) -> Layout:
    """The sorted union of the ranks' layouts; a metric reduced two ways is an error."""
    found: dict[str, str] = {}
    for rank, pairs in enumerate(everyone):
        for name, how in pairs:
            if found.setdefault(name, how) != how:
                raise RuntimeError(
                    f"metric {name!r} is reduced with {found[name]!r} on one rank and "
                    f"{how!r} on rank {rank}: build detach_logging with the same reduce= "
                    "on every rank"
                )
    return sorted(found.items())


def fingerprint(pairs: Layout) -> float:
    """48 bits of a hash of the sorted (name, reduction) pairs: exact in a float64."""
    digest = hashlib.blake2b(repr(pairs).encode(), digest_size=6).digest()
    return float(int.from_bytes(digest, "big"))


def row(
    prefix: list[float],
    stats: dict[str, tuple[int, Value]],
    order: list[str],
    slots: int,
    device: torch.device,
) -> torch.Tensor:
    """``prefix``, then ``slots`` counts, then ``slots`` statistics, as float64 on ``device``.

    Slot ``i`` holds metric ``order[i]`` (count 0 where this rank did not log it). Counts
    and Python-number statistics are known on the host; tensor statistics are placed with
    one ``index_copy_``, so the row costs one host-to-device copy and no host read.
    """
    values = [*prefix, *([0.0] * (2 * slots))]
    start = len(prefix)
    on_device: dict[torch.device, tuple[list[int], list[torch.Tensor]]] = {}
    for i, name in enumerate(order):
        got = stats.get(name)
        if got is None:
            continue
        count, stat = got
        values[start + i] = float(count)
        if isinstance(stat, torch.Tensor):
            where, tensors = on_device.setdefault(stat.device, ([], []))
            where.append(start + slots + i)
            tensors.append(stat)
        else:
            values[start + slots + i] = stat
    if not on_device:
        return _host_to(values, device)
    positions = [p for where, _ in on_device.values() for p in where]
    # The positions ride along in the same host-to-device copy as the counts.
    both = _host_to(values + [float(p) for p in positions], device)
    source = torch.cat(
        [_moved(torch.stack(ts), device).to(torch.float64) for _, ts in on_device.values()]
    )
    out = both[: len(values)]
    out.index_copy_(0, both[len(values) :].long(), source)
    return out


def _host_to(values: list[float], device: torch.device) -> torch.Tensor:
    """A float64 tensor of host numbers on ``device``, without making the host wait."""
    return _moved(torch.tensor(values, dtype=torch.float64), device)


def _moved(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    if t.device == device:
        return t
    if t.device.type == "cpu" and device.type == "cuda":
        # Pinned, so the copy is asynchronous: a pageable copy would wait for the stream.
        return t.pin_memory().to(device, non_blocking=True)
    # Host-device sync: only for metrics on an accelerator with a gloo group (one per device).
    return t.to(device)
