"""``loopkit.distributed.wrap``: DDP, or FSDP2 per block, for the job this process is in;
``compile=`` compiles first, in the order that gives the fewest graph breaks."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .._blocks import Blocks, select_blocks
from .._compile import _order
from .._compile._options import CompileLike, compile_options
from .._job import info
from . import _materialize
from ._fsdp_options import check_fsdp_options
from ._grad_sync import sync_kind


def wrap(
    model: nn.Module,
    *,
    fsdp: bool | Blocks = False,
    replicate: int | None = None,
    mesh: Any = None,
    mp_policy: Any = None,
    reshard_after_forward: bool | int | None = None,
    offload_policy: Any = None,
    compile: CompileLike = False,
    init: _materialize.Init | None = None,
    **ddp_kwargs: Any,
) -> nn.Module:
    """Wrap ``model`` in DDP (or FSDP2 with ``fsdp=True``/``fsdp=BlockClass``) for this job.

    Moves the model to this process's device first. Single-process it returns the model
    unchanged. ``fsdp=BlockClass`` shards each such block, then the root. ``replicate=R``
    with ``fsdp=``: HSDP, FSDP2 on a 2-D mesh of R replicas, each sharded over
    ``world_size // R`` ranks (shards within a node, replicas across nodes: give each node
    its shard group, R the number of nodes).

    ``compile=True`` (or a dict of ``torch.compile``'s keywords) compiles in place, after
    any ``loopkit.checkpointed`` and before wrapping: each ``fsdp=`` block on its own (as
    torchtitan does; on one process too), else the whole model, which DDP then wraps
    (``DDP(compile(model))``: no graph break, where ``compile(DDP(model))`` has several).
    The state-dict keys stay the model's own: no ``_orig_mod.``.

    FSDP2's options (``fully_shard``'s own; with ``fsdp=`` only, as DDP's keywords go with
    DDP only): ``mp_policy=`` (a ``MixedPrecisionPolicy``: the dtype parameters are gathered
    and computed in, gradients reduced in), ``offload_policy=`` (a ``CPUOffloadPolicy``;
    ``pin_memory=False`` on a CPU job), ``mesh=`` (a ``DeviceMesh`` of every rank: 1-D shards,
    2-D is HSDP over its first dimension; not with ``replicate=``) and
    ``reshard_after_forward=`` (True, False, or a group size to reshard to): given, each block
    and the root get it (torch < 2.8 keeps the root's parameters whatever is given); by
    default each block but the last reshards after its forward and the root keeps its
    parameters (fully_shard's own default), as torchtitan does. Single-process they are
    checked and do nothing (``mp_policy=`` warns: the model computes in its own dtype).

    A model built under ``torch.device("meta")`` is sharded there, then materialized on
    this process's device (one process: there; DDP: whole on each rank) and initialized by
    ``distributed.materialize``: each module's ``reset_parameters()``, or ``init=fn(model)``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"wrap() takes an nn.Module, got {type(model).__name__}")
    options = compile_options(compile, "compile")
    if options is not None:
        _order.refuse_compiled_twice(model)
    if replicate is not None:
        world = info().world_size
        if fsdp is False:
            raise ValueError(
                "replicate= builds HSDP, a sharded model: give fsdp=BlockClass (or fsdp=True) too"
            )
        if isinstance(replicate, bool) or not isinstance(replicate, int) or replicate < 1:
            raise ValueError(
                f"replicate must be an int >= 1 (replicas of the model), got {replicate!r}"
            )
        if world % replicate:
            raise ValueError(
                f"replicate={replicate} does not divide the {world} processes of this job: each "
                "replica must shard over the same number of ranks"
            )
    if sync_kind(model) != "none":
        raise ValueError(
            f"the model is already wrapped ({sync_kind(model).upper()}): wrap it once; pass "
            "the unwrapped module to loopkit.distributed.wrap"
        )
    meta = _materialize.check(model, init)  # refuses before anything changes
    here = info()
    shard = check_fsdp_options(here, fsdp, replicate, ddp_kwargs, mesh=mesh, mp_policy=mp_policy,
                               reshard_after_forward=reshard_after_forward,
                               offload_policy=offload_policy)  # fmt: skip
    blocks = None if fsdp is False or fsdp is True else select_blocks(model, fsdp)
    if fsdp is not False and here.is_distributed:
        _order.warn_if_sharded_after_compile(model)
    if options is not None:  # everything checked: compile, then wrap
        _order.compile_in_place(model, blocks, options)
    if not here.is_distributed:
        return _materialize.fill(model, init, here.device) if meta else model
    if not meta:
        model = model.to(here.device)
    if fsdp is not False:
        from torch.distributed.fsdp import fully_shard

        mesh = shard.mesh
        if replicate is not None:
            from torch.distributed.device_mesh import init_device_mesh

            mesh = init_device_mesh(here.device.type, (replicate, here.world_size // replicate),
                                    mesh_dim_names=("replicate", "shard"))  # fmt: skip
        for i, block in enumerate(blocks or []):
            fully_shard(block, mesh=mesh, **shard.block(i, len(blocks or [])))
        fully_shard(model, mesh=mesh, **shard.root())
        if not meta:
            return model
        from torch.distributed.fsdp import CPUOffloadPolicy

        # Offloaded shards live in host memory: FSDP2 refuses them materialized elsewhere.
        offloaded = isinstance(offload_policy, CPUOffloadPolicy)
        return _materialize.fill(model, init, torch.device("cpu") if offloaded else here.device)
    if here.device.type == "cuda":
        ddp_kwargs.setdefault("device_ids", [here.device.index])
    if meta:  # DDP holds the whole model on each rank: materialize it whole first
        _materialize.fill(model, init, here.device)
    return nn.parallel.DistributedDataParallel(model, **ddp_kwargs)
