"""What the loader rules ask of a DataLoader: how the script reads it, what its batches are,
whether the script resumes."""

from __future__ import annotations

import ast

from .._script import Script
from .._syntax import (
    FUNCS,
    assigned_names,
    callee,
    device_move,
    dotted,
    is_const,
    keyword,
    method,
    receiver,
    root_name,
    walk_scope,
)

# DataLoader's positional parameters, for calls that pass them without keywords.
_LOADER_POS = {
    "sampler": 3,
    "batch_sampler": 4,
    "num_workers": 5,
    "collate_fn": 6,
    "pin_memory": 7,
    "worker_init_fn": 10,
    "generator": 12,
}


def random_sampler(script: Script, sampler: ast.expr | None) -> bool:
    """A sampler that draws its order from the global RNG: RandomSampler (or
    SubsetRandomSampler, WeightedRandomSampler) with no generator, given directly or through
    a name. DistributedSampler orders by (seed, epoch): a resume replays it."""
    if isinstance(sampler, ast.Name):
        values = [
            v
            for n in script.nodes
            for name, v in assigned_names(n)
            if name == sampler.id and v is not None
        ]
        return any(random_sampler(script, v) for v in values)
    if not isinstance(sampler, ast.Call):
        return False
    return callee(sampler).endswith("RandomSampler") and keyword(sampler, "generator") is None


def tokenizer_collate(script: Script, call: ast.Call) -> bool:
    """Whether the loader's collate_fn pads tokenized text: a function of this file that
    returns ``tokenizer.pad(...)``, or a ``DataCollator...(tokenizer)``."""
    collate = loader_arg(call, "collate_fn")
    if isinstance(collate, ast.Name):
        values = [
            v
            for n in script.nodes
            for name, v in assigned_names(n)
            if name == collate.id and v is not None
        ]
        if any(isinstance(v, ast.Call) and "Collator" in callee(v) for v in values):
            return True
        funcs = [n for n in script.nodes if isinstance(n, FUNCS) and n.name == collate.id]
        returns = [r.value for f in funcs for r in walk_scope(f) if isinstance(r, ast.Return)]
        return bool(returns) and all(
            isinstance(v, ast.Call) and "tokenizer" in (dotted(receiver(v)) or "").lower()
            for v in returns
        )
    return isinstance(collate, ast.Call) and "Collator" in callee(collate)


def built_from(script: Script, dataset: ast.expr | None) -> ast.expr | None:
    """The expression a data set is: itself, or a name's one value in the file (else None)."""
    if not isinstance(dataset, ast.Name):
        return dataset
    values = [
        v
        for n in script.nodes
        for name, v in assigned_names(n)
        if name == dataset.id and v is not None
    ]
    return values[0] if len(values) == 1 else None


def on_device_dataset(script: Script, dataset: ast.expr | None) -> bool:
    """A Dataset class of this file whose ``__getitem__`` moves what it returns to the device."""
    dataset = built_from(script, dataset)
    if not isinstance(dataset, ast.Call) or not isinstance(dataset.func, ast.Name):
        return False
    cls = script.classes.get(dataset.func.id)
    getitem = script.defs.get(cls, {}).get("__getitem__") if cls is not None else None
    return getitem is not None and any(
        isinstance(n, ast.Call) and device_move(n) == "device" for n in walk_scope(getitem)
    )


def resumes(script: Script) -> bool:
    """Whether the script can resume a run: a ``resume`` argument or name, Accelerate's
    ``load_state``, an optimizer's state loaded, or a model's from ``torch.load``."""
    loads = False
    for node in script.nodes:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            if "resume" in node.value.lower():
                return True
        elif "resume" in _identifier(node).lower():
            return True
        if isinstance(node, ast.Call):
            name = method(node) or ""
            if name == "load_state":
                return True
            if name == "load_state_dict":
                owner = (dotted(receiver(node)) or "").lower()
                if "optim" in owner or owner.rsplit(".", 1)[-1] == "opt":
                    return True
                loads = True
    return loads and bool(script.calls_to("load")) and bool(script.shape.training)


def _identifier(node: ast.AST) -> str:
    """The name a node binds or reads (a name, an attribute, a parameter, a keyword)."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.arg):
        return node.arg
    if isinstance(node, ast.keyword):
        return node.arg or ""
    return ""


def loader_uses(script: Script, call: ast.Call) -> set[str] | None:
    """How a loader is read: 'train' (by a training loop), 'preview' (``next(iter(x))`` off
    the step), 'once' (a loop that runs once per run) or 'loop' (another loop); an empty set
    if never read; None when it escapes the linter's sight (passed on, returned, stored)."""
    parent = script.parents.get(call)
    direct = _iterated_by(script, call)
    if direct is not None:
        return {_loop_kind(script, direct)}
    if not (
        isinstance(parent, ast.Assign)
        and len(parent.targets) == 1
        and isinstance(parent.targets[0], ast.Name)
    ):
        return None
    name = parent.targets[0].id
    scope = script.scope_of(call)
    if isinstance(scope, ast.Module):
        region = [
            n
            for n in ast.walk(scope)
            if not any(v == name for v, _ in _local_bindings(script, script.scope_of(n)))
            or script.scope_of(n) is scope
        ]
    else:
        region = list(walk_scope(scope))
        if any(
            isinstance(n, ast.Name) and n.id == name
            for d in walk_scope(scope)
            if isinstance(d, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
            for n in ast.walk(d)
        ):
            return None  # read by a nested function: not followed
    kinds: set[str] = set()
    for node in region:
        if not (isinstance(node, ast.Name) and node.id == name and isinstance(node.ctx, ast.Load)):
            continue
        up = script.parents.get(node)
        loop = _iterated_by(script, node)
        if loop is not None:
            kinds.add(_loop_kind(script, loop))
        elif isinstance(up, ast.Call) and callee(up) == "iter" and up.args[:1] == [node]:
            outer = script.parents.get(up)
            if not (isinstance(outer, ast.Call) and callee(outer) == "next"):
                return None  # an iterator kept and stepped: a per-step reader, maybe
            step_loops = script.shape.step_loops
            per_step = any(
                loop in step_loops and not script.guarded_by_mod(outer, loop)
                for loop in script.loops_of(outer)
            )
            kinds.add("train" if per_step else "preview")
        elif (isinstance(up, ast.Call) and callee(up) == "len") or (
            isinstance(up, ast.Attribute) and up.attr in {"dataset", "sampler", "batch_size"}
        ):
            continue  # its length or its settings: not a read
        else:
            return None
    return kinds


# Constructors that copy host data into a new tensor: what they make is not the loader's batch.
# (``as_tensor`` and ``from_numpy`` share the batch's memory: what they return is the batch.)
_REBUILDS = {"tensor", "LongTensor", "FloatTensor", "Tensor"}


def batches_rebuilt(script: Script, call: ast.Call) -> bool:
    """Whether every loop over this loader moves to the device only tensors it builds anew
    from the batch on the host (``ids = torch.tensor(pad(batch))``; ``ids.to(device)``): the
    loader's own tensors never travel, so pinning them buys nothing. False when unsure."""
    parent = script.parents.get(call)
    loops = [_iterated_by(script, call)]
    if isinstance(parent, ast.Assign) and len(parent.targets) == 1:
        name = dotted(parent.targets[0])
        loops = [
            _iterated_by(script, n)
            for n in ast.walk(script.scope_of(call))
            if isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Load)
        ]
    found = [loop for loop in loops if loop is not None]
    return bool(found) and all(_moves_only_rebuilt(script, loop) for loop in found)


def _moves_only_rebuilt(script: Script, loop: ast.For | ast.AsyncFor) -> bool:
    rebuilt: set[str] = set()
    moves = 0
    for node in sorted(
        (n for n in ast.walk(loop) if isinstance(n, ast.stmt | ast.Call)),
        key=lambda n: (n.lineno, n.col_offset),
    ):
        if isinstance(node, ast.Assign | ast.AnnAssign):
            for bound, value in assigned_names(node):
                made = isinstance(value, ast.Call) and callee(value) in _REBUILDS
                derived = root_name(value) in rebuilt if value is not None else False
                if made or derived:
                    rebuilt.add(bound)
                else:
                    rebuilt.discard(bound)
        elif isinstance(node, ast.Call) and device_move(node) == "device":
            moves += 1
            base = receiver(node)
            made = isinstance(base, ast.Call) and callee(base) in _REBUILDS
            if not made and root_name(base) not in rebuilt:
                return False
    return moves > 0


def _local_bindings(script: Script, scope: ast.AST) -> list[tuple[str, ast.expr | None]]:
    if isinstance(scope, ast.Module):
        return []
    return script.scope_bindings(scope)


def _iterated_by(script: Script, node: ast.AST) -> ast.For | ast.AsyncFor | None:
    """The for loop that iterates ``node``: ``for b in x``, ``enumerate(x)``, ``tqdm(x)``."""
    up = script.parents.get(node)
    if isinstance(up, ast.Call) and callee(up) in {"enumerate", "tqdm", "zip", "iter"}:
        node, up = up, script.parents.get(up)
    if isinstance(up, ast.For | ast.AsyncFor) and up.iter is node:
        return up
    return None


def _loop_kind(script: Script, loop: ast.For | ast.AsyncFor) -> str:
    if loop in script.shape.training:
        return "train"
    return "once" if script.runs_once(loop) else "loop"


def in_memory_datasets(script: Script) -> set[str]:
    """Names bound to a TensorDataset, directly or returned by a function of the checked
    files (``train, val = make_datasets()``)."""
    names: set[str] = set()
    for node in script.nodes:
        if not isinstance(node, ast.Assign) or not isinstance(node.value, ast.Call):
            continue
        if callee(node.value) == "TensorDataset" or _returns_tensor_datasets(
            script, node.value, set()
        ):
            names.update(n.id for t in node.targets for n in ast.walk(t) if isinstance(n, ast.Name))
    return names


def _returns_tensor_datasets(script: Script, call: ast.Call, seen: set[int]) -> bool:
    target = script.project.resolve(script, call) if script.project is not None else None
    if target is None or id(target[1]) in seen:
        return False  # unknown, or a recursion
    seen = seen | {id(target[1])}  # this path's functions: the same one twice is fine
    where, func = target
    returns = [n.value for n in walk_scope(func) if isinstance(n, ast.Return)]
    if not returns:
        return False
    for value in returns:
        parts = value.elts if isinstance(value, ast.Tuple) else [value]
        for part in parts:
            if not isinstance(part, ast.Call):
                return False
            if callee(part) != "TensorDataset" and not _returns_tensor_datasets(where, part, seen):
                return False
    return True


def unpinnable(script: Script, call: ast.Call) -> bool:
    """Whether the loader's collate_fn (of this file, or of a file checked with it) returns
    an instance of a plain class (no ``pin_memory`` method, not a tuple, dict or sequence),
    alone or as an element of a tuple (``batch[0] = NestedTensor(...); return tuple(batch)``):
    pin_memory=True pins nothing of it (at most the small rest of the tuple)."""
    collate = loader_arg(call, "collate_fn")
    if isinstance(collate, ast.Lambda):
        return _returns_instances(script, collate, [collate.body], 0)
    if isinstance(collate, ast.Name | ast.Attribute):
        target = script.resolve_reference(collate)
        if target is not None:
            where, func = target
            returns = [n.value for n in walk_scope(func) if isinstance(n, ast.Return)]
            return _returns_instances(where, func, returns, 0)
    return False


def _returns_instances(
    script: Script, func: ast.AST, returns: list[ast.expr | None], depth: int
) -> bool:
    """Every return value is a plain-class instance, or a tuple holding one."""
    return bool(returns) and all(
        _instance(script, func, v, depth) or _tuple_with_instance(script, func, v, depth)
        for v in returns
    )


def _instance(script: Script, func: ast.AST, value: ast.expr | None, depth: int) -> bool:
    """``Class(...)`` of a plain class of the file (``cls(...)`` in a classmethod), or a call
    of a function of the file whose every return is one (up to three calls deep)."""
    if not isinstance(value, ast.Call) or not isinstance(value.func, ast.Name):
        return False
    owner = script.parents.get(func)
    if value.func.id == "cls" and isinstance(owner, ast.ClassDef):
        return _plain_class(script, owner, set())
    cls = script.classes.get(value.func.id)
    if cls is not None:
        return _plain_class(script, cls, set())
    maker = script.defs.get(script.tree, {}).get(value.func.id)
    if maker is None or depth >= 3:
        return False
    returns = [n.value for n in walk_scope(maker) if isinstance(n, ast.Return)]
    return bool(returns) and all(_instance(script, maker, v, depth + 1) for v in returns)


def _tuple_with_instance(script: Script, func: ast.AST, value: ast.expr | None, depth: int) -> bool:
    """``(Images(...), targets)``, or ``tuple(batch)`` after ``batch[0] = Images(...)``."""
    if isinstance(value, ast.Tuple):
        return any(_instance(script, func, e, depth) for e in value.elts)
    if not (
        isinstance(value, ast.Call)
        and callee(value) == "tuple"
        and len(value.args) == 1
        and isinstance(value.args[0], ast.Name)
    ):
        return False
    name = value.args[0].id
    return any(
        isinstance(n, ast.Assign)
        and any(
            isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name) and t.value.id == name
            for t in n.targets
        )
        and _instance(script, func, n.value, depth)
        for n in walk_scope(func)
    )


def _plain_class(script: Script, cls: ast.ClassDef, seen: set[int]) -> bool:
    """A class of this file that torch's pin_memory leaves alone: no ``pin_memory`` method,
    and bases that are object or such classes (a NamedTuple or dict subclass is pinned)."""
    if id(cls) in seen:
        return False
    seen.add(id(cls))
    if "pin_memory" in script.defs.get(cls, {}):
        return False
    for base in cls.bases:
        name = dotted(base) if not isinstance(base, ast.Call) else None
        if name == "object":
            continue
        local = script.classes.get(name or "")
        if local is None or not _plain_class(script, local, seen):
            return False
    return True


def loader_arg(call: ast.Call, name: str) -> ast.expr | None:
    """A DataLoader argument given by keyword or by position; None if absent or None."""
    kw = keyword(call, name)
    pos = _LOADER_POS[name]
    value = kw.value if kw is not None else call.args[pos] if len(call.args) > pos else None
    return None if is_const(value, None) else value
