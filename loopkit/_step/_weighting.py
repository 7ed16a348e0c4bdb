"""How a window's micro-steps are weighted: the checks on ``weight=`` and the loss each scales.

The reference weight is fixed at the first weighted backward (averaged over the ranks, so
every rank scales its losses alike) and kept across windows and in checkpoints; the open
micro-step's weight is reused by its later backward calls. Nothing changes until
``commit`` is called after the backward succeeded.
"""

from __future__ import annotations

from typing import Any

import torch

from .._precision import autocast_step
from .._types import Weight
from ._cross_rank import agreed_reference
from ._normalize import checked_weight, scaled_loss, seed_gradient
from ._window import Window

# torch.autograd.backward, less what a checked 0-d seed of the loss's dtype and device makes
# redundant (its validation of given gradients: a few microseconds of Python per call):
# torch's own engine entry, looked up at each call as torch.autograd.backward does (a patch of
# it, torch.compiler's or a user's, is seen). A torch without it (or a loss a torch-function
# mode or subclass intercepts) goes through torch.autograd.backward.
_intercepted = torch._C._has_torch_function_unary
_functorch_active = torch._C._are_functorch_transforms_active

LossKind = tuple[torch.dtype, torch.device, bool]
"""A plain 0-d floating loss's dtype, device and whether that is the CPU (a log's Kind)."""


class Weighting:
    """The weighted reference of one accumulate and the weight of its open micro-step."""

    __slots__ = ("_seeds", "every", "group", "loss_kind", "micro_weight", "reference", "sharded")

    def __init__(self, every: int, sharded: bool, group: Any) -> None:
        self.every, self.sharded, self.group = every, sharded, group
        self.reference: Any = None  # fixed at the first weighted backward
        self.micro_weight: Any = None  # the weight of the micro-step now open
        self._seeds: dict[tuple[torch.dtype, torch.device], tuple[torch.Tensor, LossKind]] = {}
        self.loss_kind: LossKind | None = None
        """The last backward's loss, if it took the usual path: a plain 0-d floating tensor of
        ``(dtype, device, on the CPU)``, one object per dtype and device, so a log told it
        (``detach_logging._record_one``) need not read the loss again (see there)."""

    def backward(
        self, loss: torch.Tensor, weight: Weight | None, window: Window, first: bool,
        amp: autocast_step | None, autograd: dict[str, Any],
    ) -> tuple[Any, Any]:  # fmt: skip
        """Back-propagate a micro-step's ``loss``, scaled for the window (and fp16); returns
        ``(this micro-step's weight, reference)``. The usual one (unweighted, a plain 0-d
        floating loss, no autograd keywords, no GradScaler) starts from ``1 / every``."""
        if (
            weight is None
            and not window.weighted
            and not autograd
            and (amp is None or amp.scaler is None)
            and type(loss) is torch.Tensor
            and loss.ndim == 0
            and loss.is_floating_point()
            and torch.is_grad_enabled()  # else the division's error, as by hand
            and not _functorch_active()  # else torch.autograd.backward's refusal
        ):
            self.backward_seeded(loss)
            return 1, None
        self.loss_kind = None  # a loss off the usual path is checked where it is logged
        scaled, w, reference = self.scaled(loss, weight, window, first)
        if amp is not None:
            amp.backward(scaled, **autograd)
        else:
            scaled.backward(**autograd)
        return w, reference

    def backward_seeded(self, loss: torch.Tensor) -> None:
        """Back-propagate an unweighted micro-step's ``loss`` from the gradient ``1 / every``
        (``_normalize.seed_gradient``): the gradients of ``(loss / every).backward()``, bit
        for bit, with one graph node less per micro-step (a copy instead of the division).

        The value is computed once per dtype and device; each backward gets a fresh copy, as
        the hand loop's DivBackward hands out a fresh tensor: autograd may make it (a view of
        it) a parameter's ``.grad`` (a loss that reaches a parameter through views only), and
        a hook may write into it; neither may reach the next micro-step."""
        key = (loss.dtype, loss.device)
        known = self._seeds.get(key)
        if known is None:
            kind = (loss.dtype, loss.device, loss.device.type == "cpu")
            known = self._seeds[key] = (seed_gradient(loss.dtype, loss.device, self.every), kind)
        seed, self.loss_kind = known
        # torch.autograd.backward(loss, seed.clone()), by torch's engine entry (see above).
        engine = getattr(torch.autograd.graph, "_engine_run_backward", None)
        if engine is None or _intercepted(loss):
            torch.autograd.backward(loss, seed.clone())
        else:
            engine((loss,), (seed.clone(),), False, False, (), allow_unreachable=True,
                   accumulate_grad=True)  # fmt: skip

    def scaled(
        self, loss: torch.Tensor, weight: Weight | None, window: Window, first: bool
    ) -> tuple[Any, Any, Any]:
        """``(loss to back-propagate, this micro-step's weight, reference)``; changes nothing.

        Raises ValueError for ``weight=`` given on some micro-steps of a window and not on
        others, or on a micro-step's later backward.
        """
        weighted = weight is not None
        if first and window.weighted is not None and weighted != window.weighted:
            raise ValueError(
                "pass weight= on every micro-step of a window or on none: this window "
                f"started {'with' if window.weighted else 'without'} weights"
            )
        if not first and weighted:
            raise ValueError(
                "weight= belongs to the micro-step: pass it on the micro-step's first "
                "backward only (the later ones take the same weight)"
            )
        w: Any = 1
        reference = self.reference
        if weight is not None:
            w = checked_weight(weight)
            if reference is None:
                reference = agreed_reference(w, self.every, self.sharded, self.group)
        elif not first and window.weighted:
            w = self.micro_weight
        applies = window.weighted or weighted
        return scaled_loss(loss, self.every, w if applies else None, reference), w, reference

    def commit(self, weight: Any, reference: Any) -> None:
        """A weighted micro-step's first backward succeeded: keep its weight and the reference."""
        self.reference, self.micro_weight = reference, weight

    def state(self) -> Any:
        """The reference, for a checkpoint (a host value)."""
        ref = self.reference
        return ref.detach().cpu() if isinstance(ref, torch.Tensor) else ref
