"""to_device: nested containers keep their types, tensors move, options act on the device."""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterator
from typing import Any, NamedTuple

import pytest
import torch
from helpers import Store, requires_cuda
from torch.overrides import TorchFunctionMode

import loopkit


class Pair(NamedTuple):
    x: torch.Tensor
    y: torch.Tensor


@dataclasses.dataclass
class Batch:
    image: torch.Tensor
    label: torch.Tensor
    name: str = "b"


@dataclasses.dataclass(frozen=True)
class Frozen:
    x: torch.Tensor


def test_nested_containers_keep_types_and_non_tensors() -> None:
    """Every container type comes back as itself; non-tensors are the same objects."""
    module = torch.nn.Linear(2, 2)
    dd: collections.defaultdict[str, Any] = collections.defaultdict(list, a=torch.ones(1))
    obj = {
        "pair": Pair(torch.ones(2), torch.zeros(2)),
        "list": [torch.ones(1), "text", 3, None],
        "tuple": (torch.ones(1), 2.5),
        "dd": dd,
        "od": collections.OrderedDict(b=torch.ones(1)),
        "dc": Batch(torch.ones(2), torch.zeros(2)),
        "frozen": Frozen(torch.ones(1)),
        "module": module,
    }
    out = loopkit.to_device(obj, torch.device("cpu"), uint8_to=None)
    assert type(out["pair"]) is Pair and isinstance(out["pair"].x, torch.Tensor)
    assert out["list"][1:] == ["text", 3, None]
    assert type(out["tuple"]) is tuple and out["tuple"][1] == 2.5
    assert type(out["dd"]) is collections.defaultdict and out["dd"].default_factory is list
    assert type(out["od"]) is collections.OrderedDict
    assert type(out["dc"]) is Batch and out["dc"].name == "b"
    assert type(out["frozen"]) is Frozen
    assert out["module"] is module  # not moved, not copied


def test_conversion_happens_on_the_device_copy_not_the_source() -> None:
    """uint8 images become scaled floats on the target; the host tensor stays uint8."""
    img = torch.randint(0, 256, (2, 3, 4, 4), dtype=torch.uint8)
    labels = torch.tensor([1, 2])
    batch = {"img": img, "y": labels}
    out = loopkit.to_device(batch, "cpu", uint8_to=torch.float32)
    assert img.dtype == torch.uint8
    torch.testing.assert_close(out["img"], img.float() / 255, rtol=0, atol=1e-7)
    assert out["y"].dtype == torch.int64  # other integer tensors are left alone


def test_normalize_per_channel() -> None:
    """normalize=(mean, std) subtracts and divides along the channel axis."""
    img = torch.randint(0, 256, (2, 3, 5, 5), dtype=torch.uint8)
    mean, std = (0.1, 0.2, 0.3), (0.5, 0.25, 2.0)
    out = loopkit.to_device(img, "cpu", uint8_to=torch.float32, normalize=(mean, std))
    ref = (img.float() / 255 - torch.tensor(mean).view(3, 1, 1)) / torch.tensor(std).view(3, 1, 1)
    torch.testing.assert_close(out, ref)
    chw = loopkit.to_device(img[0], "cpu", uint8_to=torch.float32, normalize=(mean, std))
    torch.testing.assert_close(chw, ref[0])


def test_channels_last_only_for_4d_and_5d_floats() -> None:
    """4-D floats get channels_last; 2-D tensors and integer tensors are unchanged."""
    x4 = torch.randn(2, 3, 4, 4)
    out = loopkit.to_device({"x": x4, "m": torch.randn(3, 3)}, "cpu", channels_last=True)
    assert out["x"].is_contiguous(memory_format=torch.channels_last)
    assert not x4.is_contiguous(memory_format=torch.channels_last)
    assert out["m"].is_contiguous()
    x5 = loopkit.to_device(torch.randn(1, 2, 3, 4, 5), "cpu", channels_last=True)
    assert x5.is_contiguous(memory_format=torch.channels_last_3d)
    torch.testing.assert_close(out["x"], x4)


def test_decorator_moves_tensor_arguments() -> None:
    """@to_device(device) converts the arguments a function receives, nested ones included."""
    seen: dict[str, Any] = {}

    @loopkit.to_device("cpu", uint8_to=torch.float32)
    def f(x: torch.Tensor, batch: dict[str, torch.Tensor], scale: float = 1.0) -> float:
        seen.update(x=x, batch=batch, scale=scale)
        return scale

    assert (
        f(
            torch.ones(2, dtype=torch.uint8),
            {"y": torch.full((1,), 255, dtype=torch.uint8)},
            scale=2.0,
        )
        == 2.0
    )
    assert seen["x"].dtype == torch.float32 and seen["batch"]["y"].item() == 1.0
    assert f.__name__ == "f"


@pytest.mark.parametrize(
    ("call", "exc", "hint"),
    [
        (lambda: loopkit.to_device(torch.ones(1)), TypeError, "to_device(obj, device)"),
        (lambda: loopkit.to_device(torch.ones(1), "nodevice"), ValueError, "'cpu'"),
        (lambda: loopkit.to_device(torch.ones(1), 3.5), TypeError, "torch.device"),
        (
            lambda: loopkit.to_device(torch.ones(1), "cpu", non_blocking=True),
            ValueError,
            "non_blocking=None",
        ),
        (
            lambda: loopkit.to_device(torch.ones(1), "cpu", uint8_to=torch.int32),
            ValueError,
            "floating",
        ),
        (
            lambda: loopkit.to_device(torch.ones(1), "cpu", normalize=((0.5,), (0.5,))),
            ValueError,
            "uint8_to",
        ),
        (
            lambda: loopkit.to_device(
                torch.ones(1), "cpu", uint8_to=torch.float32, normalize=((0.5,), (0.0,))
            ),
            ValueError,
            "std must be > 0",
        ),
        (
            lambda: loopkit.to_device(
                torch.zeros(2, 4, 4, dtype=torch.uint8),
                "cpu",
                uint8_to=torch.float32,
                normalize=((0.5,) * 3, (0.5,) * 3),
            ),
            ValueError,
            "channel",
        ),
    ],
)
def test_bad_input_is_refused_with_a_fix(call: Any, exc: type[Exception], hint: str) -> None:
    """Each wrong argument raises a clear error that says what to pass instead."""
    with pytest.raises(exc, match=None) as info:
        call()
    assert hint in str(info.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error path")
def test_unavailable_device_is_refused() -> None:
    """Asking for CUDA on a machine without it fails at once, naming the fix."""
    with pytest.raises(ValueError, match="not available on this machine"):
        loopkit.to_device(torch.ones(1), "cuda")


class _RecordTo(TorchFunctionMode):
    """Records the non_blocking flag of every Tensor.to call."""

    def __init__(self) -> None:
        super().__init__()
        self.flags: list[bool] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") == "to":
            self.flags.append(bool(kwargs.get("non_blocking", False)))
        return func(*args, **kwargs)


def test_pageable_memory_is_copied_blocking() -> None:
    """non_blocking=None never makes an asynchronous copy from pageable host memory."""
    with _RecordTo() as rec:
        loopkit.to_device([torch.ones(2), torch.ones(3)], "meta")
    assert rec.flags == [False, False]


@requires_cuda
def test_cuda_non_blocking_only_from_pinned_memory() -> None:
    """non_blocking=None copies pinned tensors asynchronously, pageable ones and D2H blocking."""
    pinned = torch.randn(1024).pin_memory()
    pageable = torch.randn(1024)
    with _RecordTo() as rec:
        out = loopkit.to_device({"p": pinned, "q": pageable}, "cuda")
        back = loopkit.to_device(out, "cpu")
    assert rec.flags == [True, False, False, False]
    torch.testing.assert_close(back["p"], pinned)
    torch.testing.assert_close(back["q"], pageable)


class SlottedStore(Store):
    """The same, with its storage in a slot."""

    __slots__ = ("_slot_items",)

    def __init__(self, items: dict[str, Any]) -> None:
        self._slot_items = dict(items)

    def __getitem__(self, key: str) -> Any:
        return self._slot_items[key]

    def __setitem__(self, key: str, value: Any) -> None:
        self._slot_items[key] = value

    def __iter__(self) -> Iterator[str]:
        return iter(self._slot_items)

    def __len__(self) -> int:
        return len(self._slot_items)


@pytest.mark.parametrize("kind", [Store, SlottedStore, collections.UserDict])
def test_custom_mutable_mapping_is_copied_never_changed(kind: Any) -> None:
    """A custom MutableMapping comes back as a new one of its type; the user's keeps its tensors."""
    x, y = torch.ones(2), torch.zeros(1)
    batch = kind({"x": x, "y": y, "name": "b"})
    out = loopkit.to_device(batch, "meta")
    assert type(out) is kind and out is not batch
    assert batch["x"] is x and batch["y"] is y and len(batch) == 3
    assert out["x"].device.type == "meta" and out["y"].device.type == "meta"
    assert out["name"] == "b"
    if kind is Store:
        assert out.source == "disk"  # what the type carries besides its items is kept


def test_deque_set_and_frozenset_tensors_move() -> None:
    """Tensors inside a deque (its maxlen kept), a set and a frozenset move; originals stay."""
    a, b = torch.ones(1), torch.ones(2)
    dq: collections.deque[torch.Tensor] = collections.deque([a, b], maxlen=5)
    items = {"dq": dq, "set": {a, b}, "frozen": frozenset({a, (b, "tag")})}
    out = loopkit.to_device(items, "meta")
    assert type(out["dq"]) is collections.deque and out["dq"].maxlen == 5
    assert [t.device.type for t in out["dq"]] == ["meta", "meta"]
    assert type(out["set"]) is set and {t.device.type for t in out["set"]} == {"meta"}
    assert len(out["set"]) == 2
    assert type(out["frozen"]) is frozenset and len(out["frozen"]) == 2
    moved_frozen = {
        x.device.type if isinstance(x, torch.Tensor) else x[0].device.type for x in out["frozen"]
    }
    assert moved_frozen == {"meta"}
    assert list(dq) == [a, b] and all(t.device.type == "cpu" for t in dq)
    assert items["set"] == {a, b}


def test_user_list_moves_and_stays_a_user_list() -> None:
    """A UserList (a MutableSequence that is not a list) moves its tensors into a new one."""
    t = torch.ones(3)
    batch = collections.UserList([t, "text"])
    out = loopkit.to_device(batch, "meta")
    assert type(out) is collections.UserList and out[0].device.type == "meta"
    assert out[1] == "text" and batch[0] is t


class _Uncopyable(Store):
    """A mapping that refuses to be copied."""

    def __copy__(self) -> _Uncopyable:
        raise RuntimeError("handles cannot be copied")


def test_uncopyable_mapping_is_refused_and_unchanged() -> None:
    """A mapping that cannot be copied raises a TypeError saying what to pass; it is not touched."""
    t = torch.ones(1)
    batch = _Uncopyable({"x": t})
    with pytest.raises(TypeError, match="cannot copy a _Uncopyable"):
        loopkit.to_device(batch, "meta")
    assert batch["x"] is t


def test_a_batch_already_on_the_device_is_handed_out_without_a_walk(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On a CPU step a tuple or list of plain CPU tensors is not walked (no per-tensor call,
    the tuple itself, the list as a copy); anything else in it is walked as before, and a
    conversion asked for (uint8_to) still converts."""
    from loopkit._data._to_device import Mover

    walked: list[torch.Tensor] = []
    real = Mover.tensor
    monkeypatch.setattr(Mover, "tensor", lambda self, t: walked.append(t) or real(self, t))
    mover = Mover("cpu", None, None, None, False)
    x, y = torch.ones(2), torch.zeros(2)
    pair = (x, y)
    assert mover(pair) is pair and not walked
    listed = [x, y]
    out = mover(listed)
    assert out == [x, y] and out is not listed and out[0] is x and not walked
    # A non-tensor, a tensor subclass or a nested container: the walk, with the same result.
    mixed = (x, "name")
    assert mover(mixed) == (x, "name") and walked == [x]
    walked.clear()
    param = torch.nn.Parameter(torch.ones(1))
    assert mover((param,))[0] is param and walked == [param]
    walked.clear()
    assert mover(Pair(x, y)) == Pair(x, y) and walked == [x, y]
    converting = Mover("cpu", None, torch.float32, None, False)
    image = torch.full((1, 2, 2), 255, dtype=torch.uint8)
    got = converting((image, y))
    assert got[0].dtype == torch.float32 and torch.equal(got[0], torch.ones(1, 2, 2))
