"""to_device: move every tensor of a nested batch to a device, keeping the containers.

Why not ``accelerate.utils.send_to_device``: it calls ``.to`` on *anything* with a ``to``
method (an ``nn.Module`` inside a batch would be moved), rebuilds dataclasses not at all
and ``defaultdict`` not correctly, uses one ``non_blocking`` flag for every tensor whatever
its memory (a non-blocking device-to-host copy is unsafe), and has no place for on-device
conversion. The traversal here is small, so loopkit owns it.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import functools
from collections.abc import (
    Callable,
    Mapping,
    MutableMapping,
    MutableSequence,
    MutableSet,
    Sequence,
)
from typing import Any, ParamSpec, TypeVar, cast, overload

import torch

from .._devices import resolve_device
from .._types import DeviceLike

T = TypeVar("T")
P = ParamSpec("P")
R = TypeVar("R")

_UINT8_SCALE = 1.0 / 255.0


class Mover:
    """One configured transfer: built once, applied to every batch."""

    __slots__ = (
        "_as_is", "_cpu", "channels_last", "device", "mean", "non_blocking", "std", "uint8_dtype",
    )  # fmt: skip

    def __init__(
        self,
        device: DeviceLike,
        non_blocking: bool | None,
        uint8_to: torch.dtype | None,
        normalize: tuple[Sequence[float], Sequence[float]] | None,
        channels_last: bool,
    ) -> None:
        self.device = resolve_device(device)
        if non_blocking is not None and not isinstance(non_blocking, bool):
            raise TypeError(
                f"non_blocking must be None, True or False, got {non_blocking!r}: "
                "None picks non-blocking exactly when it is safe"
            )
        if non_blocking and self.device.type == "cpu":
            raise ValueError(
                "non_blocking=True to a CPU target is unsafe: the host may read the tensor before "
                "the device-to-host copy has ended. Pass non_blocking=None (the default), which "
                "uses non-blocking copies only from pinned host memory to an accelerator"
            )
        self.non_blocking = non_blocking
        if uint8_to is not None and (
            not isinstance(uint8_to, torch.dtype) or not uint8_to.is_floating_point
        ):
            raise ValueError(
                f"uint8_to must be a floating torch.dtype such as torch.float32 or "
                f"torch.bfloat16, got {uint8_to!r}"
            )
        if normalize is not None and uint8_to is None:
            raise ValueError(
                "normalize=(mean, std) applies to uint8 images converted on the device: "
                "also pass uint8_to=torch.float32 (or another floating dtype)"
            )
        self.uint8_dtype = uint8_to
        self.mean: torch.Tensor | None = None
        self.std: torch.Tensor | None = None
        if normalize is not None:
            self.mean, self.std = self._channel_stats(normalize, uint8_to)
        if not isinstance(channels_last, bool):
            raise TypeError(f"channels_last must be True or False, got {channels_last!r}")
        self.channels_last = channels_last
        # Nothing to convert: a tensor already on the device is handed out as it is.
        self._as_is = uint8_to is None and not channels_last
        self._cpu = self.device.type == "cpu"

    def _channel_stats(
        self, normalize: object, dtype: torch.dtype | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not (isinstance(normalize, (tuple, list)) and len(normalize) == 2):
            raise ValueError(
                "normalize must be a pair (mean, std) of per-channel sequences on the 0..1 "
                f"scale, e.g. ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)); got {normalize!r}"
            )
        mean = torch.as_tensor(normalize[0], dtype=torch.float32).flatten()
        std = torch.as_tensor(normalize[1], dtype=torch.float32).flatten()
        if mean.numel() != std.numel():
            raise ValueError(
                f"normalize: mean has {mean.numel()} channels but std has {std.numel()}"
            )
        if not bool((std > 0).all()) or not bool(torch.isfinite(mean).all()):
            raise ValueError(f"normalize: std must be > 0 and mean finite, got {normalize!r}")
        # Channels sit third from the end in both (C, H, W) and (N, C, H, W).
        shape = (-1, 1, 1)
        return (
            mean.view(shape).to(self.device, dtype),
            std.view(shape).to(self.device, dtype),
        )

    def tensor(self, t: torch.Tensor) -> torch.Tensor:
        # Per tensor per batch: no .to() call (and on a CPU step, no device object made).
        if self._as_is and (t.is_cpu if self._cpu else t.device == self.device):
            return t
        nb = self.non_blocking
        if nb is None:
            # Non-blocking only helps host-to-accelerator copies from pinned memory, and is only
            # safe in that direction.
            nb = t.device.type == "cpu" and self.device.type != "cpu" and t.is_pinned()
        out = t.to(self.device, non_blocking=nb)
        if self.uint8_dtype is not None and out.dtype == torch.uint8:
            # Sent as uint8 (4x fewer bytes than float32); converted on the device.
            out = out.to(self.uint8_dtype).mul_(_UINT8_SCALE)
            if self.mean is not None and self.std is not None:
                if out.dim() < 3 or out.shape[-3] != self.mean.shape[0]:
                    raise ValueError(
                        f"normalize has {self.mean.shape[0]} channels but a uint8 tensor of "
                        f"shape {tuple(out.shape)} has no matching channel axis (expected "
                        "(C, H, W) or (N, C, H, W))"
                    )
                out = out.sub_(self.mean).div_(self.std)
        if self.channels_last and out.is_floating_point():
            if out.dim() == 4:
                out = out.contiguous(memory_format=torch.channels_last)
            elif out.dim() == 5:
                out = out.contiguous(memory_format=torch.channels_last_3d)
        return out

    def move(self, batch: T) -> T:
        """``batch`` with every tensor moved, as its own type."""
        # cast: __call__ rebuilds each container as its own type, which its branches' types
        # cannot express one by one.
        return cast(T, self(batch))

    # Any: ``obj`` comes back as its own type, which no annotation per branch can say.
    def __call__(self, obj: object) -> Any:
        if isinstance(obj, torch.Tensor):
            return self.tensor(obj)
        if (type(obj) is tuple or type(obj) is list) and self._as_is:
            # Per batch, the usual case on a CPU step (or a loader already on the device):
            # every item a plain tensor already there, so no walk (the check inline: it runs
            # per batch); a list is still handed out as a copy.
            cpu, device = self._cpu, self.device
            for v in obj:  # a loop, not all(...): batches hold two or three tensors
                if type(v) is not torch.Tensor or not (v.is_cpu if cpu else v.device == device):
                    break
            else:
                return obj if type(obj) is tuple else list(obj)
        if isinstance(obj, (str, bytes, int, float, bool)) or obj is None:
            return obj
        if isinstance(obj, Mapping):
            items = {k: self(v) for k, v in obj.items()}
            if isinstance(obj, MutableMapping):
                # A copy keeps what the type carries besides its items (defaultdict's
                # factory, a UserDict subclass's attributes); the user's mapping is never
                # written to.
                new = unshared_copy(obj)
                for k, v in items.items():
                    new[k] = v
                return new
            # An immutable mapping (a MappingProxyType, say) is rebuilt from a dict;
            # the Mapping ABC declares no constructor.
            return type(obj)(items)  # type: ignore[call-arg]  # Mapping declares no constructor
        if isinstance(obj, tuple):
            moved = [self(v) for v in obj]
            if hasattr(obj, "_fields"):  # namedtuple
                return type(obj)(*moved)
            return tuple(moved) if type(obj) is tuple else type(obj)(moved)
        if isinstance(obj, list):
            moved_list = [self(v) for v in obj]
            return moved_list if type(obj) is list else type(obj)(moved_list)
        if isinstance(obj, (set, frozenset, MutableSet)):
            # Tensors hash by identity, so the moved ones make a set of the same size.
            moved_set = [self(v) for v in obj]
            if type(obj) is set:
                return set(moved_set)
            if isinstance(obj, frozenset):
                return frozenset(moved_set) if type(obj) is frozenset else type(obj)(moved_set)
            new_set = unshared_copy(obj)
            new_set.clear()
            for v in moved_set:
                new_set.add(v)
            return new_set
        if isinstance(obj, MutableSequence) and not isinstance(obj, bytearray):
            # deque (its maxlen kept by the copy), UserList and other mutable sequences.
            moved_seq = [self(v) for v in obj]
            if type(obj) is collections.deque:
                return collections.deque(moved_seq, maxlen=obj.maxlen)
            new_seq = unshared_copy(obj)
            new_seq.clear()
            new_seq.extend(moved_seq)
            return new_seq
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            new_obj = copy.copy(obj)
            for f in dataclasses.fields(obj):
                # object.__setattr__ also works on frozen dataclasses and init=False fields.
                object.__setattr__(new_obj, f.name, self(getattr(obj, f.name)))
            return new_obj
        return obj


# Where a container type keeps its items when they are not the object itself (dict, list,
# set and deque are among these).
_STORAGE = (MutableMapping, MutableSequence, MutableSet)


def unshared_copy(obj: T) -> T:
    """A shallow copy of ``obj`` whose item storage is its own: writing to it leaves ``obj`` alone.

    ``copy.copy`` of a container that keeps its items in an attribute (``self._data =
    {}``) shares that attribute with the original; any such mutable container attribute
    is copied too, one level down.
    """
    try:
        new = copy.copy(obj)
    except Exception as err:
        raise TypeError(
            f"cannot copy a {type(obj).__name__} to hold the batch's new tensors ({err}); "
            "pass a dict, list or tuple instead, or give the type a working __copy__"
        ) from err
    if isinstance(obj, (dict, list, set, collections.deque)):
        return new  # the items live in the object itself, which the copy does not share
    state = getattr(new, "__dict__", None)
    original = getattr(obj, "__dict__", None)
    if state is not None and original is not None and state is not original:
        for name, value in list(state.items()):
            if isinstance(value, _STORAGE) and original.get(name) is value:
                state[name] = copy.copy(value)
    for cls in type(obj).__mro__:
        slots = cls.__dict__.get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            value = getattr(new, name, None)
            if isinstance(value, _STORAGE) and getattr(obj, name, None) is value:
                object.__setattr__(new, name, copy.copy(value))
    return new


@overload
def to_device(
    obj: DeviceLike,
    /,
    *,
    non_blocking: bool | None = ...,
    uint8_to: torch.dtype | None = ...,
    normalize: tuple[Sequence[float], Sequence[float]] | None = ...,
    channels_last: bool = ...,
) -> Callable[[Callable[P, R]], Callable[P, R]]: ...
@overload
def to_device(
    obj: T,
    device: DeviceLike,
    /,
    *,
    non_blocking: bool | None = ...,
    uint8_to: torch.dtype | None = ...,
    normalize: tuple[Sequence[float], Sequence[float]] | None = ...,
    channels_last: bool = ...,
) -> T: ...
def to_device(
    obj: object,
    device: DeviceLike | None = None,
    /,
    *,
    non_blocking: bool | None = None,
    uint8_to: torch.dtype | None = None,
    normalize: tuple[Sequence[float], Sequence[float]] | None = None,
    channels_last: bool = False,
) -> object:
    """Move every tensor in ``obj`` to ``device``; ``@to_device(device)`` moves a function's args.

    Containers (dict and other mappings, list, tuple, namedtuple, deque, set, frozenset,
    dataclass) keep their types and are copied, never changed in place; non-tensors are
    returned as they are. ``non_blocking=None`` copies
    asynchronously exactly when it is safe and useful: a pinned CPU tensor going to an
    accelerator. ``uint8_to=dtype`` converts uint8 tensors to that floating dtype on the
    device, scaled to 0..1 (send images as uint8: 4x fewer bytes), and
    ``normalize=(mean, std)`` then normalizes their channel axis (``(C,H,W)`` or
    ``(N,C,H,W)``). ``channels_last=True`` gives floating 4-D (and 5-D) tensors the
    channels-last memory format.
    """
    if device is None:
        # One argument: the decorator form, to_device(device).
        if isinstance(obj, (str, int, torch.device)) and not isinstance(obj, bool):
            mover = Mover(obj, non_blocking, uint8_to, normalize, channels_last)
            return _decorator(mover)
        raise TypeError(
            "to_device needs a device: call to_device(obj, device) to move obj, or use "
            f"@to_device(device) as a decorator (got a single {type(obj).__name__} argument)"
        )
    return Mover(device, non_blocking, uint8_to, normalize, channels_last)(obj)


def _decorator(mover: Mover) -> Callable[[Callable[P, R]], Callable[P, R]]:
    def decorate(fn: Callable[P, R]) -> Callable[P, R]:
        if not callable(fn):
            raise TypeError(f"@to_device(device) decorates a function, got {fn!r}")

        @functools.wraps(fn)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
            moved_args = mover(args)
            moved_kwargs = {k: mover(v) for k, v in kwargs.items()}
            return fn(*moved_args, **moved_kwargs)

        return wrapper

    return decorate
