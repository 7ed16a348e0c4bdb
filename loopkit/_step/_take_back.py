"""What a probe's trial changes, saved before it and put back after it: the weights, the
optimizer's state, the RNGs, every gradient, and what DDP and FSDP2 keep from one backward
to the next.

A trial runs forward and backward without gradient sync. Under FSDP2 (and HSDP) that keeps
the trial's gradient unreduced inside FSDP2 (each ``FSDPParam``'s unsharded gradient, or
its ``unsharded_accumulated_grad`` under a ``reduce_dtype``), for the next synced backward
to add: ``optimizer.zero_grad()`` does not reach it. A trial cut short by an out-of-memory
error leaves FSDP2's iteration state half done (training states, unsharded parameters, its
post-backward callback marked queued); FSDP2's ``reset_iter_state`` is its recovery.
Under DDP a forward without sync turns off the buffer broadcast of the next forward
(``require_forward_param_sync``), and with ``find_unused_parameters=True`` the reducer
marks the parameters the trial used as used in the next synced backward.
"""

from __future__ import annotations

import copy
import random
from typing import Any

import numpy as np
import torch
from torch import nn

from .._parallel._grad_sync import _fsdp_types, sync_kind, unwrap

# A gradient as it stood: the tensor (None: there was none) and a copy of its values, put
# back into that same tensor (a trial's backward adds into an existing gradient in place).
_Grad = tuple[torch.Tensor | None, torch.Tensor | None]


def _saved(grad: torch.Tensor | None) -> _Grad:
    return grad, None if grad is None else grad.detach().clone()


def _put_back(grad: _Grad) -> torch.Tensor | None:
    tensor, values = grad
    if tensor is not None and values is not None:
        with torch.no_grad():
            tensor.copy_(values)
    return tensor


class _Fsdp2Grads:
    """The gradients FSDP2 holds outside ``.grad`` (none before training), for every
    ``FSDPParam`` of the model's FSDP2 modules; and their roots, to reset after a failure."""

    def __init__(self, model: nn.Module) -> None:
        fsdp2 = _fsdp_types()[0]
        self.modules = [m for m in unwrap(model).modules() if isinstance(m, fsdp2)]
        self.params: list[tuple[Any, _Grad, _Grad]] = []
        for module in self.modules:
            for group in _groups(module):
                for p in group.fsdp_params:
                    accumulated = getattr(p, "unsharded_accumulated_grad", None)
                    self.params.append((p, _saved(accumulated), _saved(_unsharded_grad(p))))

    def restore(self, failed: bool) -> None:
        if failed:
            # A forward or backward cut short: FSDP2's own recovery, on each root (the
            # outermost FSDP2 modules forwarded; a torch without it has none to call).
            for module in self.modules:
                reset = getattr(module, "reset_iter_state", None)
                if reset is not None and getattr(module._get_fsdp_state(), "_is_root", None):
                    reset()
        for p, accumulated, unsharded in self.params:
            if hasattr(p, "unsharded_accumulated_grad"):
                p.unsharded_accumulated_grad = _put_back(accumulated)
            param = getattr(p, "_unsharded_param", None)  # made at the first all-gather
            if param is not None:
                param.grad = _put_back(unsharded)


def _groups(module: Any) -> list[Any]:
    """An FSDP2 module's parameter groups (one, held otherwise, in older torch)."""
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        one = getattr(state, "_fsdp_param_group", None)
        groups = [] if one is None else [one]
    return list(groups)


def _unsharded_grad(p: Any) -> torch.Tensor | None:
    param = getattr(p, "_unsharded_param", None)
    return None if param is None else param.grad


class _DdpState:
    """DDP's flags a forward without sync changes; its reducer's record of the parameters
    used, with ``find_unused_parameters=True``."""

    def __init__(self, model: nn.Module) -> None:
        self.ddp: Any = unwrap(model)
        self.forward_sync = self.ddp.require_forward_param_sync

    def restore(self) -> None:
        self.ddp.require_forward_param_sync = self.forward_sync
        if getattr(self.ddp, "find_unused_parameters", False):
            # Forgets the parameters the trial used: else the next synced backward counts
            # them as used on this rank (zero gradients where training has none).
            self.ddp.reducer._reset_state()


class Saved:
    """Weights, buffers, optimizer state, gradients, RNGs and the sync wrappers' state as
    they stood: put back after each trial."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer
        self.weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
        self.optim = copy.deepcopy(optimizer.state_dict())
        params = {id(p): p for p in model.parameters()}
        params.update((id(p), p) for g in optimizer.param_groups for p in g["params"])
        self.grads = [(p, _saved(p.grad)) for p in params.values()]
        kind = sync_kind(model)
        self.fsdp2 = _Fsdp2Grads(model) if kind == "fsdp2" else None
        self.ddp = _DdpState(model) if kind == "ddp" else None
        # By hand, not the Checkpointer's RNG capture: _step must not import _checkpoint.
        self.torch_rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
        self.py_rng, self.np_rng = random.getstate(), np.random.get_state()

    def restore(self, failed: bool = False) -> None:
        """Put everything back; ``failed``: the trial raised (its forward or backward may be
        cut short)."""
        if self.fsdp2 is not None:
            self.fsdp2.restore(failed)  # first: resharded before the weights are written
        if self.ddp is not None:
            self.ddp.restore()
        with torch.no_grad():
            for k, v in self.model.state_dict().items():
                v.copy_(self.weights[k])
        self.optimizer.load_state_dict(copy.deepcopy(self.optim))
        for p, grad in self.grads:
            p.grad = _put_back(grad)
        torch.set_rng_state(self.torch_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)
        random.setstate(self.py_rng)
        np.random.set_state(self.np_rng)
