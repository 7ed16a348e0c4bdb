"""What a checkpointed region keeps for backward: the policy presets and the settings object."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from typing import Literal, TypeAlias

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

PolicyFn: TypeAlias = Callable[..., "CheckpointPolicy | bool"]
Policy: TypeAlias = "Literal['full', 'save_matmuls'] | PolicyFn | Iterable[torch._ops.OpOverload]"
# checkpoint()'s context_fn: the forward's and the recompute's selective-checkpoint modes.
ContextFn: TypeAlias = (
    "Callable[[], tuple[AbstractContextManager[object], AbstractContextManager[object]]]"
)

_aten = torch.ops.aten
# Outputs worth keeping: expensive to recompute, and what backward of the matmul-like ops
# reads anyway. Everything else (pointwise, norms, activations) is cheap to recompute.
SAVE_MATMULS_OPS: frozenset[torch._ops.OpOverloadPacket] = frozenset(
    getattr(_aten, name)
    for name in (
        "mm",
        "addmm",
        "bmm",
        "baddbmm",
        "convolution",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_flash_attention_forward",
        "_efficient_attention_forward",
    )
    if hasattr(_aten, name)
)


def save_matmuls(ctx: object, op: object, *args: object, **kwargs: object) -> CheckpointPolicy:
    """The ``"save_matmuls"`` policy: keep the outputs of ``SAVE_MATMULS_OPS``."""
    if getattr(op, "overloadpacket", op) in SAVE_MATMULS_OPS:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def context_fn(policy: Policy) -> ContextFn | None:
    """checkpoint()'s ``context_fn`` for ``policy``; None for ``"full"`` (recompute all)."""
    if isinstance(policy, str):
        if policy == "full":
            return None
        if policy == "save_matmuls":
            return functools.partial(create_selective_checkpoint_contexts, save_matmuls)
        raise ValueError(
            f"unknown checkpoint policy {policy!r}: use 'full' (recompute everything), "
            "'save_matmuls' (keep matmul/conv/attention outputs, recompute the rest), a "
            "function (ctx, op, *args, **kwargs) -> CheckpointPolicy, or a list of ops to save"
        )
    if callable(policy):
        return functools.partial(create_selective_checkpoint_contexts, policy)
    if isinstance(policy, Iterable):
        ops = list(policy)
        if not ops or not all(
            isinstance(op, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)) for op in ops
        ):
            raise ValueError(
                "a list policy must hold torch ops to save, e.g. [torch.ops.aten.mm.default]"
            )
        return functools.partial(create_selective_checkpoint_contexts, ops)
    raise TypeError(f"policy must be a preset name, a function or a list of ops, got {policy!r}")


class RecomputeConfig:
    """What a checkpointed callable runs with; compared to tell re-application apart."""

    __slots__ = ("context_fn", "policy", "preserve_rng_state")

    def __init__(self, policy: Policy, preserve_rng_state: bool) -> None:
        if not isinstance(preserve_rng_state, bool):
            raise TypeError(f"preserve_rng_state must be True or False, got {preserve_rng_state!r}")
        self.policy = policy
        self.preserve_rng_state = preserve_rng_state
        self.context_fn = context_fn(policy)

    def same_as(self, other: RecomputeConfig) -> bool:
        return self.policy == other.policy and self.preserve_rng_state == other.preserve_rng_state
