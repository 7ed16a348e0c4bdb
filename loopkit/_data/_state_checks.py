"""Whether a saved loader state can be loaded into a loader: the same data, batches and
order (mid-pass), a valid generator state; from another number of processes, the same
global batches (``resharded``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from .._checks import is_int_at_least
from ._seeding import KeyedBatches


def check_state(
    state: object, here: KeyedBatches, batches: int, generator: torch.Generator | None
) -> None:
    """Raise ValueError saying what is wrong if ``state`` cannot be loaded into a loader of
    ``batches`` per pass batched by ``here`` with ``generator``."""
    if not isinstance(state, Mapping):
        raise ValueError(f"a loader state must be a dict, got {type(state).__name__}")
    for key in ("epoch", "position", "next_epoch", "dataset_length", "samples", "batches"):
        if key not in state:
            raise ValueError(f"the loader state has no {key!r} entry (incomplete)")
        if not is_int_at_least(state[key], 0):
            raise ValueError(f"the loader state's {key!r} must be an int >= 0, got {state[key]!r}")
    if "batch_size" not in state:
        raise ValueError("the loader state has no 'batch_size' entry (incomplete)")
    if not isinstance(state.get("epoch_open", False), bool):
        raise ValueError(
            f"the loader state's 'epoch_open' must be a bool, got {state['epoch_open']!r}"
        )
    if state["dataset_length"] != here.dataset_length:
        raise ValueError(
            f"the data set has {here.dataset_length} samples but the state was "
            f"saved with {state['dataset_length']}: resuming would repeat some samples and "
            "skip others; resume with the data set the run was saved with"
        )
    saved_world = state.get("world_size", here.world_size)
    if saved_world != here.world_size:
        resharded(state, here, batches)
    elif state["batch_size"] != here.batch_size:
        raise ValueError(
            f"the loader's batch size is {here.batch_size} but the state was saved "
            f"with {state['batch_size']}: build the loader with the same batch size"
        )
    shape = (here.samples, batches)
    if saved_world == here.world_size and (state["samples"], state["batches"]) != shape:
        raise ValueError(
            f"this loader's pass has {shape[0]} samples in {shape[1]} batches but the state "
            f"was saved from one with {state['samples']} in {state['batches']}: resume with "
            "the same number of processes, drop_last and batch size"
        )
    if state["position"] > state["batches"]:
        raise ValueError(
            f"the loader state's position {state['position']} is past the end of a pass of "
            f"{state['batches']} batches"
        )
    if 0 < state["position"] < state["batches"]:
        _check_order(state, here)
    saved = state.get("generator")
    if saved is not None and generator is not None:
        if not isinstance(saved, torch.Tensor) or saved.dtype != torch.uint8:
            raise ValueError(
                "the loader state's 'generator' must be a uint8 tensor from "
                f"torch.Generator.get_state(), got {type(saved).__name__}"
            )
        try:  # on a scratch generator: this loader's stays untouched if it is refused
            torch.Generator(device=generator.device).set_state(saved)
        except (RuntimeError, ValueError, TypeError) as err:
            raise ValueError(f"the loader state's 'generator' is not a valid state: {err}") from err


def _check_order(state: Mapping[str, Any], here: KeyedBatches) -> None:
    """Refuse a mid-pass state whose pass was drawn in another order than this loader's."""
    wanted = {"seed": here.seed, "shuffle": here.shuffle}
    # A state saved before these were recorded says nothing of them: not checked.
    saved = {k: state[k] for k in wanted if k in state}
    for key, value in saved.items():
        if key == "seed" and (isinstance(value, bool) or not isinstance(value, int)):
            raise ValueError(f"the loader state's 'seed' must be an int, got {value!r}")
        if key == "shuffle" and not isinstance(value, bool):
            raise ValueError(f"the loader state's 'shuffle' must be a bool, got {value!r}")
    differ = [k for k in saved if saved[k] != wanted[k]]
    if differ:
        said = ", ".join(f"{k}={saved[k]!r}" for k in differ)
        now = ", ".join(f"{k}={wanted[k]!r}" for k in differ)
        raise ValueError(
            f"the state was saved mid-pass ({state['position']} of {state['batches']} "
            f"batches) by a loader with {said}, but this loader has {now}: the rest of the "
            f"pass would come in another order (repeating some samples, skipping others) "
            f"or with other random augmentation. Build the loader with {said} to resume "
            "(another order can start at a pass's boundary)"
        )


def resharded(state: Mapping[str, Any], here: KeyedBatches, batches: int) -> None:
    """Raise ValueError unless a pass saved by another number of processes continues here
    with the same global batches (``batches``: this loader's per pass).

    Batch ``i`` of a pass, taken on every rank together, is the permutation's samples
    ``[i * G, (i + 1) * G)`` for the global batch ``G = batch_size * world_size`` (the
    sampler deals rank ``r`` every ``world_size``-th sample from ``r``; the permutation
    depends on the seed and epoch only). So with the same ``G`` the saved position, in
    batches, is the same place in the pass on any number of processes, provided the pass
    holds the same samples: with ``drop_last`` always (``n // G`` whole batches), without
    it when both pad the data set to the same length (a multiple of each number of processes).
    """
    world = here.world_size
    saved_world = state["world_size"]
    if not is_int_at_least(saved_world, 1):
        raise ValueError(
            f"the loader state's 'world_size' must be an int >= 1, got {saved_world!r}"
        )
    if not is_int_at_least(state["batch_size"], 1):
        raise ValueError(
            f"the loader state's 'batch_size' must be an int >= 1, got {state['batch_size']!r}"
        )
    saved_global = state["batch_size"] * saved_world
    if saved_global != here.batch_size * world:
        raise ValueError(
            f"the state was saved by {saved_world} process(es) with a global batch of "
            f"{saved_global} samples ({state['batch_size']} each), but this loader's is "
            f"{here.batch_size * world} ({here.batch_size} on each of {world}): build it with "
            f"loopkit.distributed.loader(..., global_batch_size={saved_global}) so that the "
            "rest of the pass takes every sample once"
            + (
                ""
                if saved_global % world == 0
                else f" (which needs a number of processes dividing {saved_global})"
            )
        )
    drop_last = state.get("drop_last")
    if drop_last is not here.drop_last:
        raise ValueError(
            f"the state was saved by {saved_world} process(es) with drop_last={drop_last!r}, "
            f"this loader has drop_last={here.drop_last}: build it with the same drop_last "
            "to resume on another number of processes"
        )
    padded = (state["samples"] * saved_world, here.samples * world)
    if not drop_last and padded[0] != padded[1]:
        n = here.dataset_length
        raise ValueError(
            f"a pass over {n} samples is padded to {padded[0]} by {saved_world} process(es) "
            f"but to {padded[1]} by {world} (the sampler repeats samples to give each "
            "process as many): the rest of the pass would hold other samples. Build the "
            "loader with drop_last=True, or resume on a number of processes that pads as "
            f"{saved_world} did (one dividing {n})"
        )
    if state["batches"] != batches:  # follows from the above; a damaged state otherwise
        raise ValueError(
            f"the state's pass has {state['batches']} batches but this loader's has "
            f"{batches}: resume with the loader the run was saved with"
        )
