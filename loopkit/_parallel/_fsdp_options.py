"""``distributed.wrap``'s FSDP2 options (``fully_shard``'s own): checked before anything
changes, then handed to each ``fully_shard`` call (the blocks', then the root's)."""

from __future__ import annotations

import sys
import warnings
from dataclasses import dataclass
from typing import Any

import torch

from .._job import DistInfo
from ._grad_sync import unwrap

_FSDP_ONLY = ("mesh", "mp_policy", "reshard_after_forward", "offload_policy")


@dataclass(frozen=True)
class FsdpOptions:
    """What each ``fully_shard`` call of one ``wrap`` gets."""

    mesh: Any = None
    mp_policy: Any = None
    reshard_after_forward: bool | int | None = None
    offload_policy: Any = None

    def _common(self) -> dict[str, Any]:
        given = {"mp_policy": self.mp_policy, "offload_policy": self.offload_policy}
        return {k: v for k, v in given.items() if v is not None}  # else fully_shard's default

    def block(self, index: int, count: int) -> dict[str, Any]:
        """Keywords for the ``index``-th of ``count`` blocks: the user's value for each; by
        default each reshards after its forward except the last, whose parameters the
        backward needs at once (torchtitan's default: one all-gather fewer per step)."""
        reshard = self.reshard_after_forward
        if reshard is None:
            reshard = index < count - 1
        return {**self._common(), "reshard_after_forward": reshard}

    def root(self) -> dict[str, Any]:
        """Keywords for the root: the user's value; else none, so the root gets fully_shard's
        own default, which keeps its parameters after the forward (the backward starts with
        them) on every torch: 2.6/2.7 default True and never reshard the root after its
        forward, 2.8+ default None (False for the root). torch < 2.8 refuses None itself."""
        given = {"reshard_after_forward": self.reshard_after_forward}
        return {**self._common(), **{k: v for k, v in given.items() if v is not None}}


def _fsdp_class(name: str) -> Any:
    """``torch.distributed.fsdp.<name>``, or None if nothing imported that package (then no
    object can be one: loopkit never imports it for a check, it costs about 1.6 s)."""
    module = sys.modules.get("torch.distributed.fsdp")
    return None if module is None else getattr(module, name, None)


def _device_mesh_class() -> Any:
    module = sys.modules.get("torch.distributed.device_mesh")
    return None if module is None else getattr(module, "DeviceMesh", None)


def check_fsdp_options(
    here: DistInfo,
    fsdp: object,
    replicate: int | None,
    ddp_kwargs: dict[str, Any],
    **given: Any,
) -> FsdpOptions:
    """Refuse what ``fully_shard`` would refuse, or silently ignore, before any state changes;
    the options each call then gets."""
    named = [f"{k}=" for k in _FSDP_ONLY if given.get(k) is not None]
    if fsdp is False:
        if named:
            raise ValueError(
                f"{', '.join(named)} {'is an option' if len(named) == 1 else 'are options'} "
                "of FSDP2 (torch's fully_shard) and mean nothing to DDP: give fsdp=BlockClass "
                "(or fsdp=True) to shard the model, or drop them"
            )
        return FsdpOptions()
    if ddp_kwargs:
        raise TypeError(
            f"{', '.join(f'{k}=' for k in ddp_kwargs)}: DDP's keyword(s), which FSDP2 "
            "(fsdp=) does not take: its options are mesh=, mp_policy=, "
            "reshard_after_forward= and offload_policy= (drop fsdp= to wrap in DDP)"
        )
    mesh, mp_policy = given.get("mesh"), given.get("mp_policy")
    reshard, offload = given.get("reshard_after_forward"), given.get("offload_policy")
    policy_class = _fsdp_class("MixedPrecisionPolicy")
    if mp_policy is not None and (policy_class is None or not isinstance(mp_policy, policy_class)):
        raise TypeError(
            "mp_policy must be a torch.distributed.fsdp.MixedPrecisionPolicy, got "
            f"{type(mp_policy).__name__}"
        )
    offload_class = _fsdp_class("OffloadPolicy")
    if offload is not None:
        if offload_class is None or not isinstance(offload, offload_class):
            raise TypeError(
                "offload_policy must be a torch.distributed.fsdp.CPUOffloadPolicy (or "
                f"OffloadPolicy), got {type(offload).__name__}"
            )
        if here.device.type == "cpu" and getattr(offload, "pin_memory", False):
            raise ValueError(
                "CPUOffloadPolicy(pin_memory=True) pins host memory for copies to an "
                "accelerator, and this job runs on the CPU (torch cannot pin memory without "
                "one): pass CPUOffloadPolicy(pin_memory=False), or no offload_policy (the "
                "shards are in host memory already)"
            )
    shard_size = here.world_size // (replicate or 1)
    if mesh is not None:
        mesh_class = _device_mesh_class()
        if mesh_class is None or not isinstance(mesh, mesh_class):
            raise TypeError(
                "mesh must be a torch.distributed.device_mesh.DeviceMesh (init_device_mesh), "
                f"got {type(mesh).__name__}"
            )
        if replicate is not None:
            raise ValueError(
                "give mesh= or replicate=, not both: replicate=R builds the HSDP mesh "
                "(R, world_size // R) itself; a 2-D mesh= of your own is HSDP over its first "
                "dimension"
            )
        if mesh.ndim not in (1, 2):
            raise ValueError(
                f"mesh must be 1-D (FSDP) or 2-D (HSDP: replicas x shards), got {mesh.ndim}-D: "
                "pass the data-parallel part of your mesh (mesh['dp'], say)"
            )
        if mesh.size() != here.world_size:
            raise ValueError(
                f"the mesh spans {mesh.size()} ranks but this job has {here.world_size}: "
                "wrap shards over every process (a mesh of all ranks)"
            )
        if mesh.device_type != here.device.type:
            raise ValueError(
                f"the mesh is on {mesh.device_type!r} but this process trains on "
                f"{here.device.type!r}: build it with init_device_mesh({here.device.type!r}, ...)"
            )
        shard_size = mesh.size(mesh.ndim - 1)
    if reshard is not None and not isinstance(reshard, bool):
        if not isinstance(reshard, int) or reshard < 2:
            raise ValueError(
                "reshard_after_forward must be True, False, None (the default) or an int >= 2 "
                f"(the group size to reshard to), got {reshard!r}"
            )
        if here.is_distributed and shard_size % reshard:
            raise ValueError(
                f"reshard_after_forward={reshard} does not divide the {shard_size} ranks each "
                "parameter is sharded over: give a divisor (the ranks of one node, say)"
            )
    if mp_policy is not None and not here.is_distributed:
        warnings.warn(
            "wrap(mp_policy=) in a single process: the model is returned as it is (no FSDP2), "
            "so it computes in its own dtype; the policy applies once the job runs on several "
            "processes. For lower precision in one process use loopkit.step(precision='bf16')",
            UserWarning,
            stacklevel=3,
        )
    return FsdpOptions(mesh, mp_policy, reshard, offload)


def _param_dtypes(model: Any) -> set[Any]:
    """The ``param_dtype`` of each FSDP2 module's ``MixedPrecisionPolicy`` that sets one."""
    fsdp2 = _fsdp_class("FSDPModule")
    if fsdp2 is None:
        return set()
    found = set()
    for m in unwrap(model).modules():
        if isinstance(m, fsdp2):
            # torch has no public getter: FSDPState._mp_policy (2.6 to 2.13, checked by
            # tests/parallel/test_fsdp_options.py). Gone, the check would pass silently: say so.
            state = m._get_fsdp_state()
            if not hasattr(state, "_mp_policy"):
                warnings.warn(
                    f"loopkit cannot read the FSDP2 MixedPrecisionPolicy on torch "
                    f"{torch.__version__} (FSDPState._mp_policy is gone), so precision= is not "
                    "checked against its param_dtype: give both one dtype yourself, and "
                    "report this to loopkit",
                    UserWarning,
                    stacklevel=4,
                )
                return set()
            dtype = getattr(state._mp_policy, "param_dtype", None)
            if dtype is not None:
                found.add(dtype)
    return found


def check_precision(model: Any, precision: str) -> None:
    """Refuse autocast to one dtype over FSDP2 parameters gathered in another; warn where a
    float16 policy computes with nothing scaling the loss. Before anything changes.

    The same dtype composes (measured bit-identical to the hand-written loop): FSDP2 gathers
    and computes in it, autocast adds its float32 ops (softmax, losses) and, for fp16, the
    GradScaler's loss scaling; the gradients are reduced in ``reduce_dtype`` and clipped as
    float32 shards either way.
    """
    dtypes = _param_dtypes(model)
    if not dtypes:
        return
    names = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
    wanted = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    other = sorted(str(d).removeprefix("torch.") for d in dtypes if d != wanted)
    if wanted is not None and other:
        match = [names[d] for d in dtypes if d in names and d != torch.float32]
        hint = f"precision={match[0]!r} with this policy, " if len(match) == 1 else ""
        raise ValueError(
            f"precision={precision!r} autocasts to {str(wanted).removeprefix('torch.')} but "
            f"the model's FSDP2 MixedPrecisionPolicy gathers its parameters in "
            f"{', '.join(other)}: each matmul would round those weights a second time, and "
            "their gradients would come back in the policy's dtype. Use one dtype: "
            f"{hint}precision='fp32' (the policy alone), or MixedPrecisionPolicy("
            f"param_dtype=torch.{str(wanted).removeprefix('torch.')})"
        )
    if wanted is None and torch.float16 in dtypes:
        warnings.warn(
            "the model computes in float16 (its FSDP2 MixedPrecisionPolicy) and nothing scales "
            "the loss: small gradients underflow to zero. Add precision='fp16' (its GradScaler "
            "scales the loss), or use param_dtype=torch.bfloat16",
            UserWarning,
            stacklevel=3,
        )
