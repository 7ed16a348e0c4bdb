"""The checkpoint piece for ``amp=``: an ``autocast_step``'s GradScaler state and precision.

A saved state must hold a GradScaler exactly when this run's precision is fp16, and its
precision must be this run's; ``check_precision`` is shared with the step's piece.
"""

from __future__ import annotations

from collections.abc import Mapping

from .._errors import CheckpointError
from .._precision import autocast_step
from ._contract import UserState, expect

# The GradScaler.load_state_dict reads these.
_SCALER_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")


class AmpState(UserState):
    """An ``autocast_step``'s GradScaler state and precision; a saved one must be this one's."""

    def __init__(self, amp: autocast_step, who: str = "amp= state") -> None:
        super().__init__(amp)
        self.amp, self.who = amp, who

    def state_dict(self) -> dict[str, object]:
        return {**self.amp.state_dict(), "precision": self.amp.precision}

    def check_state_dict(self, saved: object) -> None:
        state = expect(saved, Mapping, "'amp'")
        if self.amp.scaler is None and any(k != "precision" for k in state):
            raise CheckpointError(
                f"the checkpoint's {self.who} holds a GradScaler (it was saved with fp16) but "
                f"this run's precision is {self.amp.precision!r}: resume with precision='fp16'"
            )
        if self.amp.scaler is not None:
            scaler = state.get("scaler")
            if not isinstance(scaler, Mapping):
                raise CheckpointError(
                    f"the checkpoint's {self.who} holds no GradScaler (it was saved with bf16 "
                    "or fp32) but this run's precision is 'fp16': resume with the precision it "
                    "was saved with"
                )
            missing = [k for k in _SCALER_KEYS if k not in scaler]
            if missing:
                raise CheckpointError(
                    f"incomplete checkpoint: the GradScaler state has no {missing}"
                )
        check_precision(state.get("precision"), self.amp.precision, self.who)

    def load_state_dict(self, saved: object) -> None:
        state = expect(saved, Mapping, "'amp'")
        self.amp.load_state_dict({k: v for k, v in state.items() if k != "precision"})


def check_precision(saved: object, here: str | None, who: str) -> None:
    """Refuse a resume in another precision than the one saved (unknown on either side: pass).

    A checkpoint written before precisions were recorded has none; an ``accumulate``
    without ``amp=`` has none either (its autocast, if any, is the Checkpointer's ``amp=``).
    """
    if saved is None or here is None or saved == here:
        return
    raise CheckpointError(
        f"the checkpoint's {who} was saved with precision {saved!r} but this run's is "
        f"{here!r}: resume with precision={saved!r} (a run resumed in another precision "
        "does not continue the one that was saved)"
    )
