"""``compile=`` and ``compile_optimizer=``: True, or a dict of torch.compile's keywords."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

CompileLike = bool | Mapping[str, Any]


def compile_options(value: object, name: str) -> dict[str, Any] | None:
    """None for False, the ``torch.compile`` keywords for True or a mapping; bad values refused."""
    if value is False:
        return None
    if value is True:
        return {}
    if not isinstance(value, Mapping):
        raise TypeError(
            f"{name} must be True, False or a dict of torch.compile's keyword arguments (e.g. "
            f"{{'mode': 'max-autotune'}}), got {type(value).__name__}"
        )
    import torch

    known = [p for p in inspect.signature(torch.compile).parameters if p != "model"]
    unknown = [k for k in value if k not in known]
    if unknown:
        raise ValueError(
            f"{name} has {unknown[0]!r}, which is not a keyword of torch.compile: use "
            f"{', '.join(known)}"
        )
    return dict(value)
