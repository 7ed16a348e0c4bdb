"""loopkit: composable training-loop middleware for PyTorch.

Keep your ``for batch in loader:`` loop; add mixed precision, gradient accumulation,
activation checkpointing, DDP and sync-free logging one line at a time.

Public names load on first use (PEP 562), so ``import loopkit`` costs nothing and
``python -m loopkit.lint`` runs where torch is not installed.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.3.0"

# public name -> the private module that defines it
_WHERE: dict[str, str] = {
    "accumulate": "_step._accumulate",
    "checkpointed": "_recompute._checkpointed",
    "is_checkpointed": "_recompute._checkpointed",
    "to_device": "_data._to_device",
    "doctor": "_observe._doctor",
    "track_memory": "_observe._memory",
    "LoggingSink": "_logging._sinks",
    "TensorBoardSink": "_logging._sinks",
    "CSVSink": "_logging._csv_sink",
    "WandbSink": "_logging._wandb_sink",
    "MLflowSink": "_logging._mlflow_sink",
    "Tracker": "_logging._tracker",
    "detach_logging": "_logging._detach",
    "print_sink": "_logging._sinks",
    "autocast_step": "_precision",
    "Checkpointer": "_checkpoint._save_resume",
    "load_checkpoint": "_checkpoint._files",
    "export_weights": "_checkpoint._export",
    "step": "_step._compose",
    "steps": "_step._group",
    "scale_lr": "_step._lr_scale",
    "probe_micro_batch": "_step._probe",
    "ema": "_ema._average",
    "until": "_control._until",
    "early_stop": "_control._early_stop",
    "cadence": "_control._cadence",
    "evaluate": "_control._evaluate",
    "Evaluation": "_control._evaluate",
    "preload": "_data._preload",
    "replayed": "_stream._replay",
    "shuffle_buffer": "_stream._shuffle_buffer",
    "stream_shards": "_stream._shards",
    "Preloaded": "_data._preload",
    "no_sync": "_parallel._grad_sync",
    "count_host_syncs": "_observe._host_syncs",
    "CheckpointError": "_errors",
    "LoopkitError": "_errors",
    "OpenWindowWarning": "_errors",
    "ResumeWarning": "_errors",
    "SinkFailedWarning": "_errors",
    "UnwrappedModelWarning": "_errors",
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
    from ._checkpoint._export import export_weights as export_weights
    from ._checkpoint._files import load_checkpoint as load_checkpoint
    from ._checkpoint._save_resume import Checkpointer as Checkpointer
    from ._control._cadence import cadence as cadence
    from ._control._early_stop import early_stop as early_stop
    from ._control._evaluate import Evaluation as Evaluation
    from ._control._evaluate import evaluate as evaluate
    from ._control._until import until as until
    from ._data._preload import Preloaded as Preloaded
    from ._data._preload import preload as preload
    from ._data._to_device import to_device as to_device
    from ._ema._average import ema as ema
    from ._errors import CheckpointError as CheckpointError
    from ._errors import LoopkitError as LoopkitError
    from ._errors import OpenWindowWarning as OpenWindowWarning
    from ._errors import ResumeWarning as ResumeWarning
    from ._errors import SinkFailedWarning as SinkFailedWarning
    from ._errors import UnwrappedModelWarning as UnwrappedModelWarning
    from ._logging._csv_sink import CSVSink as CSVSink
    from ._logging._detach import detach_logging as detach_logging
    from ._logging._mlflow_sink import MLflowSink as MLflowSink
    from ._logging._sinks import LoggingSink as LoggingSink
    from ._logging._sinks import TensorBoardSink as TensorBoardSink
    from ._logging._sinks import print_sink as print_sink
    from ._logging._tracker import Tracker as Tracker
    from ._logging._wandb_sink import WandbSink as WandbSink
    from ._observe._doctor import doctor as doctor
    from ._observe._host_syncs import count_host_syncs as count_host_syncs
    from ._observe._memory import track_memory as track_memory
    from ._parallel._grad_sync import no_sync as no_sync
    from ._precision import autocast_step as autocast_step
    from ._recompute._checkpointed import checkpointed as checkpointed
    from ._recompute._checkpointed import is_checkpointed as is_checkpointed
    from ._step._accumulate import accumulate as accumulate
    from ._step._compose import step as step
    from ._step._group import steps as steps
    from ._step._lr_scale import scale_lr as scale_lr
    from ._step._probe import probe_micro_batch as probe_micro_batch
    from ._stream._replay import replayed as replayed
    from ._stream._shards import stream_shards as stream_shards
    from ._stream._shuffle_buffer import shuffle_buffer as shuffle_buffer
    from ._types import DeviceLike as DeviceLike
    from ._types import Precision as Precision
    from ._types import Scheduler as Scheduler
    from ._types import Sink as Sink
    from ._types import Stateful as Stateful
    from ._types import SyncKind as SyncKind
    from ._types import Weight as Weight
