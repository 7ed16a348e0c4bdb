"""Checkpoints of sharded models: each rank writes its shards, the loop's state beside them.

A model sharded by FSDP2 (or HSDP, FSDP2 on a 2-D mesh) holds its parameters, its
optimizer's state and its EMA as DTensors: no rank has the whole. Such a checkpoint is a
directory: ``torch.distributed.checkpoint`` (DCP) writes every DTensor of the state, each
rank its own shards (no gather), and rank zero writes ``loop.pt``, the rest of the state
(counters, schedulers, the loader's place, every rank's RNG states, ``extra=``) in the
format of a one-file checkpoint, each DTensor replaced by a placeholder naming its DCP key,
its global shape and its dtype. A DCP key is the tensor's path in the state, each part's
``%`` and ``/`` escaped (``%25``, ``%2F``) and the parts joined by ``/``: every path (a
``ModuleDict``'s ``"enc/0"``, ``extra={"ema/teacher": ...}``) has a key of its own. A
resume finds each tensor by the placeholder's place in ``loop.pt``, never by parsing its
key, so checkpoints written before the escaping read alike. The directory is written
under a temporary name and renamed once every rank's shards and ``loop.pt`` are on disk,
so a checkpoint that carries a checkpoint's name is complete; a killed save leaves only a
temporary. A re-save at an update already saved replaces that directory (``_files.
replace_dir``: a resume finds the old one or the new one, whole).

A resume reads ``loop.pt`` (``weights_only``: nothing runs code), checks every placeholder
against the tensor the run holds at the same place (its global shape and dtype), and only
then has DCP read the shards into fresh tensors laid out as the run's own, resharding them
if the number of ranks changed. DCP is asked for tensors only: the pickled objects it can
store are never read.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import shutil
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from .. import _ranks
from .._errors import CheckpointError
from . import _files as files
from . import _unreadable
from ._background import Background, staged

PLACEHOLDER = "__loopkit_dcp__"
"""The key of a placeholder in ``loop.pt``: the DCP key of the tensor it stands for."""
LOOP_FILE = "loop.pt"


def _dtensor_type() -> type | None:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch without distributed support
        return None
    return DTensor


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether ``model`` holds DTensor parameters (FSDP2, HSDP): its state is in shards."""
    kind = _dtensor_type()
    return kind is not None and any(isinstance(p, kind) for p in model.parameters())


def holds_shards(state: object) -> bool:
    """Whether ``state`` holds a DTensor anywhere (a sharded model's, optimizer's or EMA's)."""
    kind = _dtensor_type()
    return kind is not None and any(isinstance(v, kind) for _, v in _leaves(state, ()))


def _leaves(node: object, path: tuple[str, ...]) -> Iterator[tuple[tuple[str, ...], object]]:
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _leaves(v, (*path, str(k)))
    elif isinstance(node, (list, tuple)):
        for i, v in enumerate(node):
            yield from _leaves(v, (*path, str(i)))
    else:
        yield path, node


def _key(path: tuple[str, ...]) -> str:
    """The DCP key of the tensor at ``path``: one key per path (the separator escaped)."""
    return "/".join(part.replace("%", "%25").replace("/", "%2F") for part in path)


def split(state: object) -> tuple[object, dict[str, torch.Tensor]]:
    """``state`` with each DTensor replaced by a placeholder, and the DTensors by DCP key."""
    kind = _dtensor_type()
    tensors: dict[str, torch.Tensor] = {}

    def walk(node: object, path: tuple[str, ...]) -> object:
        if kind is not None and isinstance(node, torch.Tensor) and isinstance(node, kind):
            key = _key(path)
            if key in tensors:  # only keys that read alike as text: 0 and "0" in one dict
                raise CheckpointError(
                    f"two sharded tensors of the state are both at {key!r} (keys that differ "
                    "only in type, an int and a str): give them names of their own"
                )
            tensors[key] = node
            return {PLACEHOLDER: key, "shape": list(node.shape), "dtype": str(node.dtype)}
        if isinstance(node, dict):
            return {k: walk(v, (*path, str(k))) for k, v in node.items()}
        if isinstance(node, (list, tuple)):
            out = [walk(v, (*path, str(i))) for i, v in enumerate(node)]
            return out if isinstance(node, list) else tuple(out)
        return node

    return walk(state, ()), tensors


def _is_placeholder(node: object) -> bool:
    return isinstance(node, dict) and PLACEHOLDER in node


def placeholders(state: object) -> dict[str, dict[str, Any]]:
    """The placeholders of a saved ``loop.pt`` state, by DCP key."""
    return {str(node[PLACEHOLDER]): node for _, node in located(state)}


def located(state: object) -> list[tuple[tuple[object, ...], dict[str, Any]]]:
    """Each placeholder of a saved ``loop.pt`` state with its place there: the keys and
    indices that lead to it (where the run holds the tensor it stands for)."""
    found: list[tuple[tuple[object, ...], dict[str, Any]]] = []

    def walk(node: object, path: tuple[object, ...]) -> None:
        if _is_placeholder(node):
            assert isinstance(node, dict)
            found.append((path, node))
        elif isinstance(node, dict):
            for k, v in node.items():
                walk(v, (*path, k))
        elif isinstance(node, (list, tuple)):
            for i, v in enumerate(node):
                walk(v, (*path, i))

    walk(state, ())
    return found


def _at(node: object, path: tuple[object, ...]) -> object:
    """The value at ``path`` in a live state (KeyError/IndexError where there is none)."""
    for part in path:
        if isinstance(node, dict):
            key = part
            if part not in node:  # keys saved as str from ints (optimizer state indices)
                key = next((k for k in node if str(k) == str(part)), part)
            node = node[key]
        elif isinstance(node, (list, tuple)) and isinstance(part, int):
            node = node[part]
        else:
            raise KeyError(part)
    return node


def templates(saved: object, live: object) -> dict[str, torch.Tensor]:
    """For each placeholder of ``saved``, an empty tensor laid out as the run's own at the same
    place in ``live`` (the state the run would save now); CheckpointError where they differ.

    The run's tensor may be sharded otherwise (another mesh or number of ranks: DCP
    reshards) or not at all (a whole tensor on each rank: DCP reads every shard into it).
    """
    out: dict[str, torch.Tensor] = {}
    for path, info in located(saved):
        key = str(info[PLACEHOLDER])
        try:
            here = _at(live, path)
        except (KeyError, IndexError):
            raise CheckpointError(
                f"the checkpoint holds the sharded tensor {key!r}, which this run does not: "
                "build the same model, optimizer and EMA as the run that saved it"
            ) from None
        if not isinstance(here, torch.Tensor):
            raise CheckpointError(
                f"the checkpoint's {key!r} is a tensor (sharded, from an FSDP2 model) but this "
                f"run's is a {type(here).__name__}: build the same objects as when saving"
            )
        if list(here.shape) != list(info["shape"]) or str(here.dtype) != info["dtype"]:
            raise CheckpointError(
                f"the checkpoint's {key!r} is {tuple(info['shape'])} {info['dtype']} but this "
                f"run's is {tuple(here.shape)} {here.dtype}: build the same model as when saving"
            )
        out[key] = torch.empty_like(here)
    return out


class _LaidOutAs(dict[str, torch.Tensor]):
    """The state of a parameter the optimizer has not stepped yet: every entry laid out as it."""

    def __init__(self, param: torch.Tensor) -> None:
        super().__init__()
        self.param = param

    def __missing__(self, key: str) -> torch.Tensor:
        return self.param


def with_parameter_layout(state: object, optimizer: torch.optim.Optimizer) -> object:
    """An optimizer's ``state_dict()`` where each parameter without state yet (a run resumed
    before its first step) offers the parameter's layout for its state's shards (Adam's
    moments, momentum: tensors of the parameter's shape)."""
    assert isinstance(state, dict)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    per_param = dict(state.get("state", {}))
    for index, param in enumerate(params):
        per_param.setdefault(index, _LaidOutAs(param))
    return {**state, "state": per_param}


def filled(saved: object, tensors: dict[str, torch.Tensor]) -> object:
    """``saved`` with each placeholder replaced by its tensor."""

    def walk(node: object) -> object:
        if _is_placeholder(node):
            assert isinstance(node, dict)
            return tensors[str(node[PLACEHOLDER])]
        if isinstance(node, dict):
            return {k: walk(v) for k, v in node.items()}
        if isinstance(node, (list, tuple)):
            out = [walk(v) for v in node]
            return out if isinstance(node, list) else tuple(out)
        return node

    return walk(saved)


def read_shards(directory: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Read the shards of ``tensors`` (by DCP key) from ``directory`` into them, resharded to
    their layout; every rank calls it (a collective). A failure on any rank raises on every
    rank (DCP's own exception derives from BaseException and holds every rank's failure):
    a CheckpointError marked damaged where every failure shows damage (a shard missing or
    cut short, the metadata unreadable), else the first failure of the machine (an I/O
    error, out of memory) as it is."""
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict_loader import load

    if tensors:
        try:
            # No process group (a resume on one process): read every shard here.
            with single_process_read():
                load(tensors, checkpoint_id=str(directory), no_dist=not _ranks.initialized())
        except CheckpointException as err:
            failures = getattr(err, "failures", None)
            failures = failures if isinstance(failures, dict) else {}
            if _unreadable.dcp_damage(failures):
                raise files.damaged(CheckpointError(
                    f"{directory}: unreadable (its shards are incomplete or corrupt): "
                    f"{_first_failure(err)}"
                )) from err  # fmt: skip
            raise _machine_failure(failures) or CheckpointError(
                f"{directory}: cannot read its shards: {_first_failure(err)}"
            ) from err


def _machine_failure(failures: dict[int, object]) -> BaseException | None:
    """The first rank's failure that is the machine's (I/O, memory), to raise as it is."""
    for _, failure in sorted(failures.items()):
        exc = failure[0] if isinstance(failure, tuple) and failure else failure
        if isinstance(exc, Exception) and _unreadable.of_the_machine(exc):
            return exc
    return None


@contextlib.contextmanager
def single_process_read() -> Iterator[None]:
    """DCP reading without a process group, which it warns of: here that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is .*single process")
        yield


def _shards_failed(path: Path, err: BaseException) -> OSError:
    """DCP's failure to write ``path``'s shards as an ``OSError`` naming the checkpoint and
    the first failing rank's cause (its errno kept: a full disk is ``ENOSPC``)."""
    failures = getattr(err, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, failure = sorted(failures.items())[0]
        if isinstance(failure, tuple) and failure:  # (the exception, its frames)
            failure = failure[0]
        cause = failure
        while isinstance(cause, BaseException) and not isinstance(cause, OSError):
            cause = cause.__cause__ or cause.__context__  # lost where it came from another rank
        if isinstance(cause, OSError):
            return files.write_failed(path, cause, f" (rank {rank}'s shards)")
        if "unexpected pos" in str(failure):  # torch.save's word for a write its file refused
            return OSError(
                errno.EIO,
                f"cannot write the checkpoint {path}: a write of rank {rank}'s shards failed, "
                f"as on a full disk or past a quota or file-size limit (torch: {failure})",
            )
    return OSError(f"cannot write the checkpoint {path}: its shards: {_first_failure(err)}")


def _first_failure(err: BaseException) -> str:
    """The first rank's failure in DCP's exception (which holds one per rank)."""
    failures = getattr(err, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, failure = sorted(failures.items())[0]
        if isinstance(failure, tuple) and failure:  # (the exception, its frames)
            failure = failure[0]
        return f"rank {rank}: {failure!r}"[:400]
    return repr(err)[:400]


def write(
    state: dict[str, Any],
    path: Path,
    background: Background | None = None,
    prune: Callable[[], None] = lambda: None,
) -> None:
    """Write ``state`` as the directory checkpoint ``path``; every rank calls it.

    The shards go to a temporary directory (its name agreed by every rank); once DCP's save
    has ended on every rank, rank zero adds ``loop.pt``, renames it to ``path`` and calls
    ``prune``. With ``background``: DCP stages the shards now (``async_save``, in the
    background's own process group) and the writes, the rename and ``prune`` run on its
    thread; a failure is raised by its ``finish``.
    """
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict_saver import async_save, save

    loop, tensors = split(state)
    rank = _ranks.world()[0]
    name = f".{path.name}.tmp-{files.HOST}-{os.getpid()}-{secrets.token_hex(4)}"
    tmp = path.with_name(str(_ranks.gather_objects(name)[0]))  # rank zero's name, for all
    lock = None
    made: OSError | None = None
    if rank == 0:
        try:
            tmp.mkdir(parents=True)
            lock = files.hold(tmp)  # a clean-up of dead saves' temporaries leaves it alone
        except OSError as err:  # a full disk: every rank learns it below, before any write
            made = files.write_failed(path, err)
    _ranks.barrier()  # made before any rank looks for it
    # Every rank must write into the directory rank zero made: one path, one filesystem.
    looked = _ranks.gather_objects(
        (str(tmp.parent), tmp.is_dir(), None if made is None else str(made))
    )
    if looked[0][2] is not None:  # rank zero could not make it: no rank writes
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise made or OSError(looked[0][2])
    blind = [r for r, (_, seen, _) in enumerate(looked) if not seen]
    if blind:
        if lock is not None:
            os.close(lock)
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(
            f"rank(s) {blind} do not see {looked[0][0]}/ as rank 0 does (another directory, or "
            "a disk of their own): every rank writes its shards into one checkpoint, so give "
            "every rank the same directory on a filesystem they share"
        )

    def complete(wait: Callable[[], object]) -> None:
        """The shards written (``wait``), then ``loop.pt`` and the rename on rank zero."""
        try:
            try:
                wait()
            except CheckpointException as err:  # a BaseException in DCP: every rank gets it
                raise _shards_failed(path, err) from err
            if rank == 0:
                files.atomic_save(loop, tmp / LOOP_FILE, checkpoint=path)
                # Complete: it carries a checkpoint's name from now on (replacing one of the
                # same update, a re-save, as a one-file checkpoint is replaced).
                files.replace_dir(tmp, path)
                prune()
        except BaseException:
            if rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise
        finally:
            if lock is not None:
                os.close(lock)

    if background is not None:
        group = background.group()
        loop = staged(loop)  # training goes on: the thread writes this copy
        future = async_save(tensors, checkpoint_id=str(tmp), process_group=group)
        background.start(str(path), lambda: complete(future.result))  # type: ignore[union-attr]
        return
    error: Exception | None = None
    try:
        complete(lambda: save(tensors, checkpoint_id=str(tmp)))  # a collective
    except Exception as err:
        error = err
    failed = _ranks.gather_objects(None if error is None else repr(error))
    if error is not None:
        raise error
    for r, said in enumerate(failed):
        if said is not None:  # rank zero's loop.pt or rename, say: the others learn it here
            raise RuntimeError(f"rank {r} could not write its part of {path}: {said}")
