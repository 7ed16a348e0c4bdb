"""loopkit: composable training-loop middleware for PyTorch.

Keep your ``for batch in loader:`` loop; add mixed precision, gradient accumulation,
activation checkpointing, DDP and sync-free logging one line at a time.

Public names load on first use (PEP 562), so ``import loopkit`` costs nothing and
``python -m loopkit.lint`` runs where torch is not installed.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0.dev0"

# public name -> the private module that defines it
_WHERE: dict[str, str] = {
    "accumulate": "_accumulate",
    "checkpointed": "_recompute",
    "is_checkpointed": "_recompute",
    "to_device": "_to_device",
    "doctor": "_doctor",
    "track_memory": "_memory",
    "LoggingSink": "_sinks",
    "TensorBoardSink": "_sinks",
    "detach_logging": "_logging",
    "print_sink": "_sinks",
    "autocast_step": "_precision",
    "Checkpointer": "_checkpointer",
    "load_checkpoint": "_checkpoint_files",
    "step": "_step",
    "steps": "_steps",
    "until": "_until",
    "early_stop": "_early_stop",
    "cadence": "_cadence",
    "evaluate": "_evaluate",
    "Evaluation": "_evaluate",
    "preload": "_preload",
    "Preloaded": "_preload",
    "no_sync": "_grad_sync",
    "count_host_syncs": "_host_syncs",
    "CheckpointError": "_errors",
    "LoopkitError": "_errors",
    "DeviceLike": "_types",
    "Precision": "_types",
    "Scheduler": "_types",
    "Sink": "_types",
    "Stateful": "_types",
    "SyncKind": "_types",
    "Weight": "_types",
}
_SUBMODULES = frozenset({"distributed", "lint"})

__all__ = sorted([*_WHERE, "__version__"])


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        value = getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f".{name}", __name__)
    else:
        raise AttributeError(f"module 'loopkit' has no attribute {name!r}")
    globals()[name] = value  # the next access is a plain module attribute
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_WHERE, *_SUBMODULES})


if TYPE_CHECKING:  # what the names above are, for type checkers and IDEs
    from . import distributed as distributed
    from . import lint as lint
    from ._accumulate import accumulate as accumulate
    from ._cadence import cadence as cadence
    from ._checkpoint_files import load_checkpoint as load_checkpoint
    from ._checkpointer import Checkpointer as Checkpointer
    from ._doctor import doctor as doctor
    from ._early_stop import early_stop as early_stop
    from ._errors import CheckpointError as CheckpointError
    from ._errors import LoopkitError as LoopkitError
    from ._evaluate import Evaluation as Evaluation
    from ._evaluate import evaluate as evaluate
    from ._grad_sync import no_sync as no_sync
    from ._host_syncs import count_host_syncs as count_host_syncs
    from ._logging import detach_logging as detach_logging
    from ._memory import track_memory as track_memory
    from ._precision import autocast_step as autocast_step
    from ._preload import Preloaded as Preloaded
    from ._preload import preload as preload
    from ._recompute import checkpointed as checkpointed
    from ._recompute import is_checkpointed as is_checkpointed
    from ._sinks import LoggingSink as LoggingSink
    from ._sinks import TensorBoardSink as TensorBoardSink
    from ._sinks import print_sink as print_sink
    from ._step import step as step
    from ._steps import steps as steps
    from ._to_device import to_device as to_device
    from ._types import DeviceLike as DeviceLike
    from ._types import Precision as Precision
    from ._types import Scheduler as Scheduler
    from ._types import Sink as Sink
    from ._types import Stateful as Stateful
    from ._types import SyncKind as SyncKind
    from ._types import Weight as Weight
    from ._until import until as until
