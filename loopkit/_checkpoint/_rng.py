"""The process's RNG states (python, numpy, torch CPU and CUDA) as a checkpoint piece.

Each rank saves its own: the file holds the list of every rank's states, gathered on
save, and a resume gives each rank its own back.
"""

from __future__ import annotations

import contextlib
import hashlib
import random
from collections.abc import Iterator, Mapping, Sequence
from typing import TypedDict

import numpy as np
import torch

from .. import _ranks
from .._errors import CheckpointError


class _RngStateOnEveryMachine(TypedDict):
    python: tuple[object, ...]
    numpy: tuple[str, torch.Tensor, int, int, float]
    torch: torch.Tensor


class RngState(_RngStateOnEveryMachine, total=False):
    """One process's RNG states, as a checkpoint holds them (``cuda`` where there is a GPU)."""

    cuda: list[torch.Tensor]


def capture() -> RngState:
    """This process's RNG states, in a form ``torch.load(weights_only=True)`` reads back."""
    np_state = np.random.get_state()
    assert isinstance(np_state, tuple)  # legacy=True, the default: the 5-tuple form
    state: RngState = {
        "python": random.getstate(),
        # numpy's state holds an ndarray, which weights_only loading refuses: keep a tensor.
        "numpy": (np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


@contextlib.contextmanager
def kept() -> Iterator[None]:
    """The RNGs as they were before the block, whatever it draws (host memory only).

    CUDA's are kept only where CUDA is initialized: elsewhere no CUDA RNG has drawn, and
    reading them would start CUDA.
    """
    py, npy, cpu = random.getstate(), np.random.get_state(), torch.get_rng_state()
    started = torch.cuda.is_initialized()  # type: ignore[no-untyped-call]  # untyped in torch
    cuda = torch.cuda.get_rng_state_all() if started else None
    try:
        yield
    finally:
        random.setstate(py)
        np.random.set_state(npy)
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


def put_back(state: RngState) -> None:
    """Set this process's RNGs to what ``capture`` returned (or a checked saved copy)."""
    python = _as_tuple(state["python"])
    assert isinstance(python, tuple)  # checked: a 3-sequence
    random.setstate(python)
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])


def _as_tuple(x: object) -> object:
    # A saved python state comes back with its tuples as lists; random.setstate wants tuples.
    return tuple(_as_tuple(v) for v in x) if isinstance(x, (list, tuple)) else x


def check(rng: object, rank: int) -> None:
    """Raise CheckpointError if ``rng`` is not a state ``put_back`` can set on this machine."""
    label = f"'rng' of rank {rank}"
    if not isinstance(rng, Mapping):
        raise CheckpointError(f"damaged checkpoint: {label} is a {type(rng).__name__}, not a dict")
    for key in ("python", "numpy", "torch"):
        if key not in rng:
            raise CheckpointError(f"incomplete checkpoint: {label} has no {key!r} state")
    python, numpy_state, torch_state = rng["python"], rng["numpy"], rng["torch"]
    if not isinstance(python, (list, tuple)) or len(python) != 3:
        raise CheckpointError(
            f"damaged checkpoint: {label}'s python state is not random.getstate()'s"
        )
    if (
        not isinstance(numpy_state, (list, tuple))
        or len(numpy_state) != 5
        or not isinstance(numpy_state[1], torch.Tensor)
    ):
        raise CheckpointError(
            f"damaged checkpoint: {label}'s numpy state is not a 5-tuple with a tensor"
        )
    if not isinstance(torch_state, torch.Tensor) or torch_state.dtype != torch.uint8:
        raise CheckpointError(f"damaged checkpoint: {label}'s torch state is not a uint8 tensor")
    if "cuda" in rng:
        if not torch.cuda.is_available():
            raise CheckpointError(
                "the checkpoint holds CUDA RNG states but this machine has no GPU: resume on "
                "the kind of machine that wrote it"
            )
        if len(rng["cuda"]) > torch.cuda.device_count():
            raise CheckpointError(
                f"the checkpoint holds the RNG states of {len(rng['cuda'])} GPUs but this "
                f"process sees {torch.cuda.device_count()}: resume with the same GPUs visible"
            )


def reseeded(saved: Sequence[RngState], world: int) -> list[RngState]:
    """Fresh RNG states for ``world`` ranks, drawn from a checkpoint's (a resume on another
    number of processes, where each saved rank's streams have no rank to go to).

    Deterministic: the same checkpoint resumed on the same number of processes gives every
    rank the same streams, and no two ranks share one.
    """
    origin = hashlib.sha256(saved[0]["torch"].numpy().tobytes()).digest()
    states: list[RngState] = []
    for rank in range(world):
        seed = int.from_bytes(
            hashlib.sha256(origin + f"{rank}/{world}".encode()).digest()[:8], "little"
        )
        np_state = np.random.RandomState(seed % 2**32).get_state()
        assert isinstance(np_state, tuple)
        state: RngState = {
            "python": random.Random(seed).getstate(),
            "numpy": (np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]),
            "torch": torch.Generator().manual_seed(seed).get_state(),
        }
        if "cuda" in saved[0]:
            state["cuda"] = [
                torch.Generator(device=f"cuda:{i}").manual_seed(seed + i).get_state()
                for i in range(len(saved[0]["cuda"]))
            ]
        states.append(state)
    return states


class RngStates:
    """The RNG states piece: per rank, so the Checkpointer gathers it on save; a resume on
    another number of processes gives each rank fresh streams (``reseeded``)."""

    per_rank = True

    def state_dict(self) -> RngState:
        return capture()

    def check_state_dict(self, saved: object) -> None:
        check(saved, _ranks.world()[0])

    def snapshot(self) -> RngState:
        return capture()

    def load_state_dict(self, saved: RngState) -> None:
        put_back(saved)

    def restore(self, snapshot: RngState) -> None:
        put_back(snapshot)

    def reseeded(self, saved: Sequence[object], world: int) -> list[RngState]:
        """Every rank's state for a resume on ``world`` processes (checked first)."""
        for rank, state in enumerate(saved):
            check(state, rank)
        return reseeded(saved, world)  # type: ignore[arg-type]  # checked just above
