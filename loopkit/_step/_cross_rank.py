"""The normalization factor at a window's end when other ranks are involved.

The math is ``_normalize``'s; what is added here is the one collective each case needs,
so that every rank computes the same factor (and raises together on a bad weight).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from .. import _ranks
from .._parallel._grad_sync import sync_grads_now
from .._sync_points import expected_sync
from .._types import SyncKind
from . import _source
from ._misuse import user_frame
from ._normalize import BAD_WEIGHT, boundary_factor, by_hand_factor, reference_weight
from ._params import OptimizerParams
from ._window import Window

FOREIGN = (
    "this window made no backward of its own (s.backward(loss) in `with step as s:`), yet "
    "its optimizer's parameters received gradients: from another step's backward through the "
    "same model, or a loss.backward() called directly (call s.backward(loss) instead). One "
    "model with two optimizers in two steps is not supported: give both parameter groups to "
    "one optimizer (per-group lr and weight decay are kept). The window was dropped"
)


def foreign_message() -> str:
    """The refusal of a window trained by a backward it did not make, naming the user's direct
    ``.backward()`` lines where the code around the window shows them (read only when
    refusing: no cost to a window that closes)."""
    lines = _source.direct_backwards(user_frame())
    if not lines:
        return FOREIGN
    return (
        f"this window made no backward of its own, yet its optimizer's parameters received "
        f"gradients: {', '.join(lines)} calls .backward() on a loss directly, which loopkit "
        "neither scales for the window nor counts. Inside `with step as s:` call "
        "s.backward(loss) instead (acc.backward(loss) with loopkit.accumulate). The window "
        "was dropped"
    )


def window_factor(window: Window, every: int, w_ref: Any, sharded: bool, group: Any) -> Any:
    """The boundary factor; weighted windows sum their weights over ranks first (one collective).

    ``sharded``: gradients were averaged over the ranks of ``group`` (DDP, FSDP).
    """
    if not window.weighted:
        return boundary_factor(window.n_backward, every, weighted=False)
    total, bad, world = window.weight_sum, window.bad_device_weight(), 1
    if sharded:
        # The denominator is the sum of weights over ranks. A bad weight on any rank travels
        # in the same collective, so every rank raises together.
        summed = _ranks.sum_values([total, bad], group)
        total, bad, world = summed[0], summed[1] > 0, _ranks.world(group)[1]
    if window.weight_min is not None:
        # Host-device sync, once per window and only for weights kept on a device: a
        # non-positive or non-finite weight must not reach the parameters.
        with expected_sync("the weights' check"):
            refuse = bool(bad.item())
        if refuse:
            raise ValueError(BAD_WEIGHT)
    return boundary_factor(window.n_backward, every, True, total, w_ref, world)


def sync_by_hand(
    model: nn.Module, window: Window, every: int, w_ref: Any, has_grads: bool, group: Any
) -> float | None:
    """All-reduce a DDP window's local gradients; the factor every rank normalizes by.

    One collective carries the gradients (aligned by parameter) and what the factor needs;
    every decision below is made from those reduced values, so it is the same on every
    rank, even on a rank that made no backward at all. None: no rank made one.
    """
    weighted, n = bool(window.weighted), window.n_backward
    with expected_sync("the weights' check"):
        # Host-device syncs, only on this rare path and only for weights on a device.
        weight_sum = float(window.weight_sum) if weighted else 0.0
        bad = float(window.bad_device_weight())
        ref = float(w_ref) if weighted else 0.0
    # As without DDP: only a window with no backward of its own whose parameters were
    # trained by another backward raises (gradients cleared as it opened are not its own).
    foreign = window.foreign(has_grads)
    extras = [
        0.0 if weighted else float(n),  # unweighted backward calls
        float(n) if weighted else 0.0,  # weighted backward calls
        weight_sum,
        ref,
        float(weighted),  # ranks whose weight reference is in the sum above
        bad,
        float(foreign),
    ]
    n_plain, n_weighted, total, ref_sum, refs, bad_ranks, foreign_ranks = sync_grads_now(
        model, extras
    )
    if foreign_ranks:
        raise RuntimeError(foreign_message())
    if bad_ranks:
        raise ValueError(BAD_WEIGHT)
    world = _ranks.world(group)[1]
    return by_hand_factor(n_plain, n_weighted, total, ref_sum, refs, every, world)


def agreed_reference(first_weight: Any, every: int, sharded: bool, group: Any) -> Any:
    """The weighted reference, averaged over ranks so every rank scales its loss alike."""
    ref = reference_weight(first_weight, every)
    if sharded:
        ref = _ranks.sum_values([ref], group)[0] / _ranks.world(group)[1]
    return ref


def end_of_window(
    model: nn.Module,
    kind: SyncKind,
    window: Window,
    every: int,
    reference: Any,
    params: OptimizerParams,
    group: Any,
) -> tuple[bool, Any]:
    """Whether a closing window makes an update, and the factor for its summed gradients.

    Every rank takes the same path: under DDP, gradients still local at the window's end
    (no rank made a synced backward in its last micro-step; had one made it, DDP would wait
    for every rank) are all-reduced by hand here, by every rank.
    """
    if kind == "ddp" and not (window.n_backward and window.last_synced):
        factor = sync_by_hand(model, window, every, reference, params.have_grads(), group)
        return factor is not None, factor
    if window.n_backward == 0:
        if window.foreign(params.have_grads()):
            # Its parameters are trained by a backward it did not make, and would silently
            # never be updated.
            raise RuntimeError(foreign_message())
        return False, None
    return True, window_factor(window, every, reference, kind != "none", group)
