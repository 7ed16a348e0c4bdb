"""``loopkit.distributed.materialize``: give a model built on ``torch.device("meta")`` (and
sharded, or not) real storage and its initial values, equal to a CPU build with the same seed.

A CPU build draws each tensor's values from the CPU generator, whole, in construction order.
Each rank here holds only its shard, so every draw is made on the CPU over the tensor's whole
shape, in the same order, and the rank keeps its slice: the generator advances as in the CPU
build and the values are the CPU build's, on any device. The host holds the whole tensors of
one module (or one tensor, with ``init=``) at a time, never the whole model.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from .._job import info
from .._types import DeviceLike
from . import _other_inits

Init = Callable[[nn.Module], object]
_Slot = tuple[nn.Module, str, str, bool]  # module, its name in the model, tensor name, is_param


def _slots(model: nn.Module) -> list[_Slot]:
    """Every parameter and buffer of ``model`` where it is registered (a tied one once per
    module that holds it), modules in ``model.modules()`` order."""
    out: list[_Slot] = []
    for path, module in model.named_modules():
        out += [(module, path, n, True) for n, p in module._parameters.items() if p is not None]
        out += [(module, path, n, False) for n, b in module._buffers.items() if b is not None]
    return out


def _tensor(slot: _Slot) -> torch.Tensor:
    module, _, name, is_param = slot
    found = (module._parameters if is_param else module._buffers)[name]
    assert found is not None
    return found


def _where(slot: _Slot) -> str:
    return f"{slot[1]}.{slot[2]}" if slot[1] else slot[2]


def _storage(t: torch.Tensor) -> int:
    """The identity of ``t``'s memory (a view shares its base's; a DTensor: its shard's)."""
    local = getattr(t, "_local_tensor", t)
    return int(local.untyped_storage()._cdata)


def on_meta(model: nn.Module) -> bool:
    """Whether ``model``'s tensors are all on the meta device (False: none is); a model with
    some on meta and some not is refused (materializing would drop the real ones)."""
    slots = _slots(model)
    meta = [s for s in slots if _tensor(s).is_meta]
    if meta and len(meta) != len(slots):
        real = next(s for s in slots if not _tensor(s).is_meta)
        raise ValueError(
            f"{_where(meta[0])} is on the meta device but {_where(real)} is on "
            f"{_tensor(real).device}: build the whole model under torch.device('meta') (or none "
            "of it); materializing replaces every tensor, which would drop the real values"
        )
    return bool(meta)


def check(model: nn.Module, init: Init | None) -> bool:
    """Refuse, before anything changes, a model that ``materialize`` could not initialize
    fully; returns whether ``model`` is on the meta device (False: nothing to do)."""
    if init is not None and not callable(init):
        raise TypeError(f"init= takes a function of the model, got {type(init).__name__}")
    if not on_meta(model):
        if init is not None:
            raise ValueError(
                "init= initializes a model built under torch.device('meta'), but this model "
                "already holds its values: drop init=, or build the model on the meta device"
            )
        return False
    for slot in _slots(model):
        placements = getattr(_tensor(slot), "placements", None)  # a DTensor's (sharded)
        if placements is not None and not _splits_locally():
            for placement in placements:
                _placement_kind(placement, _where(slot))
    if init is None:
        _check_own_init(model)
    return True


def _check_own_init(model: nn.Module) -> None:
    """Each module holding tensors has a ``reset_parameters()`` that writes them all and no
    other module's: a dry run on meta tensors (no values, no draws) records its writes; and
    the model initializes itself no other way (``_other_inits``)."""
    _other_inits.refuse_other_inits(model)
    slots = _slots(model)
    owners: dict[int, str] = {}
    for slot in slots:
        key, where = _storage(_tensor(slot)), _where(slot)
        if owners.setdefault(key, where) != where:
            raise ValueError(
                f"{where} is the same tensor as {owners[key]} (tied): the modules' own "
                "reset_parameters() cannot say which initial values it keeps. Pass "
                "init=fn(model) that initializes it once (fn runs on the sharded model)"
            )
    for module, path, slots_here in _by_module(slots):
        name = f"{path or 'the model'} ({type(module).__name__})"
        reset = getattr(module, "reset_parameters", None)
        if not callable(reset):
            raise ValueError(
                f"{name} holds {', '.join(s[2] for s in slots_here)} but has no "
                "reset_parameters(), so a model built on the meta device cannot be given its "
                "initial values: add reset_parameters() to the class, or pass init=fn(model) "
                "(as torchtitan's init_weights) that initializes every parameter and buffer"
            )
        full = {s[2]: torch.empty(_tensor(s).shape, dtype=_tensor(s).dtype, device="meta")
                for s in slots_here}  # fmt: skip
        with torch.random.fork_rng(devices=[]), _Writes() as writes:  # a draw on CPU: undone
            _with_tensors(module, slots_here, full, reset)
        mine = {_storage(t) for t in full.values()}
        missed = [n for n, t in full.items() if _storage(t) not in writes.storages]
        foreign = (writes.storages - mine) & set(owners)
        if missed or foreign:
            what = (f"does not write {', '.join(missed)}" if missed else
                    f"writes {owners[next(iter(foreign))]}, another module's tensor")  # fmt: skip
            raise ValueError(
                f"{name}.reset_parameters() {what}, so materializing with it would not "
                "reproduce the model built on the CPU. Pass init=fn(model) that initializes "
                "every parameter and buffer (fn runs on the sharded model)"
            )


def _by_module(slots: list[_Slot]) -> Iterator[tuple[nn.Module, str, list[_Slot]]]:
    """``slots`` grouped by the module that holds them, in order."""
    groups: dict[int, tuple[nn.Module, str, list[_Slot]]] = {}
    for slot in slots:
        groups.setdefault(id(slot[0]), (slot[0], slot[1], []))[2].append(slot)
    yield from groups.values()


def _with_tensors(
    module: nn.Module, slots: list[_Slot], full: dict[str, torch.Tensor], fn: Callable[[], object]
) -> None:
    """Run ``fn`` with ``module``'s own tensors replaced by ``full`` (by name); put back after."""
    kept = {s[2]: _tensor(s) for s in slots}
    try:
        for module_, _, name, is_param in slots:
            if is_param:
                module_._parameters[name] = nn.Parameter(full[name], kept[name].requires_grad)
            else:
                module_._buffers[name] = full[name]
        with torch.no_grad():
            fn()
    finally:
        for module_, _, name, is_param in slots:
            if is_param:
                module_._parameters[name] = kept[name]  # type: ignore[assignment]  # as found
            else:
                module_._buffers[name] = kept[name]


def _keep_my_part(target: torch.Tensor, full: torch.Tensor) -> None:
    """Write this rank's part of ``full`` (the whole tensor, on the CPU) into ``target``."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    with torch.no_grad():
        if isinstance(target, DTensor):
            local = target.to_local()
            if _splits_locally():
                # src_data_rank=None: each rank splits its own copy, no communication. On a
                # GPU mesh the whole tensor is copied there first (one tensor at a time).
                part = distribute_tensor(full, target.device_mesh, target.placements,
                                         src_data_rank=None).to_local()  # fmt: skip
            else:
                part = _my_slice(full, target.device_mesh, target.placements)
            if part.shape != local.shape:  # copy_ would broadcast a 1-row part silently
                raise RuntimeError(
                    f"this rank's part of a {tuple(full.shape)} tensor is {tuple(part.shape)} "
                    f"but its shard is {tuple(local.shape)}: the placements "
                    f"{target.placements} split it otherwise than this torch's DTensor does"
                )
            local.copy_(part)
        else:
            target.copy_(full)


@functools.cache
def _splits_locally() -> bool:
    """Whether ``distribute_tensor`` splits without communication (``src_data_rank=None``,
    torch >= 2.7); older torch: ``_my_slice``."""
    from torch.distributed.tensor import distribute_tensor

    return "src_data_rank" in inspect.signature(distribute_tensor).parameters


def _my_slice(full: torch.Tensor, mesh: Any, placements: Sequence[Any]) -> torch.Tensor:
    """This rank's part of ``full`` under ``placements`` (``Replicate`` or ``Shard``), as
    DTensor splits: per mesh dimension, ``torch.chunk``'s pieces (ceil-sized, the last ones
    short or empty) along the shard dimension, the piece at this rank's mesh coordinate."""
    coordinate = mesh.get_coordinate()
    part = full
    for i, placement in enumerate(placements):
        if _placement_kind(placement, "a tensor") == "replicate":
            continue
        dim = placement.dim % full.ndim
        length, pieces = part.size(dim), mesh.size(i)
        size = -(-length // pieces)  # torch.chunk's piece size
        start = min(coordinate[i] * size, length)
        part = part.narrow(dim, start, min(size, length - start))
    return part


def _placement_kind(placement: object, where: str) -> str:
    """``"replicate"`` or ``"shard"``: the placements ``_my_slice`` splits by; refuses others."""
    from torch.distributed.tensor import Replicate, Shard

    if isinstance(placement, Replicate):
        return "replicate"
    if type(placement) is Shard:
        return "shard"
    raise ValueError(
        f"{where} is placed {placement!r}: materializing it needs torch >= 2.7 "
        "(distribute_tensor's src_data_rank=None); this torch's fallback splits Shard(dim) "
        "and Replicate() only: "
        "upgrade torch, or pass a model sharded by FSDP2 alone"
    )


def _own_init(model: nn.Module) -> None:
    """Each module's ``reset_parameters()`` on whole CPU tensors, in module order, then each
    rank keeps its part: the draws of the CPU build, in its order."""
    for module, _, slots in _by_module(_slots(model)):
        full = {s[2]: torch.empty(_tensor(s).shape, dtype=_tensor(s).dtype) for s in slots}
        reset = module.reset_parameters
        assert callable(reset)  # check() refused a module without one
        _with_tensors(module, slots, full, reset)
        for slot in slots:
            _keep_my_part(_tensor(slot), full[slot[2]])


_DRAWS = {"uniform_", "normal_", "bernoulli_", "random_", "exponential_", "log_normal_",
          "cauchy_", "geometric_"}  # fmt: skip


class _Writes(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch: unannotated
    """Records the memory each op writes (every argument the op's schema marks as written)."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # torch: unannotated
        self.storages: set[int] = set()

    def note(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        for i, arg in enumerate(func._schema.arguments):
            if arg.alias_info is None or not arg.alias_info.is_write:
                continue
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            if isinstance(value, torch.Tensor):
                self.storages.add(_storage(value))

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        self.note(func, args, kwargs)
        return func(*args, **kwargs)


class _CpuDraws(_Writes):  # type: ignore[no-untyped-call]  # torch: unannotated
    """Records writes, and makes each random fill of a shard or of a device tensor on the CPU
    over the whole tensor (the CPU build's draw), keeping this rank's part."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        self.note(func, args, kwargs)
        target = args[0] if args else None
        generator = kwargs.get("generator")
        if (func.overloadpacket.__name__ in _DRAWS and isinstance(target, torch.Tensor)
                and (hasattr(target, "device_mesh") or target.device.type != "cpu")
                and (generator is None or generator.device.type == "cpu")):  # fmt: skip
            full = torch.empty(target.shape, dtype=target.dtype)
            func(full, *args[1:], **kwargs)
            _keep_my_part(target, full)
            return target
        return func(*args, **kwargs)


def _user_init(model: nn.Module, init: Init) -> None:
    """``init(model)`` on the materialized model, its draws the CPU build's; every parameter
    and buffer must be written (or replaced) by it."""
    from torch.distributed.tensor.experimental import implicit_replication

    before = {_where(s): _tensor(s) for s in _slots(model)}
    with torch.no_grad(), implicit_replication(), _CpuDraws() as writes:
        init(model)
    missed = [where for where, t in before.items()
              if _storage(t) not in writes.storages and _tensor_at(model, where) is t]  # fmt: skip
    if missed:
        raise ValueError(
            f"init= left {', '.join(missed[:5])}{' ...' if len(missed) > 5 else ''} unwritten "
            "(their memory is uninitialized after to_empty): make init initialize every "
            "parameter and buffer, e.g. call each module's reset_parameters() and fill the "
            "buffers the model computes in __init__"
        )


def _tensor_at(model: nn.Module, where: str) -> torch.Tensor | None:
    path, _, name = where.rpartition(".")
    module = model.get_submodule(path)
    found = module._parameters.get(name)
    return found if found is not None else module._buffers.get(name)


def _move_buffers(model: nn.Module, device: torch.device) -> None:
    """Buffers ``init`` replaced with tensors elsewhere (a table computed on the CPU) move to
    the model's device, as ``model.to(device)`` would have moved them."""
    for module in model.modules():
        for name, buf in module._buffers.items():
            if buf is not None and buf.device != device:
                module._buffers[name] = buf.to(device)


def materialize(
    model: nn.Module, init: Init | None = None, *, device: DeviceLike | None = None
) -> nn.Module:
    """Give ``model``, built under ``torch.device("meta")`` and then sharded with
    ``fully_shard`` (or not), storage on ``device`` (this process's device by default) and
    its initial values; returns it. See docs/distributed.md#models-too-big-to-build-on-one-device.

    ``init=None``: each module holding tensors runs its own ``reset_parameters()`` (as every
    ``torch.nn`` layer does when built), in ``model.modules()`` order; ``init=fn``: ``fn(model)``
    instead, on the sharded model (as torchtitan's ``init_weights``); a model that
    initializes itself otherwise (``_init_weights``, ``post_init``...) needs ``init=``, and
    is refused without it, before anything changes. Either way each random
    draw is made on the CPU over the whole tensor and each rank keeps its part, so the values
    equal the model built on the CPU with the same seed. A model that cannot be initialized
    fully is refused before anything changes; if ``init`` fails, the model is left on meta.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"materialize() takes an nn.Module, got {type(model).__name__}")
    if not check(model, init):
        raise ValueError(
            "the model is not on the meta device: materialize() gives storage and values to "
            "a model built under torch.device('meta'); this one already has them"
        )
    return fill(model, init, torch.device(device) if device is not None else info().device)


def fill(model: nn.Module, init: Init | None, place: torch.device) -> nn.Module:
    """``materialize``'s work, for a model ``check`` passed (wrap checks before sharding)."""
    rng = torch.get_rng_state()
    model.to_empty(device=place)
    try:
        if init is None:
            _own_init(model)
        else:
            _user_init(model, init)
            _move_buffers(model, place)
    except BaseException:
        with contextlib.suppress(Exception):  # back to meta: as if never called
            model.to_empty(device="meta")
        torch.set_rng_state(rng)
        raise
    return model
