"""loopkit.preload: the deterministic part of a data pipeline, run once into a shared cache.

The items (after ``transform``: decode, resize, tokenize) are stored as one file per field
of a directory (``_cache_files``), fixed-shape fields as ``[N, *shape]`` in their own dtype
(uint8 stays uint8, bfloat16 stays bfloat16, a Python float is a float64), fields whose
sizes vary as the items' elements one after another with each item's offset and shape.
Every process and every loader worker maps the same files (``torch.from_file``), so the
page cache holds one copy per node, whatever the number of ranks and workers; what a
``Preloaded`` hands out (an item, a batch) is a copy, never a view of the mapping.

The directory's name carries the data set's fingerprint (``_fields``: length, the fields'
shapes and dtypes, a hash of a spread sample of items, the transform's name or ``key=``),
so a changed data set never reuses an old cache: it gets a new one. A build writes into a
temporary directory and renames it into place when complete, under a lock that makes a
second builder of the same cache wait and then open it. The default root is private to
the user, and a cache someone else could have written is refused (``_cache_trust``).
Under ``torchrun`` one process per node (local rank 0) builds or opens it; the others
wait without a collective's timeout (``_cache_handoff``), then map it. The ranks then
compare what their caches hold (every file's sha256), so a job whose nodes built from
different copies of the data is refused on every rank before it trains.

This module builds or opens the cache (``preload``); reading it, items and batches, is
``_preloaded`` (``Preloaded``).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Sized
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from .._job import info
from . import _cache_files
from ._cache_files import complete
from ._cache_handoff import Announcer, agree, builder_error, job_token, wait_for
from ._cache_trust import check_cache, check_root, default_roots, make_root
from ._fields import Survey, as_tensors, fingerprint
from ._preloaded import Preloaded, batch_as_is

__all__ = ["Preloaded", "batch_as_is", "preload"]


def preload(
    dataset: Dataset[Any],
    cache: str | os.PathLike[str] | None = None,
    *,
    transform: Callable[[Any], Any] | None = None,
    key: str | None = None,
    trust_shared_cache: bool = False,
    verify: bool | None = None,
) -> Preloaded:
    """Run ``transform`` over every item of ``dataset`` once and map the result (see the module).

    ``cache`` is a directory (default ``/dev/shm/loopkit-preload-<uid>``, RAM-backed, when
    it has room, else ``loopkit-preload-<uid>`` in the temporary directory, both mode 0700);
    the cache goes in a subdirectory named by ``key`` (default: the data set's and
    transform's names) and the fingerprint. A root or cache that another user owns or
    that group or others can write is refused (PermissionError) unless
    ``trust_shared_cache=True``. ``verify`` checks a cache this call did not build against
    the sha256 of each file written at its build (default: only with
    ``trust_shared_cache``). Under torchrun every rank calls it: local rank 0 builds or
    opens, the others wait (however long) and map the same files; if it fails, every rank
    raises (local rank 0 its own exception, the others a RuntimeError naming it), and so
    does every rank if the nodes' caches hold different data (each node's copy of the data
    set differs). Raises OSError before writing anything if the directory has no room for it,
    saying how many bytes are needed where; ValueError for an empty data set.
    """
    if not isinstance(dataset, Sized) or not hasattr(dataset, "__getitem__"):
        raise TypeError("preload needs a map-style data set (__len__ and __getitem__)")
    if transform is not None and not callable(transform):
        raise TypeError(f"transform must be callable, got {type(transform).__name__}")
    if key is not None and (not isinstance(key, str) or not key or "/" in key):
        raise ValueError(f"key must be a non-empty name without '/', got {key!r}")
    if not isinstance(trust_shared_cache, bool):
        raise TypeError(f"trust_shared_cache must be a bool, got {trust_shared_cache!r}")
    if verify is not None and not isinstance(verify, bool):
        raise TypeError(f"verify must be a bool or None, got {verify!r}")
    n = len(dataset)
    if n == 0:
        raise ValueError(
            "preload got an empty data set (len 0): there is nothing to store; preload the "
            "data set once it has items"
        )
    default = cache is None
    roots = [Path(cache)] if cache is not None else default_roots()
    job = info()
    builder = job.local_rank == 0
    # The one collective, as every rank starts (nothing slow before it): the call's token and
    # where every rank runs, so each finds its node's builder.
    handoff = job_token(job.local_rank)
    token = handoff.token
    name = key or _default_key(dataset, transform)

    def get(i: int) -> tuple[torch.Tensor, ...]:
        item = dataset[i]
        return as_tensors(transform(item) if transform is not None else item)[0]

    opening = _Opening(n, get, name, roots, default, trust_shared_cache,
                       trust_shared_cache if verify is None else verify)  # fmt: skip
    announcer = Announcer(roots[0], name, token, job.rank) if builder and token else None
    failure: Exception | None = None
    cache_: Preloaded | None = None
    held: tuple[Path, str] | None = None
    try:  # from here on, a failure on any rank reaches every rank (agree)
        for root in roots:
            check_root(root, default=default, trust=trust_shared_cache)
        if builder:  # where this call's handoff file goes (the others wait for it)
            make_root(roots[0], default=default, trust=trust_shared_cache)
        if announcer is not None:
            announcer.say("working")
        if builder:
            first = dataset[0]
            single = as_tensors(transform(first) if transform is not None else first)[1]
            cache_ = opening.open_or_build(fingerprint(n, get, name), single)
        else:
            # The node's builder posts its outcome when it is done: a failure it could not
            # write into the handoff file (no root, a full disk) still reaches this rank.
            cache_ = _waited(n, get, name, roots[0], token, handoff.builder(job.rank))
        held = (cache_.path, _cache_files.contents(cache_.path))  # compared across nodes
        if announcer is not None:
            announcer.say("ready", path=str(cache_.path))
    except Exception as err:  # every rank must learn of it (below), then it is raised
        failure = err
        if announcer is not None:
            with contextlib.suppress(OSError):
                announcer.say("failed", error=f"{type(err).__name__}: {err}")
    if token:
        agree(failure, held, announcer, token, job.rank, job.world_size)
    if failure is not None:
        raise failure  # this rank's own exception, as it was raised
    assert cache_ is not None
    return cache_


def _waited(
    n: int,
    get: Callable[[int], tuple[torch.Tensor, ...]],
    name: str,
    where: Path,
    token: str,
    builder_rank: int,
) -> Preloaded:
    """A waiting rank's part: its own fingerprint, then local rank 0's cache, mapped."""
    own: Exception | None = None
    try:
        survey = fingerprint(n, get, name)
    except Exception as err:  # raised once local rank 0 is done: all meet in the exchange
        own = err
    path = wait_for(where, name, token, builder_rank, lambda: builder_error(token, builder_rank))
    if own is not None:
        raise own
    if path.name != f"{name}-{survey.fingerprint}":
        raise RuntimeError(
            f"preload: local rank 0 made the cache {path}, but this rank's data set has the "
            f"fingerprint {survey.fingerprint}: every rank must preload the same data set"
        )
    return Preloaded(path, built=False)


class _Opening:
    """Local rank 0's part: find the cache (and check it), or build it under the lock."""

    def __init__(
        self,
        n: int,
        get: Callable[[int], tuple[torch.Tensor, ...]],
        name: str,
        roots: list[Path],
        default: bool,
        trust: bool,
        verify: bool,
    ) -> None:
        self.n, self.get, self.name, self.roots = n, get, name, roots
        self.default, self.trust, self.verify = default, trust, verify

    def _found(self, places: list[Path], survey: Survey) -> Preloaded | None:
        """The complete cache at one of ``places``, checked, or None."""
        path = next((p for p in places if complete(p)), None)
        if path is None:
            return None
        if not self.trust:
            check_cache(path)
        opened = Preloaded(path, built=False, verify=self.verify)
        if (opened.fingerprint, len(opened)) != (survey.fingerprint, self.n):
            raise RuntimeError(
                f"preload: the cache {path} holds {len(opened)} items of fingerprint "
                f"{opened.fingerprint}, not {self.n} of {survey.fingerprint} as its name "
                f"says: delete it to rebuild it"
            )
        return opened

    def open_or_build(self, survey: Survey, single: bool) -> Preloaded:
        places = [root / f"{self.name}-{survey.fingerprint}" for root in self.roots]
        found = self._found(places, survey)
        if found is not None:
            return found
        # RAM (/dev/shm) when it has room, else the temporary directory (disk).
        needed = _cache_files.needed_bytes(self.n, survey) if len(places) > 1 else 0
        final = next((p for p in places[:-1] if _cache_files.free_bytes(p.parent) >= needed),
                     places[-1])  # fmt: skip
        make_root(final.parent, default=self.default, trust=self.trust)
        with _cache_files.build_lock(final.parent, final.name) as locked:
            found = self._found(places, survey)  # another process built it while we waited
            if found is not None:
                return found
            if locked:  # no live builder holds them: a killed build's leftovers
                _cache_files.remove_leftovers(final.parent, final.name)
            _cache_files.write(self.n, self.get, survey, single, final)
        return Preloaded(final, built=True)


def _default_key(dataset: object, transform: object) -> str:
    parts = [type(dataset).__qualname__]
    if transform is not None:
        parts.append(getattr(transform, "__qualname__", type(transform).__qualname__))
    return "-".join(p.replace("<", "").replace(">", "").replace(".", "_") for p in parts)
