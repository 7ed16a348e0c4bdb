"""autocast_step: mixed precision for the forward pass, and loss scaling for fp16."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Mapping, Sequence
from types import TracebackType
from typing import Any

import torch

from . import _ranks
from ._devices import default_device
from ._sync_points import expected_sync
from ._tracing import EagerUnderCompile
from ._types import DeviceLike, Precision, PrecisionLike

_PRECISIONS: dict[object, Precision] = {
    "bf16": "bf16",
    "bfloat16": "bf16",
    torch.bfloat16: "bf16",
    "fp16": "fp16",
    "float16": "fp16",
    torch.float16: "fp16",
    "fp32": "fp32",
    "float32": "fp32",
    torch.float32: "fp32",
}
_DTYPES: dict[Precision, torch.dtype] = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
}


def resolve_precision(precision: object) -> Precision:
    """Normalize a precision name or dtype; raise ValueError listing the accepted ones."""
    try:
        found = _PRECISIONS.get(precision)
    except TypeError:  # unhashable
        found = None
    if found is None:
        raise ValueError(
            f"unknown precision {precision!r}: use 'bf16', 'fp16' or 'fp32' "
            "(or torch.bfloat16, torch.float16, torch.float32)"
        )
    return found


def _resolve_device_type(device_type: DeviceLike | None) -> str:
    if device_type is None:
        return default_device().type
    if isinstance(device_type, torch.device):
        return device_type.type
    if isinstance(device_type, str):
        try:
            return torch.device(device_type).type
        except RuntimeError:
            pass
    raise ValueError(
        f"device_type must be a device type such as 'cpu' or 'cuda' (or a torch.device), "
        f"got {device_type!r}"
    )


_warned_fp16_on_cpu = False


def _warn_fp16_on_cpu() -> None:
    global _warned_fp16_on_cpu
    if _warned_fp16_on_cpu:
        return
    _warned_fp16_on_cpu = True
    warnings.warn(
        "fp16 autocast on a CPU: CPUs have no fast fp16 matmul, so this typically runs many "
        "times slower than fp32 (and needs loss scaling). Use precision='bf16' on CPUs "
        "(about 2x faster than fp32 where the CPU has AMX or AVX512-BF16), or 'fp32'",
        UserWarning,
        stacklevel=3,
    )


def found_inf(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> torch.Tensor:
    """The inf/nan flag that ``scaler.unscale_(optimizer)`` recorded, as a device tensor.

    GradScaler keeps it in a private per-optimizer record; reading it is the only way to
    know whether an update is skipped for every optimizer kind (fused AdamW decides inside
    its kernel, so "was optimizer.step called" is the wrong question).
    """
    state = scaler._per_optimizer_states[id(optimizer)]
    flags = state["found_inf_per_device"]
    if not flags:
        raise RuntimeError(
            "the optimizer holds no gradients to unscale: run backward on a loss that depends "
            "on its parameters before stepping"
        )
    values = list(flags.values())
    total = values[0]
    for v in values[1:]:
        total = total + v.to(total.device)
    return total  # type: ignore[no-any-return]  # GradScaler's state is an untyped dict


def agree_found_inf(
    scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer, group: Any
) -> None:
    """Make the optimizer's recorded inf/nan flag the OR over all ranks, in place (no sync).

    Needed where each rank unscaled only its shard of the gradients (FSDP): the skip
    decision, and the scale update, must then be the same everywhere.
    """
    flags = scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
    for flag in flags.values():
        flag.copy_(_ranks.any_(flag > 0, group).to(flag.dtype))


def _grad_fingerprint(params: list[torch.Tensor]) -> tuple[Any, ...]:
    """Which gradient tensors the parameters hold (not their values: clipping changes those)."""
    return tuple(None if p.grad is None else id(p.grad) for p in params)


def mark_found_inf(
    scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer, bad: torch.Tensor
) -> None:
    """Add ``bad`` (a 0-d bool) to the optimizer's recorded inf/nan flag, in place (no sync)."""
    for flag in scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values():
        flag.copy_(torch.maximum(flag, bad.to(flag.device, flag.dtype)))


class autocast_step(EagerUnderCompile, contextlib.ContextDecorator):
    """Mixed precision as a context manager or decorator; fp16 also owns a GradScaler.

    ``with amp:`` (or ``@amp``) runs the forward under ``torch.autocast`` for the device;
    ``amp.backward(loss)`` scales the loss for fp16; ``amp.step(optimizer)`` unscales,
    skips the update on inf/nan, steps and updates the scale, and returns whether the
    update happened. For bf16 and fp32 these are plain ``loss.backward()`` and
    ``optimizer.step()``, so a loop written once runs in every precision. fp32 enters no
    autocast at all.
    ``device_type``: default the accelerator, else cpu; ``scaler``: fp16's GradScaler or its kwargs.
    """

    def __init__(
        self,
        precision: PrecisionLike,
        *,
        device_type: DeviceLike | None = None,
        scaler: torch.amp.GradScaler | Mapping[str, Any] | None = None,
    ) -> None:
        self.precision: Precision = resolve_precision(precision)
        self.device_type: str = _resolve_device_type(device_type)
        self.dtype: torch.dtype = _DTYPES[self.precision]
        self._autocast: torch.autocast | None = None
        self._active: list[torch.autocast] = []
        if self.precision != "fp32":
            self._autocast = self._make_autocast()
        self.scaler: torch.amp.GradScaler | None = None
        if self.precision == "fp16":
            self.scaler = self._make_scaler(scaler)
            if self.device_type == "cpu":
                _warn_fp16_on_cpu()
        elif scaler is not None:
            raise ValueError(
                f"a GradScaler only applies to fp16; precision {self.precision!r} needs none: "
                "drop the scaler argument"
            )
        # Set by a scaled backward, cleared by step: an fp16 step with no scaled backward
        # would unscale gradients that were never scaled.
        self._scaled = False
        # optimizer id -> its parameters and their gradients as unscale_ left them.
        self._unscaled: dict[int, tuple[list[torch.Tensor], tuple[Any, ...]]] = {}

    def _make_autocast(self) -> torch.autocast:
        if not torch.amp.is_autocast_available(self.device_type):
            raise ValueError(
                f"torch.autocast does not support device type {self.device_type!r}: use "
                "precision='fp32' there"
            )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ac = torch.autocast(self.device_type, dtype=self.dtype)
        # torch only warns and disables itself on an unsupported dtype; that would silently
        # train in fp32, so it is an error here.
        if not ac._enabled or (
            self.device_type == "cuda"
            and self.dtype == torch.bfloat16
            and not torch.cuda.is_bf16_supported()
        ):
            why = "; ".join(str(w.message) for w in caught) or "unsupported dtype"
            raise ValueError(
                f"precision {self.precision!r} cannot run on {self.device_type!r} ({why}): "
                "use another precision, e.g. 'fp16' on GPUs without bf16, or 'fp32'"
            )
        return ac

    def _make_scaler(
        self, scaler: torch.amp.GradScaler | Mapping[str, Any] | None
    ) -> torch.amp.GradScaler:
        if isinstance(scaler, torch.amp.GradScaler):
            if scaler._device != self.device_type:
                raise ValueError(
                    f"the GradScaler is for device {scaler._device!r} but autocast runs on "
                    f"{self.device_type!r}: build it as torch.amp.GradScaler({self.device_type!r})"
                )
            if not scaler.is_enabled():
                raise ValueError(
                    "the GradScaler is disabled, so fp16 gradients would underflow unscaled: "
                    "pass an enabled scaler or none"
                )
            return scaler
        if scaler is not None and not isinstance(scaler, Mapping):
            raise TypeError(
                "scaler must be a torch.amp.GradScaler or a dict of its keyword arguments, "
                f"got {type(scaler).__name__}"
            )
        kwargs = dict(scaler or {})
        try:
            return torch.amp.GradScaler(self.device_type, **kwargs)
        except TypeError as err:
            raise TypeError(f"bad GradScaler arguments {kwargs!r}: {err}") from None

    # -- the forward region -------------------------------------------------------------

    def _enter(self) -> autocast_step:
        ac = self._autocast
        if ac is not None:
            # The prebuilt autocast object is reused (cheaper than building one per step);
            # a nested entry of this same object gets its own, since autocast keeps the
            # state to restore on itself.
            if self._active:
                ac = torch.autocast(self.device_type, dtype=self.dtype)
            ac.__enter__()  # type: ignore[no-untyped-call]  # torch.autocast: unannotated
            self._active.append(ac)
        return self

    def _exit(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._active:
            self._active.pop().__exit__(exc_type, exc, tb)

    # -- backward and the optimizer step ------------------------------------------------

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to call backward on: scaled for fp16, unchanged otherwise."""
        if not isinstance(loss, torch.Tensor):
            raise TypeError(
                f"loss must be a tensor (the loss function's output), got {type(loss).__name__}"
            )
        if self.scaler is None:
            return loss
        if self._unscaled:
            # An optimizer unscaled but never stepped whose gradients were cleared since
            # (clipping or optimizer.step raised, the caller called zero_grad and went on):
            # that window is over. Forget its bookkeeping, or the next unscale_ would be skipped and
            # scaled gradients applied. One whose gradients are untouched (a second loss
            # back-propagated before stepping several optimizers) keeps its record.
            for opt_id, (params, seen) in list(self._unscaled.items()):
                if _grad_fingerprint(params) != seen:
                    self._forget(opt_id)
        self._scaled = True
        return self.scaler.scale(loss)

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """``loss.backward()``, through the scaler for fp16."""
        self.scale(loss).backward(**kwargs)  # type: ignore[no-untyped-call]  # torch: unannotated

    def discard(self, optimizer: torch.optim.Optimizer) -> None:
        """Forget an unfinished fp16 window of ``optimizer`` (after an error before its step).

        The GradScaler then stands as if the window had never happened: no unscale recorded,
        no inf flag, no scale update. The caller drops the window's gradients.
        """
        if self.scaler is not None:
            self._forget(id(optimizer))
            if not self._unscaled:
                self._scaled = False

    def _forget(self, opt_id: int) -> None:
        assert self.scaler is not None
        self.scaler._per_optimizer_states.pop(opt_id, None)
        self._unscaled.pop(opt_id, None)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Unscale the optimizer's gradients in place (fp16); call before clipping them."""
        if self.scaler is None or id(optimizer) in self._unscaled:
            return
        self._require_scaled()
        self.scaler.unscale_(optimizer)
        params = [p for g in optimizer.param_groups for p in g["params"]]
        self._unscaled[id(optimizer)] = (params, _grad_fingerprint(params))

    def step(self, *optimizers: torch.optim.Optimizer) -> bool:
        """Step the optimizers; for fp16 skip any whose gradients hold inf/nan, then update.

        Returns True when every optimizer was updated. For fp16 this reads one flag from
        the device: a host-device sync, the same one ``GradScaler.step`` makes.
        """
        if not optimizers:
            raise TypeError("step() needs at least one optimizer: amp.step(optimizer)")
        for opt in optimizers:
            if not isinstance(opt, torch.optim.Optimizer):
                raise TypeError(f"step() takes torch.optim optimizers, got {type(opt).__name__}")
        return self.step_each(optimizers, lambda opt: opt.step())

    def step_each(
        self,
        optimizers: Sequence[torch.optim.Optimizer],
        run: Callable[[torch.optim.Optimizer], object],
    ) -> bool:
        """``step(*optimizers)``, each optimizer stepped by ``run(optimizer)`` (a compiled
        step, for one)."""
        scaler = self.scaler
        if scaler is None:
            for opt in optimizers:
                run(opt)
            return True
        self._require_scaled()
        for opt in optimizers:
            self.unscale_(opt)
        flags = [found_inf(scaler, opt) for opt in optimizers]
        # Host-device sync: the skip decision must be known on the host (GradScaler itself
        # reads the same flag), and a scheduler must not advance on a skipped update.
        with expected_sync("fp16's overflow check"):
            skipped = torch.stack([f.reshape(()) for f in flags]).tolist()
        for opt, skip in zip(optimizers, skipped, strict=True):
            if not skip:
                # Gradients are unscaled and finite here, which is exactly the case where
                # GradScaler.step would call optimizer.step() itself.
                run(opt)
        scaler.update()
        self._scaled = False
        self._unscaled.clear()
        return not any(skipped)

    def _require_scaled(self) -> None:
        if not self._scaled:
            raise RuntimeError(
                "fp16 optimizer step with no scaled backward since the last step: call "
                "amp.backward(loss) (or amp.scale(loss).backward()) before amp.step(optimizer)"
            )

    # -- checkpointing ------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The GradScaler state for fp16 (scale and growth tracker); empty otherwise."""
        return {} if self.scaler is None else {"scaler": self.scaler.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what ``state_dict`` returned."""
        if self.scaler is None:
            if state:
                raise ValueError(
                    f"this state holds a GradScaler but precision is {self.precision!r}: load "
                    "it into autocast_step('fp16')"
                )
            return
        if "scaler" not in state:
            raise ValueError(
                "this state holds no GradScaler state: it was saved with another precision than "
                "fp16"
            )
        self.scaler.load_state_dict(state["scaler"])

    def __repr__(self) -> str:
        return f"autocast_step({self.precision!r}, device_type={self.device_type!r})"
