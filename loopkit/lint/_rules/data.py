"""Rules about the DataLoader: where batches are loaded, and what seeds them."""

from __future__ import annotations

import ast
from collections.abc import Iterator

from .._declaration import Hit, rule
from .._script import Script
from .._syntax import (
    callee,
    is_const,
    keyword,
)
from ._id_batches import id_dataset
from ._loader_use import (
    batches_rebuilt,
    in_memory_datasets,
    loader_arg,
    loader_uses,
    on_device_dataset,
    random_sampler,
    resumes,
    tokenizer_collate,
    unpinnable,
)


@rule(
    "LK007",
    theme="data",
    flags="a DataLoader without workers, or without `pin_memory` in a CUDA script (not one "
    "only previewed with `next(iter(...))` or read in one pass outside training, nor "
    "`pin_memory` for batches of a custom class that cannot be pinned or rebuilt on the host "
    "before their move, nor a data set of token ids)",
    why="without workers the main process loads every batch while the device waits; without "
    "pinned memory each batch is copied to the device from pageable memory",
    fix="loader = loopkit.distributed.loader(dataset, batch_size=...)",
)
def loader_in_main_process(script: Script) -> Iterator[Hit]:
    loaders = list(_loaders(script))
    if not loaders:
        return
    cuda = _targets_cuda(script.nodes) or _used_by_a_cuda_script(script)
    in_memory = in_memory_datasets(script)
    for call in loaders:
        # A cost per step needs a loader read per step. Not one only previewed (next(iter())
        # loads one batch) or read in a single pass before or after training (a small test
        # set at the end of a tutorial): there the wait is paid once, not every step. A script
        # that does not train is there to run that pass: it counts.
        uses = loader_uses(script, call)
        if uses and uses <= {"preview", "once"} and ("once" not in uses or script.shape.training):
            continue
        # Tokenized text padded by the tokenizer (tokenizer.pad, a DataCollator): rows of
        # ints already in memory, collated in a millisecond while the device runs; workers
        # and pinning buy nothing measurable for a few KB of token ids.
        if tokenizer_collate(script, call):
            continue
        dataset_kw = keyword(call, "dataset")
        dataset = call.args[0] if call.args else dataset_kw.value if dataset_kw else None
        # A Dataset whose __getitem__ moves each sample to the device: workers cannot build
        # CUDA tensors and pin_memory=True raises on them (the cost is that move: LK004's
        # territory, not the loader's settings).
        if on_device_dataset(script, dataset):
            continue
        # Items that are token ids (a few KB a batch, no decoding per item): workers and
        # pinned memory buy nothing measurable.
        if id_dataset(script, dataset):
            continue
        workers = loader_arg(call, "num_workers")
        problems: list[str] = []
        # Indexing in-memory tensors costs less than shipping batches back from workers.
        tensors = (isinstance(dataset, ast.Call) and callee(dataset) == "TensorDataset") or (
            isinstance(dataset, ast.Name) and dataset.id in in_memory
        )
        # num_workers=0 written out, or pin_memory set with no workers: a considered choice.
        considered = workers is not None or loader_arg(call, "pin_memory") is not None
        if workers is None and not tensors and not considered:
            problems.append("without num_workers")
        # pin_memory=True pins tensors, dicts, tuples and objects with a pin_memory() method;
        # a collate_fn that returns an instance of a plain class of this file gets nothing.
        # Batches rebuilt on the host before their move (token ids padded into a new tensor):
        # the loader's own tensors never travel, pinning them buys nothing.
        if (
            loader_arg(call, "pin_memory") is None
            and cuda
            and not unpinnable(script, call)
            and not batches_rebuilt(script, call)
        ):
            problems.append("without pin_memory")
        if problems:
            yield call, "DataLoader " + " and ".join(problems)


@rule(
    "LK011",
    theme="data",
    flags="a shuffled DataLoader with workers and no `generator`/`worker_init_fn`, in a "
    "script that resumes (`--resume`, `load_state_dict` of a checkpoint, "
    "`accelerator.load_state`): its order follows the global RNG",
    why="its shuffle order and its workers' seeds come from the global torch RNG, which the "
    "model also draws from, so a change to the model changes the data order and a resumed run "
    "cannot replay it (augmentations do not repeat: since PyTorch 1.9 every worker seeds "
    "random, torch and numpy from its own seed)",
    fix="loader = loopkit.distributed.loader(dataset, batch_size=..., seed=0)",
    default=False,
)
def loader_seeded_globally(script: Script) -> Iterator[Hit]:
    # Only a resumed run has to replay the order: a script with no way to resume has
    # nothing to replay (the reason the rule exists).
    if not resumes(script):
        return
    for call in _loaders(script):
        workers = loader_arg(call, "num_workers")
        shuffle_kw = keyword(call, "shuffle")
        shuffle = shuffle_kw.value if shuffle_kw else call.args[2] if len(call.args) > 2 else None
        sampler = loader_arg(call, "sampler") or loader_arg(call, "batch_sampler")
        if is_const(shuffle, False) or (shuffle is None and not random_sampler(script, sampler)):
            continue  # a sequential loader (evaluation): its order needs no seed
        # A helper loader (statistics, a preview, an evaluation) is not what a resume
        # replays: only the loader the training loop reads is.
        uses = loader_uses(script, call)
        if uses and "train" not in uses:
            continue
        if (
            workers is not None
            and not is_const(workers, 0)
            and loader_arg(call, "worker_init_fn") is None
            and loader_arg(call, "generator") is None
        ):
            yield call, "DataLoader with workers but no worker_init_fn/generator"


def _loaders(script: Script) -> Iterator[ast.Call]:
    """The DataLoader calls whose settings are visible (no ``**kwargs``)."""
    for call in script.calls_to("DataLoader"):
        if all(k.arg is not None for k in call.keywords):
            yield call


def _targets_cuda(nodes: list[ast.AST]) -> bool:
    """True when the script mentions CUDA anywhere (only then does pinning pay off)."""
    for node in nodes:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            if "cuda" in node.value:
                return True
        elif (isinstance(node, ast.Attribute) and node.attr in {"cuda", "accelerator"}) or (
            isinstance(node, ast.Name) and node.id == "cuda"
        ):
            return True
        elif (
            isinstance(node, ast.Attribute | ast.Name)
            and "gpu" in (node.attr if isinstance(node, ast.Attribute) else node.id).lower()
        ):
            return True  # args.gpu, ngpu, num_gpus: a GPU script
    return False


def _used_by_a_cuda_script(script: Script) -> bool:
    """Whether a file checked with this one, that targets CUDA, calls into this one (a
    ``data_loader.py`` whose ``get_loader`` a CUDA ``train.py`` calls)."""
    project = script.project
    if project is None:
        return False
    for other in project.scripts:
        if other is script or not _targets_cuda(other.nodes):
            continue
        for call in other.calls:
            target = project.resolve(other, call)
            if target is not None and target[0] is script:
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
