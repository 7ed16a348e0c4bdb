"""evaluate's side of a loader that ``accelerator.prepare`` made (a ``BatchSamplerShard``)."""

from __future__ import annotations

from typing import Any

from torch.utils.data import SequentialSampler

from .. import _ranks


def accelerate_shard(shard: Any, processes: int, disjoint: bool) -> tuple[Any, bool, int | None]:
    """A loader ``accelerator.prepare`` made: the batch sampler it shards, whether the ranks'
    samples are disjoint, and how many of this rank's are real (None: all).

    With ``even_batches=True`` (its default) Accelerate fills the last round of batches with
    samples from the start. Over a sequential sampler the deal is deterministic, so every
    rank's batches are dealt again here (indices only, no data): a sample's first deal is
    real, its repeats are padding, and they are this rank's last samples.
    """
    if processes == 1:
        return shard.batch_sampler, disjoint, None
    if not getattr(shard, "even_batches", True):
        return shard.batch_sampler, True, None  # each batch goes to one process, once
    rank, world = _ranks.world()
    if (processes, shard.process_index) != (world, rank):
        raise ValueError(
            f"the loader Accelerate prepared is for process {shard.process_index} of "
            f"{processes}, but this is rank {rank} of {world}"
        )
    if not isinstance(getattr(shard.batch_sampler, "sampler", None), SequentialSampler):
        raise ValueError(
            "evaluate got a loader Accelerate prepared with even_batches=True over a shuffled "
            "sampler: the samples it repeats to fill the last batches cannot be told from real "
            "ones. Prepare a loader with shuffle=False, or Accelerator(even_batches=False), or "
            "use loopkit.distributed.loader(data, shuffle=False)"
        )
    dealt = [[list(b) for b in type(shard)(
        shard.batch_sampler, num_processes=processes, process_index=r,
        split_batches=shard.split_batches, even_batches=True,
    )] for r in range(processes)]  # fmt: skip
    seen: set[int] = set()
    real = [0] * processes  # each rank's first-dealt samples
    dealt_so_far = [0] * processes  # each rank's samples, repeats included
    for k in range(max(len(d) for d in dealt)):
        for r in range(processes):
            for index in dealt[r][k] if k < len(dealt[r]) else ():
                if index not in seen:
                    if real[r] != dealt_so_far[r]:  # a repeat before a real sample: no tail
                        raise ValueError(
                            "evaluate cannot tell Accelerate's padding from real samples in "
                            "this loader: prepare it under Accelerator(even_batches=False)"
                        )
                    seen.add(index)
                    real[r] += 1
                dealt_so_far[r] += 1
    return shard.batch_sampler, True, real[rank]
