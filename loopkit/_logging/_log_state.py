"""detach_logging's checkpoint state: its call count, each sink's state, and the unflushed
interval (the calls since the last flush and the values recorded since), so a resumed run
flushes where the uninterrupted run flushes, with the same reductions, bit for bit.

Tensor values are saved as 0-d CPU tensors of their own dtype (a checkpoint is loaded with
``map_location="cpu"``), read in one transfer per device and dtype: the save's host sync.
Restored, they stay on the CPU until the metric's next value names its device
(``adopted``). Under DDP with ``sync_ranks=True`` or ``False`` every rank's values take part
in what reaches a sink, so the state holds each rank's interval (``"ranks"``) and each rank
resumes its own.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .. import _ranks
from .._checks import is_int_at_least
from .._errors import CheckpointError
from .._sync_points import expected_sync
from ._delivery import Delivery
from ._exchange import _moved
from ._reductions import HowOf, Kind, Value

Pending = dict[str, list[Value]]
"""The values recorded since the last flush, by metric."""
Snapshot = tuple[int, int, Pending, set[str], list[Any]]
"""What a failed resume puts back: calls, calls since the last flush, the values, the
metrics restored on the CPU, the sinks' states."""


class LogState:
    """The checkpoint side of ``detach_logging``: ``state_dict``, its check and load, and a
    failed resume's way back (``snapshot``/``restore``), so it is a checkpoint piece."""

    step: int
    sync_ranks: bool | None
    _calls_since_flush: int
    _values: Pending
    _restored: set[str]  # metrics whose values a resume put on the CPU
    _kinds: dict[str, Kind]  # how each metric was last logged (detach_logging's fast path)
    _dtypes: set[torch.dtype] | None  # the kept tensors' dtypes, if known
    _delivery: Delivery

    _how: HowOf  # detach_logging's method: a metric's reduction

    def state_dict(self) -> dict[str, Any]:
        """The log-call count, the unflushed interval (the calls since the last flush and
        their values) and each sink's state (a tracker's run and last point), for a checkpoint.

        It reads the unflushed values to the host: one sync, at save time only. Under DDP
        with ``sync_ranks=True`` or ``False`` it gathers every rank's interval (a collective:
        call it on every rank, as ``Checkpointer.save`` does).
        """
        own = saved(self.step, self._calls_since_flush, self._values)
        state = {**own, "sinks": self._delivery.state_dict()}
        if self.sync_ranks is not None and _ranks.is_multi_rank():
            state["ranks"] = _ranks.gather_objects(own)  # a host-level exchange
        return state

    def check_state_dict(self, state: object) -> None:
        """Raise ``CheckpointError`` if ``state`` does not fit this log; changes nothing."""
        try:
            self._checked(state)
        except (ValueError, TypeError, RuntimeError) as err:
            raise CheckpointError(f"the log's state does not fit this log: {err}") from err

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue the saved count and interval, and give each tracker its run back (before
        it starts). A state saved without the interval resumes an empty one."""
        calls, since, values, sinks = self._checked(state)
        self._delivery.load_state_dict(sinks)
        self.step, self._calls_since_flush, self._values = calls, since, values
        self._restored = set(values)
        self._kinds.clear()  # the next value of each metric is checked against the loaded ones
        self._dtypes = None  # the loaded values' dtypes: found by the next flush

    def _checked(self, state: object) -> tuple[int, int, Pending, list[Any]]:
        """A saved state's count, interval and sink states, checked against this log."""
        calls = state.get("calls") if isinstance(state, Mapping) else None
        if not isinstance(state, Mapping) or not is_int_at_least(calls, 0):
            raise ValueError(f"not a detach_logging state (no 'calls' count): {state!r}")
        own = own_entry(state, self.sync_ranks, self._how)
        calls = own.get("calls", calls)
        if not is_int_at_least(calls, 0):
            raise ValueError(f"not a detach_logging state: this rank's 'calls' is {calls!r}")
        since, values = checked(own)
        sinks = self._delivery.check_state(state.get("sinks"))
        return int(calls), since, values, sinks

    def snapshot(self) -> Snapshot:
        """What ``restore`` puts back (no host read: the values are kept as they are)."""
        values = {name: list(vals) for name, vals in self._values.items()}
        return (self.step, self._calls_since_flush, values, set(self._restored),
                self._delivery.state_dict())  # fmt: skip

    def restore(self, snapshot: Snapshot) -> None:
        """Put back what ``snapshot`` took (a resume that failed after loading this log)."""
        self.step, self._calls_since_flush, values, restored, sinks = snapshot
        self._delivery.load_state_dict(sinks)
        # Copies: the log appends to its lists, and the snapshot may be restored again.
        self._values = {name: list(vals) for name, vals in values.items()}
        self._restored = set(restored)
        self._kinds.clear()  # the next value of each metric is checked against these
        self._dtypes = None


def saved(calls: int, since_flush: int, values: Mapping[str, Sequence[Value]]) -> dict[str, Any]:
    """This rank's interval as a checkpoint holds it (its tensors read to the CPU)."""
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for vals in values.values():
        for v in vals:
            if isinstance(v, torch.Tensor):
                groups.setdefault((v.device, v.dtype), []).append(v)
    on_cpu: dict[int, torch.Tensor] = {}
    for tensors in groups.values():
        # Host-device sync: a checkpoint reads the unflushed values (at save time only).
        with expected_sync("a checkpoint of detach_logging's unflushed values"):
            host = torch.stack(tensors).cpu()
        on_cpu.update(zip(map(id, tensors), host.unbind(), strict=True))
    pending = {
        name: [on_cpu[id(v)] if isinstance(v, torch.Tensor) else v for v in vals]
        for name, vals in values.items()
    }
    return {"calls": calls, "since_flush": since_flush, "pending": pending}


def own_entry(
    state: Mapping[str, Any], sync_ranks: bool | None = True, how: HowOf = lambda _: "mean"
) -> Mapping[str, Any]:
    """This rank's part of a saved state: its entry of ``"ranks"`` if the state has one.

    Saved by another number of ranks with ``sync_ranks=True`` (a resume on another number
    of processes), the saved values are spread over the new ranks (``spread``) so the next
    flush gives what the uninterrupted run would have, within rounding. A state without
    ``"ranks"`` (saved by one process) is one old rank's when this job's ranks take part in
    what reaches a sink (``sync_ranks=True`` or ``False``): spread alike, not given whole to
    every rank (which would count a ``sum`` once per rank). With ``sync_ranks=False`` each
    rank's values go to its own sinks, which no other number of ranks can continue: refused,
    growing or shrinking.
    """
    ranks = state.get("ranks")
    rank, world = _ranks.world()
    if ranks is None:
        if sync_ranks is None or world == 1:
            return state  # the same one process, or rank zero's sinks alone (sync_ranks=None)
        ranks = [state]  # one process's interval, given to this job's ranks
    if not isinstance(ranks, list) or not ranks or not all(isinstance(r, Mapping) for r in ranks):
        raise ValueError(f"not a detach_logging state: its 'ranks' are {ranks!r}")
    if len(ranks) == world:
        entry: Mapping[str, Any] = ranks[rank]
        return entry
    if sync_ranks is not True:
        old = "1 process" if len(ranks) == 1 else f"{len(ranks)} ranks"
        here = "1 process" if world == 1 else f"{world} ranks"
        raise ValueError(
            f"the log's state holds the unflushed values of {old}, each for its own sinks "
            f"(sync_ranks={sync_ranks}), but this job has {here}: resume with {old}, or log "
            "with sync_ranks=True (one record of every rank's values), which resumes on any "
            "number"
        )
    pending = []
    for r in ranks:
        values = r.get("pending", {})
        if not isinstance(values, Mapping):
            raise ValueError(f"not a detach_logging state: 'pending' is {values!r}")
        pending.append({str(k): _values(k, v) for k, v in values.items()})
    return {**ranks[0], "pending": spread(pending, rank, how)}


def spread(saved: Sequence[Mapping[str, list[Value]]], rank: int, how: HowOf) -> Pending:
    """Rank ``rank``'s share of the unflushed values that other ranks saved, so that every
    metric's next flush over the new ranks equals the old ranks' (pure: no exchange).

    A cross-rank flush of ``mean`` (or ``last``) weighs every call alike when each rank logs
    once a call: each new rank takes, per call, the mean of the old ranks' values of that
    call. ``sum``, ``max`` and ``min`` of every value: rank zero takes them all. A metric not
    logged once a call on every rank goes to rank zero whole (its mean weighs the old
    ranks' calls by their number of values).
    """
    names = sorted({name for values in saved for name in values})
    out: Pending = {}
    for name in names:
        lists = [values.get(name, []) for values in saved]
        per_call = how(name) in ("mean", "last") and len({len(v) for v in lists}) == 1
        if per_call:
            out[name] = [_mean([v[i] for v in lists]) for i in range(len(lists[0]))]
        elif rank == 0:
            out[name] = [v for values in lists for v in values]
    return {name: vals for name, vals in out.items() if vals}


def _mean(values: list[Value]) -> Value:
    if all(isinstance(v, torch.Tensor) for v in values):
        return torch.stack([torch.as_tensor(v, dtype=torch.float64) for v in values]).mean()
    return math.fsum(float(v) for v in values) / len(values)


def checked(entry: Mapping[str, Any]) -> tuple[int, Pending]:
    """The calls since the last flush and the values of a saved interval, checked (an old
    state without them: an empty interval)."""
    since = entry.get("since_flush", 0)
    pending = entry.get("pending", {})
    if not is_int_at_least(since, 0):
        raise ValueError(f"not a detach_logging state: 'since_flush' is {since!r}, not an int >= 0")
    if not isinstance(pending, Mapping):
        raise ValueError(f"not a detach_logging state: 'pending' is a {type(pending).__name__}")
    return since, {str(name): _values(name, vals) for name, vals in pending.items()}


def _values(name: object, vals: object) -> list[Value]:
    """One metric's saved values: scalar tensors or numbers, the same kind throughout."""
    if not isinstance(name, str) or not isinstance(vals, (list, tuple)) or not vals:
        raise ValueError(
            f"not a detach_logging state: the unflushed values of {name!r} are {vals!r}, not "
            "a non-empty list"
        )
    tensors = [v for v in vals if isinstance(v, torch.Tensor)]
    numbers = [v for v in vals if isinstance(v, (int, float)) and not isinstance(v, bool)]
    if len(tensors) != len(vals) and len(numbers) != len(vals):
        raise ValueError(
            f"not a detach_logging state: the unflushed values of {name!r} are not all scalar "
            "tensors or all numbers"
        )
    if any(t.numel() != 1 or t.is_complex() for t in tensors):
        raise ValueError(f"not a detach_logging state: a value of {name!r} is not a real scalar")
    if tensors:
        return [t.detach().reshape(()) for t in tensors]
    return [float(v) for v in numbers]


def adopted(
    values: Mapping[str, list[Value]], restored: set[str], metrics: Mapping[str, object]
) -> dict[str, list[Value]]:
    """The restored values of the metrics logged now that must move to the device of their
    new value (restored on the CPU), as moved copies; the others are left out."""
    moved: dict[str, list[Value]] = {}
    for name in restored.intersection(metrics):
        kept, new = values.get(name), metrics[name]
        if not kept or not isinstance(new, torch.Tensor) or not isinstance(kept[0], torch.Tensor):
            continue
        if kept[0].device == new.device:
            continue
        tensors = [t for t in kept if isinstance(t, torch.Tensor)]
        if all(t.dtype == tensors[0].dtype for t in tensors):
            moved[name] = list(_moved(torch.stack(tensors), new.device).unbind())
        else:  # a metric logged in several dtypes keeps each one
            moved[name] = [t.to(new.device) for t in tensors]
    return moved
