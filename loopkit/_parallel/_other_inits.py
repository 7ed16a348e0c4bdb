"""What ``materialize(init=None)`` cannot reproduce, found before anything changes: a model
that initializes itself otherwise than by each module's ``reset_parameters()`` (nanoGPT's
``self.apply(self._init_weights)``, Hugging Face's ``post_init``, torchtitan's
``init_weights``, a parent that re-initializes its children in ``__init__``)."""

from __future__ import annotations

import ast
import inspect
import textwrap
from typing import Any

from torch import nn

# Names of methods that initialize a model after its modules are built (nanoGPT, Hugging
# Face, torchtitan, timm, torchvision, torch.nn.Transformer's and MultiheadAttention's).
METHODS = ("_init_weights", "init_weights", "_initialize_weights", "initialize_weights",
           "post_init", "_reset_parameters", "init_parameters", "_init_parameters",
           "reset_params", "init_params", "_init_params", "weights_init",
           "_weights_init")  # fmt: skip
# Calls that write a tensor in place (torch.nn.init's and Tensor's), and Module.apply.
_WRITES = {"normal_", "uniform_", "trunc_normal_", "xavier_uniform_", "xavier_normal_",
           "kaiming_uniform_", "kaiming_normal_", "orthogonal_", "sparse_", "constant_",
           "zeros_", "ones_", "eye_", "dirac_", "zero_", "fill_", "copy_", "apply"}  # fmt: skip


def _holds(module: nn.Module) -> bool:
    return any(t is not None for t in [*module._parameters.values(), *module._buffers.values()])


def _from_torch(cls: type) -> bool:
    return cls.__module__.split(".")[0] == "torch"


def _defined_by(cls: type, name: str) -> type | None:
    """The class of ``cls``'s MRO that defines method ``name`` (None: none does)."""
    for base in cls.__mro__:
        if base in (nn.Module, object):
            return None
        if callable(base.__dict__.get(name)):
            return base
    return None


def _writes_in_init(cls: type) -> tuple[str, int] | None:
    """The first in-place write or ``apply`` call in ``cls.__init__``'s source and its line
    (None: none, or no source to read)."""
    try:
        lines, first = inspect.getsourcelines(cls.__dict__["__init__"])
        tree = ast.parse(textwrap.dedent("".join(lines)))
    except (OSError, TypeError, SyntaxError):
        return None
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in _WRITES:
                return name, first + node.lineno - 1
    return None


def _fix(path: str, method: str, bound: Any) -> str:
    target = "m" if not path else f"m.get_submodule({path!r})"
    try:
        takes = [p for p in inspect.signature(bound).parameters.values()
                 if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY,
                                                        p.POSITIONAL_OR_KEYWORD)]  # fmt: skip
    except (TypeError, ValueError):
        takes = []
    call = f"{target}.apply({target}.{method})" if takes else f"{target}.{method}()"
    return f"init=lambda m: {call}"


_HOW = (
    "materialize(init=None) runs only each module's own reset_parameters(), so the values "
    "would differ from the model built on the CPU. Pass init=fn(model) that initializes it as "
    "the model does, on the materialized model: {fix} (for values bit-identical to the CPU "
    "build, fn first calls each module's reset_parameters() in the order they were built: "
    "the draws they made before the model re-initialized them)"
)


def refuse_other_inits(model: nn.Module) -> None:
    """Refuse a model whose own initialization ``materialize(init=None)`` would skip: a
    module defining one of ``METHODS``; a ``reset_parameters()`` (not torch's) on a module
    whose children hold tensors (run parent first, it would draw in another order than the
    build, or not at all); an ``__init__`` (not torch's) that writes what it built."""
    for path, module in model.named_modules():
        below = [m for m in module.modules() if m is not module and _holds(m)]
        if not below and not _holds(module):
            continue
        name = f"{path or 'the model'} ({type(module).__name__})"
        for method in METHODS:
            if _defined_by(type(module), method) is not None:
                raise ValueError(
                    f"{name} defines {method}(), which initializes it after its modules are "
                    "built: " + _HOW.format(fix=_fix(path, method, getattr(module, method)))
                )
        if not below:
            continue  # a leaf: its reset_parameters() is its init
        owner = _defined_by(type(module), "reset_parameters")
        if owner is not None and not _from_torch(owner):
            raise ValueError(
                f"{name} has a reset_parameters() and children holding tensors: run before "
                "them (module order), it would draw in another order than the build, and "
                "a parent holding no tensor of its own is never run. "
                + _HOW.format(fix=_fix(path, "reset_parameters", module.reset_parameters))
            )
        for cls in type(module).__mro__:
            found = None if _from_torch(cls) or "__init__" not in cls.__dict__ else \
                _writes_in_init(cls)  # fmt: skip
            if found is not None:
                raise ValueError(
                    f"{name}: {cls.__qualname__}.__init__ calls {found[0]}() (line "
                    f"{found[1]}) after building its modules, re-initializing them: "
                    + _HOW.format(fix="init=fn doing what that __init__ does")
                )
