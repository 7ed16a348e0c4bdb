"""loopkit: composable training-loop middleware for PyTorch.

Keep your ``for batch in loader:`` loop; add mixed precision, gradient accumulation,
activation checkpointing, DDP and sync-free logging one line at a time.
"""

from ._accumulate import accumulate
from ._checkpoint import checkpointed, is_checkpointed
from ._device import to_device
from ._doctor import doctor
from ._memory import track_memory
from ._metrics import LoggingSink, Sink, TensorBoardSink, detach_logging, print_sink
from ._precision import Precision, autocast_step
from ._resume import Checkpointer, CheckpointError, Stateful, load_checkpoint
from ._step import step
from ._sync import no_sync
from ._syncs import count_host_syncs

__version__ = "0.1.0.dev0"

__all__ = [
    "CheckpointError",
    "Checkpointer",
    "LoggingSink",
    "Precision",
    "Sink",
    "Stateful",
    "TensorBoardSink",
    "__version__",
    "accumulate",
    "autocast_step",
    "checkpointed",
    "count_host_syncs",
    "detach_logging",
    "doctor",
    "is_checkpointed",
    "load_checkpoint",
    "no_sync",
    "print_sink",
    "step",
    "to_device",
    "track_memory",
]
