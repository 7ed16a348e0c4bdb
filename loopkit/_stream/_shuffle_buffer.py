"""A seeded shuffle buffer over a stream, whose contents are part of the loader's state.

HF ``datasets``' ``IterableDataset.shuffle(buffer_size=)`` does not save its buffer: a
resume refills it from the source's saved place, so the samples the buffer held are lost
and the order changes. ``shuffle_buffer`` saves the buffer itself (the samples it holds,
not yet handed out), its random generator and the source's own state, so a resume hands
out the same samples in the same order. It is an ``IterableDataset`` with
``state_dict``/``load_state_dict``: torchdata's ``StatefulDataLoader`` snapshots it in each
worker (one buffer per worker, per rank) along with every batch.

The cost, measured in ``benchmarks/streaming.py``: every snapshot carries the buffer
(``size`` samples). The snapshot is a reference to an immutable copy of the slots (no
sample is copied in the process that iterates); a worker pickles it to the main process
with each batch, so a large buffer of large samples costs there.
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Generic, TypeVar, cast

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from .._data._consumed import Kept, _copied
from .._data._seeding import SEED_MAX, SEED_MIN, seeded_rngs

T = TypeVar("T")

MARK = "loopkit.shuffle_buffer"


def stream_slot() -> int:
    """This process's place among the data's streams: rank and worker, as one number."""
    info = get_worker_info()
    rank = int(os.environ.get("RANK", "0") or 0)
    return rank * 4096 + (info.id if info is not None else 0)


class shuffle_buffer(IterableDataset[T], Generic[T]):
    """``source``'s samples shuffled through a buffer of ``size``, seeded by ``seed``; the
    buffer, its generator and the source's place are saved with the loader's state.

    Each rank and each loader worker shuffles its own part of the stream with its own
    generator (drawn from ``seed``, the first epoch, the rank and the worker). ``passes``
    reads the source that many times (``None``: for ever), calling its ``set_epoch`` before
    each: one loader pass spans them, so a save anywhere, a pass's end included, resumes
    at the same place. ``transform`` runs on each sample as it leaves the buffer, with
    python's, numpy's and torch's RNGs set from the sample's place in the stream: random
    augmentation is the same after a resume. ``source`` must have ``state_dict`` /
    ``load_state_dict`` (an HF streaming data set does), so a resume continues it.
    """

    def __init__(
        self,
        source: Iterable[T],
        size: int,
        *,
        seed: int = 0,
        passes: int | None = 1,
        transform: Callable[[T], Any] | None = None,
    ) -> None:
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"size must be an int >= 1 (samples the buffer holds), got {size!r}")
        if isinstance(seed, bool) or not isinstance(seed, int) or not SEED_MIN <= seed <= SEED_MAX:
            raise ValueError(f"seed must be a 64-bit int, got {seed!r}")
        check_passes(passes)
        if not isinstance(source, Iterable):
            raise TypeError(f"source must be an iterable of samples, got {type(source).__name__}")
        _source_stateful(source)
        if transform is not None and not callable(transform):
            raise TypeError(f"transform must be callable, got {transform!r}")
        self.source, self.size, self.seed, self.transform = source, size, seed, transform
        self.passes = passes
        self.epoch = 0
        self._loaded: Mapping[str, Any] | None = None  # a state to continue from at __iter__
        self._state: dict[str, Any] | None = None  # while a pass is iterated here

    def set_epoch(self, epoch: int) -> None:
        """Start the next loader pass at the source's pass ``epoch``."""
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"epoch must be an int >= 0, got {epoch!r}")
        self.epoch = epoch

    def _fresh(self) -> dict[str, Any]:
        seq = np.random.SeedSequence([self.seed % 2**64, self.epoch, stream_slot()])
        return {
            "loopkit": MARK,
            "first": self.epoch,
            "epoch": self.epoch,
            "source": None,
            "buffer": [],
            "rng": np.random.Generator(np.random.PCG64(seq)).bit_generator.state,
            "emitted": 0,
        }

    def __iter__(self) -> Iterator[Any]:
        loaded, self._loaded = self._loaded, None
        state = self._fresh() if loaded is None else dict(loaded)
        state["buffer"] = _unpacked(state["buffer"])
        self._state = state
        return self._pass(state)

    def _pass(self, state: dict[str, Any]) -> Iterator[Any]:
        rng = np.random.Generator(np.random.PCG64())
        rng.bit_generator.state = state["rng"]
        state["rng"] = _Live(rng)  # read when a snapshot is taken, not at every sample
        buffer: list[T] = state["buffer"]
        source = _source_stateful(self.source)
        end = None if self.passes is None else state["first"] + self.passes
        while end is None or state["epoch"] < end:
            set_epoch = getattr(source, "set_epoch", None)
            if callable(set_epoch):
                set_epoch(state["epoch"])
            if state["source"] is not None:  # mid-pass: the source continues where it was
                source.load_state_dict(state["source"])
            state["source"] = _Live(source)
            checked = False
            for item in source:
                if not checked:  # once a pass: a checkpoint holds the buffered samples
                    check_sample(item)
                    checked = True
                if len(buffer) < self.size:
                    buffer.append(item)
                    continue
                j = int(rng.integers(len(buffer)))
                out, buffer[j] = buffer[j], item
                yield self._out(out, state)
            state["epoch"], state["source"] = state["epoch"] + 1, None
        while buffer:  # the stream ran out: the buffer empties in a random order
            j = int(rng.integers(len(buffer)))
            buffer[j], buffer[-1] = buffer[-1], buffer[j]
            yield self._out(buffer.pop(), state)

    def _out(self, sample: T, state: dict[str, Any]) -> Any:
        # Counted before it is handed out: a snapshot taken after the yield has it out.
        index = state["emitted"]
        state["emitted"] = index + 1
        if self.transform is None:
            return sample
        # A copy: a state taken before holds this sample in its buffer, and a transform may
        # change what it is given in place.
        copy = _copied(sample)
        with seeded_rngs((self.seed, state["first"], stream_slot(), index)):
            return self.transform(copy)  # type: ignore[arg-type]  # a copy of a T

    def state_dict(self) -> dict[str, Any]:
        """The buffer's samples, its generator, the samples handed out and the source's place."""
        state = self._state
        if state is None:
            return dict(self._loaded) if self._loaded is not None else self._fresh()
        out = dict(state)
        if isinstance(out["source"], _Live):
            out["source"] = out["source"].obj.state_dict()
        if isinstance(out["rng"], _Live):
            out["rng"] = out["rng"].obj.bit_generator.state
        if get_worker_info() is not None:
            # Sent to the main process with every batch: one bytes object, not a shared-memory
            # handle (a file descriptor) per buffered tensor.
            out["buffer"] = _packed(state["buffer"])
        else:
            # A reference to an immutable copy of the slots (the samples are not copied): the
            # buffer's later swaps do not change it, and a save need not copy it again.
            out["buffer"] = Kept(state["buffer"])
        return out

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state`` at the next pass (checked first: a wrong one changes nothing)."""
        if not isinstance(state, Mapping) or state.get("loopkit") != MARK:
            raise ValueError(
                "not a loopkit.shuffle_buffer state: load the state this data set's "
                "state_dict() gave (the loader's state, saved by the same pipeline)"
            )
        missing = {"first", "epoch", "source", "buffer", "rng", "emitted"} - set(state)
        if missing:
            raise ValueError(f"damaged shuffle_buffer state: {sorted(missing)} missing")
        self._loaded, self._state = state, None


_PLAIN = (torch.Tensor, int, float, bool, str, bytes, complex, type(None))


def check_sample(sample: object) -> None:
    """A sample a checkpoint can hold (it is read back with ``weights_only``): tensors and
    plain Python values in dicts, lists and tuples; else a TypeError saying how to fix it."""
    if isinstance(sample, Mapping):
        for value in sample.values():
            check_sample(value)
    elif isinstance(sample, (list, tuple)):
        for value in sample:
            check_sample(value)
    elif not isinstance(sample, _PLAIN):
        raise TypeError(
            f"shuffle_buffer holds samples in the checkpoint, and this one holds a "
            f"{type(sample).__module__}.{type(sample).__name__}, which a checkpoint cannot be "
            "read back with (they load with weights_only=True): give tensors and plain Python "
            "values (an HF data set: .with_format('torch'); decode images to tensors in the "
            "source, or shuffle before decoding)"
        )


def _packed(buffer: list[Any]) -> bytes:
    """The buffer as one bytes object (``torch.save``; read back with ``weights_only``)."""
    out = io.BytesIO()
    torch.save(buffer, out)
    return out.getvalue()


def _unpacked(buffer: object) -> list[Any]:
    if isinstance(buffer, bytes):
        loaded: list[Any] = list(torch.load(io.BytesIO(buffer), weights_only=True))
        return loaded
    return list(cast("Iterable[Any]", buffer))  # a list or tuple of samples


class _Live:
    """An object whose state a snapshot reads when it is taken (not at every sample)."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any) -> None:
        self.obj = obj


def check_passes(passes: object) -> None:
    """``passes`` is None (for ever) or an int >= 1."""
    if passes is not None and (
        isinstance(passes, bool) or not isinstance(passes, int) or passes < 1
    ):
        raise ValueError(f"passes must be an int >= 1 or None (for ever), got {passes!r}")


def _source_stateful(source: object) -> Any:
    if callable(getattr(source, "state_dict", None)) and callable(
        getattr(source, "load_state_dict", None)
    ):
        return source
    raise TypeError(
        f"shuffle_buffer's source ({type(source).__name__}) has no state_dict()/"
        "load_state_dict(), so its place in the stream cannot be saved with the buffer: use a "
        "source that has them (an HF streaming data set, loopkit.stream_shards, an "
        "IterableDataset of your own with both)"
    )
