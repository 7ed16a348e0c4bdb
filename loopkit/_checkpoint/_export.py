"""The weights out of a checkpoint: one full ``state_dict`` of the model (or of an EMA).

For inference, or another library: ``loopkit.export_weights(checkpoint)`` reads a
checkpoint, a sharded model's directory included, in this one process (no process group,
any number of ranks wrote it), gathering each sharded tensor whole from its shards. The
command ``python -m loopkit.export CHECKPOINT OUT [--ema [K]]`` writes the result with
``torch.save`` (a file ``torch.load(..., weights_only=True)`` reads).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from .._errors import CheckpointError
from . import _files as files
from . import _sharded


def export_weights(
    checkpoint: str | os.PathLike[str], *, ema: bool | int = False
) -> dict[str, torch.Tensor]:
    """The model's weights and buffers in ``checkpoint``, whole, by the model's own names.

    ``ema=True`` (or the index of one of a step's several averages): the average instead,
    its parameters and the buffers copied with it. A sharded checkpoint's tensors are
    gathered from every rank's shards in this one process."""
    if not isinstance(ema, (bool, int)):
        raise TypeError(
            f"ema must be False, True or the index (an int >= 0) of one of the averages, got "
            f"{ema!r}"
        )
    if not isinstance(ema, bool) and ema < 0:
        raise ValueError(
            f"ema must be False, True or the index of one of the averages, counted from 0 (no "
            f"negative index), got {ema!r}"
        )
    path = Path(checkpoint)
    state = files.load_checkpoint(path)
    chosen = _chosen(state, ema, path)
    wanted = _sharded.placeholders(chosen)
    whole: dict[str, torch.Tensor] = {}
    if wanted:
        whole = {key: torch.empty(info["shape"], dtype=_dtype(info["dtype"]))
                 for key, info in wanted.items()}  # fmt: skip
        _read_whole(path, whole)
    filled = _sharded.filled(chosen, whole) if wanted else chosen
    assert isinstance(filled, Mapping)
    out = {str(k): v for k, v in filled.items() if isinstance(v, torch.Tensor)}
    if len(out) != len(filled):
        raise CheckpointError(f"{path}: damaged checkpoint: its weights are not all tensors")
    return out


def _chosen(state: Mapping[str, Any], ema: bool | int, path: Path) -> Mapping[str, Any]:
    """The part of a checkpoint's state to export: the model, or an average's weights."""
    if ema is False:
        model = state.get("model")
        if not isinstance(model, Mapping):
            raise CheckpointError(f"{path}: damaged checkpoint: no model state")
        return model
    averages = _averages(state)
    index = 0 if ema is True else int(ema)
    if not averages:
        raise CheckpointError(
            f"{path}: the checkpoint holds no ema (give it to the step, ema=, or to the "
            "Checkpointer under extra=)"
        )
    if not 0 <= index < len(averages):
        raise CheckpointError(f"{path}: ema={ema} but the checkpoint holds {_held(len(averages))}")
    return _averaged_model(averages[index], state.get("model"))


def _averaged_model(chosen: Mapping[str, Any], model: object) -> Mapping[str, Any]:
    """An average as its model's whole state_dict, in the model's key order: the average
    holds only the trainable parameters, so a frozen one is the model's own tensor (the
    average leaves it as is), and a tied one (the same storage under two keys) is its
    twin's average."""
    shadow, buffers = chosen["shadow"], chosen["buffers"]
    if not isinstance(model, Mapping):
        return {**buffers, **shadow}
    twins: dict[tuple[Any, ...], Any] = {}
    for key in shadow:
        if isinstance(model.get(key), torch.Tensor):
            twins[_place(model[key])] = shadow[key]
    out: dict[str, Any] = {}
    for key, value in model.items():
        if key in shadow or key in buffers:
            out[key] = shadow[key] if key in shadow else buffers[key]
        elif isinstance(value, torch.Tensor) and _place(value) in twins:
            out[key] = twins[_place(value)]  # tied to an averaged parameter
        else:
            out[key] = value  # a frozen parameter (or a buffer saved before they were)
    return {**out, **{k: v for k, v in shadow.items() if k not in out}}


def _place(t: torch.Tensor) -> tuple[Any, ...]:
    """Where a loaded tensor's data lives: tensors saved as one share it when loaded."""
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride())


def _held(n: int) -> str:
    """The averages a checkpoint holds, as the ``ema=`` values that pick them."""
    if n == 1:
        return "1 average: ema=0 (or True)"
    picks = " or ".join(f"ema={k}" for k in range(n)) if n <= 4 else f"ema=0 to ema={n - 1}"
    return f"{n} averages: {picks} (or True for the first)"


def _averages(state: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The EMA states a checkpoint holds: with the step (each member's), then under extra=."""
    found: list[Mapping[str, Any]] = []
    step = state.get("step")
    members = [step] if isinstance(step, Mapping) else []
    if isinstance(step, Mapping) and isinstance(step.get("steps"), list):
        members = [m for m in step["steps"] if isinstance(m, Mapping)]
    for member in members:
        saved = member.get("ema")
        found += [saved] if isinstance(saved, Mapping) else list(saved or [])
    extra = state.get("extra")
    if isinstance(extra, Mapping):
        found += [v for v in extra.values() if isinstance(v, Mapping) and "shadow" in v]
    return [e for e in found if isinstance(e, Mapping) and "shadow" in e and "buffers" in e]


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"damaged checkpoint: unknown dtype {name!r}")
    return dtype


def _read_whole(path: Path, whole: dict[str, torch.Tensor]) -> None:
    """Read each tensor whole from its shards, in this process alone (no process group)."""
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict_loader import load

    try:
        with _sharded.single_process_read():
            load(whole, checkpoint_id=str(path), no_dist=True)
    except CheckpointException as err:
        raise CheckpointError(f"{path}: unreadable (its shards are incomplete or corrupt)") from err


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m loopkit.export CHECKPOINT OUT [--ema [K]]``."""
    parser = argparse.ArgumentParser(
        prog="python -m loopkit.export",
        description="Write the full state_dict of a checkpoint's model (or EMA) to one file.",
    )
    parser.add_argument("checkpoint", help="a checkpoint file, or a sharded model's directory")
    parser.add_argument("out", help="the file to write (torch.save; weights_only loads it)")
    parser.add_argument(
        "--ema", nargs="?", const=0, type=int, default=None, metavar="K",
        help="the average (the K-th of several) instead of the weights",
    )  # fmt: skip
    args = parser.parse_args(argv)
    weights = export_weights(args.checkpoint, ema=False if args.ema is None else args.ema)
    torch.save(weights, args.out)
    print(f"{len(weights)} tensors -> {args.out}")
    return 0
