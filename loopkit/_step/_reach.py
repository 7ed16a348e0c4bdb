"""Which parameters a group member's loss reaches: none that another member's optimizer trains.

In a ``loopkit.steps`` group each window belongs to one optimizer. A member whose backward
puts gradients on parameters of another member's optimizer (an actor and a critic sharing
a trunk, a GAN's generator step without ``frozen=[D]``, a discriminator loss on an
undetached ``fake``) feeds a window it does not normalize: on a window's first batches the
gradient joins the other member's open window, on its last batch it arrives after that
window was stepped and is dropped. Neither is a large-batch update, so the group refuses it,
before the backward runs.

The check walks the loss's autograd graph, so it runs only where it can find something (a
member for which other members' optimizers hold parameters it does not freeze) and only on
that member's first micro-step with backward: which parameters a loss reaches is a property
of the loop's code, not of the batch, and the steps after it pay nothing.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch


class Reach:
    """Parameters (by id) that one member's loss must not reach, with whose optimizer has them."""

    __slots__ = ("foreign", "member", "models", "names")

    def __init__(
        self, member: int, foreign: Mapping[int, int], names: Sequence[str], models: Sequence[Any]
    ) -> None:
        self.member = member
        self.foreign = dict(foreign)  # id(parameter) -> the member whose optimizer trains it
        self.names = list(names)
        self.models = list(models)  # to name a parameter in the error

    def check(self, loss: torch.Tensor, inputs: Any) -> None:
        """Raise if back-propagating ``loss`` (into ``inputs``, if given) reaches a foreign one."""
        targets: Mapping[int, int] = self.foreign
        if inputs is not None:
            given = [inputs] if isinstance(inputs, torch.Tensor) else list(inputs)
            targets = {id(t): self.foreign[id(t)] for t in given if id(t) in self.foreign}
            if not targets:
                return
        found = reached(loss, targets)
        if found is None:
            return
        hit, hidden = found
        owner = targets[id(hit)]
        raise RuntimeError(
            f"loopkit.steps: the backward of {self.names[self.member]} reaches "
            f"{self._describe(hit, owner)}, which the optimizer of {self.names[owner]} trains, "
            "so both windows would claim its gradient (nothing was back-propagated). Say which "
            "step trains it: give the shared module to one optimizer and put it in frozen= of "
            "the other step (loopkit.step(..., frozen=[shared_module])), detach its output in "
            "this step's loss (.detach()), or train both losses in one step whose optimizer "
            "holds both parts"
            + (
                ". (Its loss runs through a reentrant checkpoint, whose parameters cannot be "
                "seen before its backward: loopkit counts every parameter the checkpointed "
                "function can reach; checkpoint(..., use_reentrant=False) or loopkit.checkpointed "
                "lets it see exactly which ones the segment uses.)"
                if hidden
                else ""
            )
        )

    def _describe(self, param: torch.Tensor, owner: int) -> str:
        for model in (self.models[owner], self.models[self.member]):
            for name, p in model.named_parameters():
                if p is param:
                    return f"parameter {name!r}"
        return f"a parameter of shape {tuple(param.shape)}"


def reached(
    loss: torch.Tensor, targets: Mapping[int, int] | Iterable[int]
) -> tuple[torch.Tensor, bool] | None:
    """The first leaf among ``targets`` (ids) that back-propagating ``loss`` accumulates into,
    and whether it was found behind a reentrant checkpoint.

    A reentrant checkpoint (``checkpoint(fn, x, use_reentrant=True)``) hides its segment's
    parameters: its backward re-runs ``fn`` and back-propagates a graph that does not exist
    yet. For it, every parameter ``fn`` can reach (a module, a bound method's module, the
    modules and tensors in a function's closure, defaults and named globals) counts as
    reached: conservative, but never blind.
    """
    wanted = targets if isinstance(targets, Mapping) else set(targets)
    root = loss.grad_fn
    if root is None:
        return (loss, False) if id(loss) in wanted else None
    seen = {root}
    stack = [root]
    while stack:
        node = stack.pop()
        hidden = getattr(node, "run_function", None)  # a reentrant checkpoint's segment
        if hidden is not None:
            for inner in segment_leaves(hidden):
                if id(inner) in wanted:
                    return inner, True
        for nxt, _ in node.next_functions:
            if nxt is None or nxt in seen:
                continue
            seen.add(nxt)
            leaf = getattr(nxt, "variable", None)  # AccumulateGrad: a leaf's gradient sink
            if leaf is None:
                stack.append(nxt)
            elif id(leaf) in wanted:
                return leaf, False
    return None


def segment_leaves(fn: Any, depth: int = 3) -> list[torch.Tensor]:
    """Leaf tensors that calling ``fn`` may use: parameters of the modules it can reach."""
    found: list[torch.Tensor] = []
    seen: set[int] = set()

    def visit(obj: Any, depth: int) -> None:
        if id(obj) in seen or depth < 0:
            return
        seen.add(id(obj))
        if isinstance(obj, torch.nn.Module):
            found.extend(obj.parameters())
        elif isinstance(obj, torch.Tensor):
            if obj.is_leaf and obj.requires_grad:
                found.append(obj)
        elif isinstance(obj, functools.partial):
            for o in (obj.func, *obj.args, *obj.keywords.values()):
                visit(o, depth - 1)
        elif inspect.ismethod(obj):
            visit(obj.__self__, depth - 1)
            visit(obj.__func__, depth - 1)
        elif inspect.isfunction(obj):
            cells = [c.cell_contents for c in obj.__closure__ or () if _filled(c)]
            named = [obj.__globals__[n] for n in obj.__code__.co_names if n in obj.__globals__]
            for o in (*cells, *(obj.__defaults__ or ()), *named):
                visit(o, depth - 1)
        elif isinstance(obj, (list, tuple)):
            for o in obj:
                visit(o, depth - 1)

    visit(fn, depth)
    return found


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents  # noqa: B018 - an empty cell raises
    except ValueError:
        return False
    return True


def _model_name(model: Any) -> str:
    inner = getattr(model, "module", model)  # the module inside DDP
    return type(inner).__name__


def arm(members: Sequence[Any]) -> None:
    """Give each member that could reach another member's parameters its check.

    ``members``: ``loopkit.step`` objects (their optimizer, frozen parameters, accumulator).
    """
    owner: dict[int, int] = {}
    for k, m in enumerate(members):
        for group in m.optimizer.param_groups:
            for p in group["params"]:
                owner[id(p)] = k
    names = [f"steps[{k}] ({_model_name(m.model)})" for k, m in enumerate(members)]
    models = [m.model for m in members]
    for k, m in enumerate(members):
        frozen = {id(p) for p in m._frozen.params}
        foreign = {i: j for i, j in owner.items() if j != k and i not in frozen}
        m.accumulator._reach = Reach(k, foreign, names, models) if foreign else None
