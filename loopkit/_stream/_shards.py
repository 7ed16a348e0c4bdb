"""A stream over a list of shard files that can split itself again among another number of
processes: ``stream_shards``.

Each pass (epoch) has one plan for the whole job: the shards in an order drawn from
``(seed, epoch)``, each read from its start. Rank ``r`` of ``W`` takes the plan's items
``r, r + W, ...``, and loader worker ``w`` of ``K`` every ``K``-th of those. A worker's
state is where it stands in its items: the item it reads and the place in that shard. From
the states of every worker of every rank, ``remaining`` computes what is left of the pass
(each shard from the place reached): a resume on another number of processes
(``resume(reseed=True)``) deals those items to the new ranks and workers, so every sample of
the pass is read once. The order within the pass changes; the samples do not.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Generic, TypeVar

import numpy as np
from torch.utils.data import IterableDataset, get_worker_info

from .. import _ranks
from .._data._seeding import SEED_MAX, SEED_MIN, seeded_rngs
from .._errors import CheckpointError
from ._shuffle_buffer import check_passes

S = TypeVar("S")
T = TypeVar("T")

MARK = "loopkit.stream_shards"
Item = tuple[int, int]  # (shard index, place in the shard to read from)


def plan(n_shards: int, seed: int, epoch: int, shuffle: bool) -> list[Item]:
    """The pass's items for the whole job: every shard from its start, in the pass's order."""
    order = range(n_shards)
    if shuffle:
        rng = np.random.default_rng(np.random.SeedSequence([seed % 2**64, epoch]))
        order = rng.permutation(n_shards).tolist()
    return [(int(s), 0) for s in order]


def share(items: Sequence[T], rank: int, world: int, worker: int, workers: int) -> list[T]:
    """The items one worker of one rank reads."""
    return list(items[rank::world][worker::workers])


def remaining(
    states: Sequence[Mapping[str, Any]], world: int
) -> tuple[int, list[Item], int | None]:
    """``(epoch, items left, end)`` of a pass from the worker states of all ``world`` saved
    ranks (a rank with no state read nothing of it; ``end``: the epoch the stream stops at).
    Items keep the plan's order."""
    if not states:
        raise CheckpointError("the checkpoint holds no stream_shards state to split again")
    first = states[0]
    keys = ("epoch", "seed", "n_shards", "shuffle", "plan", "end")
    for state in states[1:]:
        if any(state[k] != first[k] for k in keys):
            raise CheckpointError(
                "the ranks' stream_shards states are of different passes or data (epoch "
                f"{state['epoch']} and {first['epoch']}): they cannot be split again; resume "
                f"with the {world} processes that saved them"
            )
    items = _items(first)
    left: dict[int, Item] = {}  # plan index -> item left
    by_rank: dict[int, list[Mapping[str, Any]]] = {}
    for state in states:
        if state["world"] != world:
            raise CheckpointError(
                f"a stream_shards state of {state['world']} ranks in a checkpoint of {world}"
            )
        by_rank.setdefault(int(state["rank"]), []).append(state)
    slots = list(range(len(items)))
    for rank in range(world):
        mine = by_rank.get(rank, [])
        workers = int(mine[0]["workers"]) if mine else 1
        seen = {int(s["worker"]): s for s in mine}
        for worker in range(workers):
            got = seen.get(worker)
            at = 0 if got is None else int(got["at"])
            place = None if got is None or got["place"] is None else int(got["place"])
            for i, slot in enumerate(share(slots, rank, world, worker, workers)):
                if i >= at:
                    shard, start = items[slot]
                    left[slot] = (shard, place if i == at and place is not None else start)
    end = first["end"]
    return int(first["epoch"]), [left[i] for i in sorted(left)], None if end is None else int(end)


def _share_of(state: Mapping[str, Any]) -> list[Item]:
    """The shards (and places) this rank's worker reads in the state's epoch."""
    return share(_items(state), state["rank"], state["world"], state["worker"], state["workers"])


def _items(state: Mapping[str, Any]) -> list[Item]:
    if state["plan"] is not None:
        return [(int(s), int(p)) for s, p in state["plan"]]
    return plan(int(state["n_shards"]), int(state["seed"]), int(state["epoch"]), state["shuffle"])


class stream_shards(IterableDataset[T], Generic[S, T]):
    """The samples of ``shards`` (paths, URLs, any picklable names), each read by
    ``read(shard)``, split among ranks and loader workers by shard, and saved exactly: its
    state is where each worker stands, and a resume on another number of processes
    (``resume(reseed=True)``) splits what is left of the pass again.

    ``shuffle`` orders the shards, and the samples within each shard (read whole into
    memory), from ``(seed, epoch)``. ``passes`` reads that many epochs (``None``: for ever) in
    one loader pass, each in its own order, so a save anywhere, an epoch's end included,
    resumes at the same place; ``set_epoch(epoch)`` sets the epoch the next loader pass
    starts at. ``transform`` runs on each sample with python's, numpy's and torch's RNGs set from
    ``(seed, epoch, shard, place)``: its random augmentation is the same after any resume,
    on any number of processes. Ranks read whole shards: give at least as many shards as
    ranks times workers, or some read nothing.
    """

    def __init__(
        self,
        shards: Sequence[S],
        read: Callable[[S], Iterable[T]],
        *,
        seed: int = 0,
        shuffle: bool = True,
        passes: int | None = 1,
        transform: Callable[[T], Any] | None = None,
    ) -> None:
        check_passes(passes)
        if isinstance(shards, (str, bytes)) or not isinstance(shards, Sequence) or not shards:
            raise TypeError(
                f"shards must be a non-empty sequence of shard names (a list of paths), got "
                f"{shards!r:.80}"
            )
        if not callable(read):
            raise TypeError(f"read must be callable (a shard -> its samples), got {read!r}")
        if isinstance(seed, bool) or not isinstance(seed, int) or not SEED_MIN <= seed <= SEED_MAX:
            raise ValueError(f"seed must be a 64-bit int, got {seed!r}")
        if not isinstance(shuffle, bool):
            raise TypeError(f"shuffle must be True or False, got {shuffle!r}")
        if transform is not None and not callable(transform):
            raise TypeError(f"transform must be callable, got {transform!r}")
        self.shards, self.read, self.seed = list(shards), read, seed
        self.shuffle, self.transform, self.passes = shuffle, transform, passes
        self.epoch = 0
        # (epoch, items, end) after a re-split: the next pass's only.
        self._plan: tuple[int, list[Item], int | None] | None = None
        self._loaded: Mapping[str, Any] | None = None
        self._state: dict[str, Any] | None = None  # while a pass is iterated here
        self._rank, self._world = _ranks.world()

    def set_epoch(self, epoch: int) -> None:
        """Read the next pass in the order of ``epoch``."""
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"epoch must be an int >= 0, got {epoch!r}")
        self.epoch = epoch

    def resplit(self, epoch: int, items: Sequence[Item], end: int | None = None) -> None:
        """Read only ``items`` of epoch ``epoch`` in the next pass (what another number of
        processes left), then go on to ``end`` as the saved stream would have."""
        self.epoch, self._loaded = epoch, None
        self._plan = (epoch, [(int(s), int(p)) for s, p in items], end)

    def forget_plan(self) -> None:
        """The re-split pass has begun (its iterator is made): later passes read whole epochs."""
        self._plan = None

    def _where(self) -> tuple[int, int, int, int]:
        """(rank, world, worker, workers) of the process iterating."""
        info = get_worker_info()
        if info is None:
            rank, world = _ranks.world()
            return rank, world, 0, 1
        # A worker: the launcher's variables (a spawned worker has no process group), else
        # what the main process knew when it built the data set.
        rank = int(os.environ.get("RANK", self._rank))
        world = int(os.environ.get("WORLD_SIZE", self._world))
        return rank, world, info.id, info.num_workers

    def _fresh(self) -> dict[str, Any]:
        rank, world, worker, workers = self._where()
        plan = self._plan if self._plan and self._plan[0] == self.epoch else None
        end = None if self.passes is None else self.epoch + self.passes
        return {
            "loopkit": MARK,
            "epoch": self.epoch,
            "seed": self.seed,
            "n_shards": len(self.shards),
            "shuffle": self.shuffle,
            "plan": None if plan is None else plan[1],
            "rank": rank,
            "world": world,
            "worker": worker,
            "workers": workers,
            "end": end if plan is None else plan[2],
            "at": 0,
            "place": None,
        }

    def __iter__(self) -> Iterator[Any]:
        loaded, self._loaded = self._loaded, None
        state = self._fresh()
        self._plan = None  # a re-split is one pass's (a persistent worker's next reads whole)
        if loaded is not None:
            where = ("rank", "world", "worker", "workers")
            if any(loaded[k] != state[k] for k in where):
                raise ValueError(
                    "this stream_shards state was saved by rank {rank} of {world}, worker "
                    "{worker} of {workers}".format(**loaded)
                    + ", and is loaded by rank {rank} of {world}, worker {worker} of "
                    "{workers}: resume with the same processes and num_workers, or with "
                    "ckpt.resume(reseed=True) on another number of processes".format(**state)
                )
            state = dict(loaded)
        self._state = state
        return self._pass(state)

    def _pass(self, state: dict[str, Any]) -> Iterator[Any]:
        while True:
            if state["end"] is None and state["plan"] is None and not _share_of(state):
                return  # no shard for this worker, in any epoch: it reads nothing (not spins)
            yield from self._epoch(state)
            if state["end"] is not None and state["epoch"] + 1 >= state["end"]:
                return
            state.update(epoch=state["epoch"] + 1, plan=None, at=0, place=None)

    def _epoch(self, state: dict[str, Any]) -> Iterator[Any]:
        items = _share_of(state)
        epoch = state["epoch"]
        for i in range(state["at"], len(items)):
            shard, start = items[i]
            place = state["place"] if i == state["at"] and state["place"] is not None else start
            state["at"], state["place"] = i, place
            for sample in itertools.islice(self._samples(shard, epoch), place, None):
                # Counted before it is handed out: a snapshot taken after the yield has it out.
                state["place"] = place = place + 1
                if self.transform is None:
                    yield sample
                else:
                    # Set for the transform only: the loop's own draws see its own streams.
                    with seeded_rngs((self.seed, epoch, shard, place - 1)):
                        out = self.transform(sample)
                    yield out
        state["at"], state["place"] = len(items), None

    def _samples(self, shard: int, epoch: int) -> Iterable[T]:
        samples = self.read(self.shards[shard])
        if not self.shuffle:
            return samples
        whole = list(samples)
        rng = np.random.default_rng(np.random.SeedSequence([self.seed % 2**64, epoch, shard]))
        return [whole[k] for k in rng.permutation(len(whole))]

    def state_dict(self) -> dict[str, Any]:
        """Where this worker stands in its pass (a copy)."""
        if self._state is None:
            return dict(self._loaded) if self._loaded is not None else self._fresh()
        return dict(self._state)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state`` at the next pass."""
        if not isinstance(state, Mapping) or state.get("loopkit") != MARK:
            raise ValueError(
                "not a loopkit.stream_shards state: load the state this data set's "
                "state_dict() gave (the loader's state, saved by the same pipeline)"
            )
        if state["n_shards"] != len(self.shards):
            raise ValueError(
                f"the state is of {state['n_shards']} shards, this stream has "
                f"{len(self.shards)}: give the same shards as the run that saved it"
            )
        self._loaded, self._state = state, None
