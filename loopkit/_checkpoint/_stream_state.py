"""The checkpoint piece of a ``loader=`` that saves its own place: any loader with
``state_dict()``/``load_state_dict()`` (torchdata's ``StatefulDataLoader`` over a map-style
or iterable data set, a streaming library's loader, ``loopkit.replayed``).

One state per rank: each rank reads its own part of the data, and the file holds every
rank's, gathered on save (sharded checkpoints too). The state saved is the place after the
batches the loop consumed, whatever ``iterate`` took ahead (``_data._consumed``); the
loader's own workers' prefetching is the loader's business (its state accounts for it).
A resume on another number of processes splits what is left of the pass again where the
data set can (``loopkit.stream_shards``) and is refused, with the reason, where it cannot.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch.utils.data import IterableDataset

from .._data import _consumed
from .._errors import CheckpointError
from .._stream import _shards, _shuffle_buffer
from .._stream._resumed_pass import own_state, quiet_first_iterator, refuse_unsaved_order
from .._stream._resumed_pass import undo as undo_quiet
from ._contract import expect, need

_ABSENT = object()


class StreamState:
    """A stateful loader's place, one per rank."""

    per_rank = True

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        _consumed.watch(loader)  # iterate records its state before each batch it takes ahead

    def state_dict(self) -> dict[str, object]:
        own = own_state(self.loader, self.loader.state_dict)
        state: dict[str, object] = {"loader": _consumed.state_of(self.loader, own)}
        generator = getattr(self.loader, "generator", None)
        if isinstance(generator, torch.Generator):  # the loader's own shuffling stream
            state["generator"] = generator.get_state()
        return state

    def check_state_dict(self, saved: object) -> None:
        state = expect(saved, Mapping, "'loader'")
        if "resplit" in state:
            need(state, "resplit", Mapping, "'loader.resplit'")
            return
        need(state, "loader", object, "'loader.loader'")
        saved_workers = _torchdata_workers(state["loader"])
        workers = getattr(self.loader, "num_workers", None)
        torchdata = hasattr(self.loader, "next_iter_state")
        if saved_workers is not None and torchdata and saved_workers != workers:
            raise CheckpointError(
                f"the loader's place was saved by {saved_workers} loader worker(s) (each "
                f"holds its own part of the stream), and this loader has {workers}: build "
                f"it with num_workers={saved_workers} to resume it"
            )

    def snapshot(self) -> tuple[str, object, object]:
        generator = getattr(self.loader, "generator", None)
        own = generator.get_state() if isinstance(generator, torch.Generator) else None
        pending = getattr(self.loader, "next_iter_state", _ABSENT)
        if pending is not _ABSENT and getattr(self.loader, "_iterator", None) is None:
            # torchdata's loader before its pass: state_dict() would start an iterator (and
            # its workers) to say so. Its state is the one loaded into it, if any.
            return "pending", pending, own
        return "state", _consumed._copied(self.loader.state_dict()), own

    def load_state_dict(self, saved: Mapping[str, Any]) -> None:
        generator = getattr(self.loader, "generator", None)
        if isinstance(generator, torch.Generator) and "generator" in saved:
            generator.set_state(saved["generator"])
        if "resplit" in saved:
            plan = saved["resplit"]
            if plan["items"] is None:
                return
            shards = _shards_of(self.loader)
            shards.resplit(plan["epoch"], plan["items"], plan.get("end"))
            _forget_iterator(self.loader)  # snapshot() may have made one, of no state
            # The re-split is the next pass's only: the pass after it reads whole epochs.
            quiet_first_iterator(self.loader, then=shards.forget_plan)
        else:
            self.loader.load_state_dict(saved["loader"])
            quiet_first_iterator(self.loader)

    def restore(self, snapshot: tuple[str, object, object]) -> None:
        kind, state, own = snapshot
        undo_quiet(self.loader)
        generator = getattr(self.loader, "generator", None)
        if isinstance(generator, torch.Generator) and isinstance(own, torch.Tensor):
            generator.set_state(own)
        shards = _shards_of(self.loader, refuse=False)
        if shards is not None:
            shards.forget_plan()
        if kind == "pending" and not state:
            _forget_iterator(self.loader)
            return
        self.loader.load_state_dict(state)
        if kind == "pending":
            quiet_first_iterator(self.loader)

    def reseeded(self, saved: Sequence[object], world: int) -> list[dict[str, object]]:
        """Each of ``world`` ranks' share of what the saved ranks left of their pass; refused
        where the data set cannot split itself again."""
        found = [s for state in saved for s in _marked(state)]
        if any(s.get("loopkit") == _shuffle_buffer.MARK for s in found):
            raise CheckpointError(
                f"the loader's shuffle_buffer holds samples of each of the {len(saved)} saved "
                f"ranks' streams, which cannot be dealt to {world}: resume with "
                f"{len(saved)} processes, or shuffle with loopkit.stream_shards(shuffle=True) "
                "alone, which splits itself again"
            )
        if _shards_of(self.loader, refuse=False) is None:
            raise CheckpointError(
                f"the loader ({type(self.loader).__name__}) cannot split its data among "
                f"another number of processes: each of the {len(saved)} saved ranks' places "
                f"is in a part of the data only that rank reads (split_dataset_by_node fixes "
                f"it by rank). Resume with {len(saved)} processes, or read the data through "
                "loopkit.stream_shards, whose place is the whole job's"
            )
        marked = [s for s in found if s.get("loopkit") == _shards.MARK]
        if not marked:  # no rank iterated it: every rank starts it afresh
            return [{"resplit": {"epoch": None, "items": None}} for _ in range(world)]
        epoch, items, end = _shards.remaining(marked, len(saved))
        return [{"resplit": {"epoch": epoch, "items": items, "end": end}} for _ in range(world)]


def _torchdata_workers(state: object) -> int | None:
    """The number of workers a torchdata loader's state was saved by (None: not such a state)."""
    if not isinstance(state, Mapping) or "_iterator_finished" not in state:
        return None
    snapshot = state.get("_snapshot")
    if isinstance(snapshot, Mapping) and isinstance(snapshot.get("_worker_snapshots"), Mapping):
        return len(snapshot["_worker_snapshots"])
    return 0


def _forget_iterator(loader: object) -> None:
    """torchdata's loader back to no iterator and no loaded state (its load of {} keeps a
    loaded state waiting)."""
    if hasattr(loader, "next_iter_state"):
        loader.next_iter_state = None
        loader._iterator = None  # type: ignore[attr-defined]
        loader._initial_iter_for_state_dict = False  # type: ignore[attr-defined]


def _marked(state: object) -> Iterator[Mapping[str, Any]]:
    """Every state a loopkit data set gave, wherever the loader nested it (its workers')."""
    if isinstance(state, Mapping):
        if isinstance(state.get("loopkit"), str):
            yield state
            return
        for value in state.values():
            yield from _marked(value)
    elif isinstance(state, (list, tuple)):
        for value in state:
            yield from _marked(value)


def _shards_of(loader: object, refuse: bool = True) -> Any:
    dataset = getattr(loader, "dataset", None)
    if isinstance(dataset, _shards.stream_shards):
        return dataset
    if refuse:
        raise CheckpointError("only a loader over loopkit.stream_shards can split its data again")
    return None


def stream_loader(loader: object) -> object:
    """``loader`` if it can be a ``loader=`` that saves its own place; else refused, saying how."""
    if callable(getattr(loader, "state_dict", None)) and callable(
        getattr(loader, "load_state_dict", None)
    ):
        if not hasattr(loader, "__iter__"):
            raise TypeError(
                f"loader must be iterable (the loop reads its batches), got "
                f"{type(loader).__name__}: a stateful object that is not a loader goes in extra="
            )
        refuse_unsaved_order(loader, "loader")
        dataset = getattr(loader, "dataset", None)
        if (
            hasattr(loader, "next_iter_state")
            and isinstance(dataset, IterableDataset)
            and not callable(getattr(dataset, "state_dict", None))
        ):
            raise TypeError(
                f"the StatefulDataLoader's data set ({type(dataset).__name__}) is an "
                "IterableDataset without state_dict()/load_state_dict(): torchdata resumes it "
                "by reading its pass again from the start, and a second resume of it reads "
                "past the saved place (batches lost). Give the data set state_dict() and "
                "load_state_dict() (an HF streaming data set, loopkit.stream_shards and "
                "loopkit.shuffle_buffer have them), or opt in to reading the pass again "
                "with loader=loopkit.replayed(DataLoader(...)), which resumes exactly"
            )
        return loader
    raise TypeError(
        f"loader must save its place in the data, and {type(loader).__name__} has no "
        "state_dict()/load_state_dict(): a resume would start its stream from the beginning. "
        "Use torchdata's StatefulDataLoader (the same arguments as DataLoader; pip install "
        "torch-loopkit[streaming]), loopkit.distributed.loader(...) for a map-style data set, "
        "or opt in to reading the pass again up to the saved place with "
        "loader=loopkit.replayed(loader) (docs/streaming.md)"
    )
