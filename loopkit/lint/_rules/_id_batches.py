"""Datasets whose items are token ids (LK007's look-alike): a batch of a few KB of integers,
collated in microseconds, gains nothing measurable from workers or pinned memory."""

from __future__ import annotations

import ast

from .._script import Script
from .._syntax import FUNCS, dotted, keyword, walk_scope
from ._loader_use import built_from

_INT_TYPES = {"LongTensor", "IntTensor"}
_INT_DTYPES = {"long", "int64", "int32", "int"}


def id_dataset(script: Script, dataset: ast.expr | None) -> bool:
    """A Dataset class of the program whose ``__getitem__`` returns only integer tensors made
    from what it holds (``torch.tensor(self.ids[i], dtype=torch.long)``, a dict or tuple of
    them): token ids, no decoding or augmentation per item."""
    dataset = built_from(script, dataset)
    if not isinstance(dataset, ast.Call) or script.project is None:
        return False
    found = script.project._class(script, dataset.func)
    if found is None:
        return False
    where, cls = found
    getitem = where.defs.get(cls, {}).get("__getitem__")
    if getitem is None or not isinstance(getitem, FUNCS):
        return False
    returns = [n.value for n in walk_scope(getitem) if isinstance(n, ast.Return)]
    return bool(returns) and all(_ids(v) for v in returns)


def _ids(value: ast.expr | None) -> bool:
    if isinstance(value, ast.Dict):
        return bool(value.values) and all(_ids(v) for v in value.values)
    if isinstance(value, ast.Tuple):
        return bool(value.elts) and all(_ids(v) for v in value.elts)
    if not isinstance(value, ast.Call):
        return False
    name = dotted(value.func) or ""
    last = name.rsplit(".", 1)[-1]
    if last == "dict" and not value.args:
        return bool(value.keywords) and all(_ids(k.value) for k in value.keywords)
    if last in _INT_TYPES:
        return True
    dtype = keyword(value, "dtype")
    kind = (dotted(dtype.value) or "").rsplit(".", 1)[-1] if dtype is not None else ""
    return last in {"tensor", "as_tensor"} and kind in _INT_DTYPES
