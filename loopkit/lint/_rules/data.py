"""Rules about the DataLoader: where batches are loaded, and what seeds them."""

from __future__ import annotations

import ast
from collections.abc import Iterator

from .._rule import Hit, rule
from .._script import Script
from .._syntax import assigned_names, callee, is_const, keyword

# DataLoader's positional parameters, for calls that pass them without keywords.
_LOADER_POS = {"num_workers": 5, "pin_memory": 7, "worker_init_fn": 10, "generator": 12}


@rule(
    "LK007",
    theme="data",
    flags="a DataLoader without workers, or without `pin_memory` in a CUDA script",
    why="without workers the main process loads every batch while the device waits; without "
    "pinned memory each batch is copied to the device from pageable memory",
    fix="loader = loopkit.distributed.loader(dataset, batch_size=...)",
)
def loader_in_main_process(script: Script) -> Iterator[Hit]:
    loaders = list(_loaders(script))
    if not loaders:
        return
    cuda = _targets_cuda(script.tree)
    in_memory = {
        name
        for n in ast.walk(script.tree)
        for name, value in assigned_names(n)
        if isinstance(value, ast.Call) and callee(value) == "TensorDataset"
    }
    for call in loaders:
        workers = _loader_arg(call, "num_workers")
        dataset_kw = keyword(call, "dataset")
        dataset = call.args[0] if call.args else dataset_kw.value if dataset_kw else None
        problems: list[str] = []
        # Indexing in-memory tensors costs less than shipping batches back from workers.
        tensors = (isinstance(dataset, ast.Call) and callee(dataset) == "TensorDataset") or (
            isinstance(dataset, ast.Name) and dataset.id in in_memory
        )
        # num_workers=0 written out, or pin_memory set with no workers: a considered choice.
        considered = workers is not None or _loader_arg(call, "pin_memory") is not None
        if workers is None and not tensors and not considered:
            problems.append("without num_workers")
        if _loader_arg(call, "pin_memory") is None and cuda:
            problems.append("without pin_memory")
        if problems:
            yield call, "DataLoader " + " and ".join(problems)


@rule(
    "LK011",
    theme="data",
    flags="a DataLoader with workers and no `generator`/`worker_init_fn`: its order follows "
    "the global RNG (matters only to resume or reproduce a run)",
    why="its shuffle order and its workers' seeds come from the global torch RNG, which the "
    "model also draws from, so a change to the model changes the data order and a resumed run "
    "cannot replay it (augmentations do not repeat: since PyTorch 1.9 every worker seeds "
    "random, torch and numpy from its own seed)",
    fix="loader = loopkit.distributed.loader(dataset, batch_size=..., seed=0)",
    default=False,
)
def loader_seeded_globally(script: Script) -> Iterator[Hit]:
    for call in _loaders(script):
        workers = _loader_arg(call, "num_workers")
        shuffle_kw = keyword(call, "shuffle")
        shuffle = shuffle_kw.value if shuffle_kw else call.args[2] if len(call.args) > 2 else None
        if shuffle is None or is_const(shuffle, False):
            continue  # a sequential loader (evaluation): its order needs no seed
        if (
            workers is not None
            and not is_const(workers, 0)
            and _loader_arg(call, "worker_init_fn") is None
            and _loader_arg(call, "generator") is None
        ):
            yield call, "DataLoader with workers but no worker_init_fn/generator"


def _loaders(script: Script) -> Iterator[ast.Call]:
    """The DataLoader calls whose settings are visible (no ``**kwargs``)."""
    for call in script.calls_to("DataLoader"):
        if all(k.arg is not None for k in call.keywords):
            yield call


def _loader_arg(call: ast.Call, name: str) -> ast.expr | None:
    """A DataLoader argument given by keyword or by position; None if absent or None."""
    kw = keyword(call, name)
    pos = _LOADER_POS[name]
    value = kw.value if kw is not None else call.args[pos] if len(call.args) > pos else None
    return None if is_const(value, None) else value


def _targets_cuda(tree: ast.Module) -> bool:
    """True when the script mentions CUDA anywhere (only then does pinning pay off)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            if "cuda" in node.value:
                return True
        elif (isinstance(node, ast.Attribute) and node.attr in {"cuda", "accelerator"}) or (
            isinstance(node, ast.Name) and node.id == "cuda"
        ):
            return True
    return False


@rule(
    "LK013",
    theme="data",
    flags="`len(list(loader))`: the loader is iterated to take its length",
    why="it loads (and augments, tokenizes, collates) every batch of an epoch only to count "
    "them, and again every time it runs",
    fix="n = len(loader)  # batches per epoch, from the sampler, without loading any",
)
def length_by_iterating(script: Script) -> Iterator[Hit]:
    for call in script.calls_to("len"):
        inner = call.args[0] if len(call.args) == 1 else None
        if isinstance(inner, ast.Call) and callee(inner) in {"list", "tuple"} and inner.args:
            source = inner.args[0]
            if isinstance(source, ast.Name | ast.Attribute):
                yield call, f"`{ast.unparse(call)}` iterates the whole of `{ast.unparse(source)}`"
