"""HF transformers' ``run_clm_no_trainer.py`` loop, ported from Accelerate to loopkit.

A tiny random GPT-2 (built from a config: no download) on padded synthetic documents
(``labels=-100`` on the padding), accumulation 4 over 38 batches per epoch (so the last
window of each epoch holds 2), then perplexity on held-out documents. What replaced what:

- ``accelerator.accumulate`` + ``backward`` + ``step`` + ``zero_grad`` -> ``loopkit.step``,
  with ``weight=`` each micro-batch's target tokens: the update is the one of a single
  batch holding all of them, the ragged window normalized by its true size;
- ``accelerator.gather_for_metrics`` -> ``loopkit.evaluate`` with ``ratio("nll", "tokens")``:
  every document counted once on any number of processes, perplexity from exact totals;
- ``save_state``/``load_state`` and skipping batches by arithmetic -> ``Checkpointer`` +
  ``until``: a relaunch resumes at the next batch, bit-identically, and a SIGTERM saves.

    python examples/port_accelerate_clm.py --dir runs/clm
    torchrun --standalone --nproc-per-node 2 examples/port_accelerate_clm.py --dir runs/clm2

Run it again with the same --dir and it resumes; once finished, it reports and exits.
"""

from __future__ import annotations

import argparse
import math
from typing import Any

import torch
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel

import loopkit
from loopkit import distributed

VOCAB, LENGTH = 64, 24


def documents(n: int, seed: int) -> torch.utils.data.TensorDataset:
    """Documents of random lengths (each counts up from a random token), right-padded with
    token 0; labels -100 where padded."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, VOCAB - 1, (n, 1), generator=g)
    ids = (start + torch.arange(LENGTH)) % (VOCAB - 1) + 1
    lengths = torch.randint(6, LENGTH + 1, (n,), generator=g)
    mask = (torch.arange(LENGTH) < lengths[:, None]).long()
    ids = ids * mask  # 0 is the padding token
    labels = ids.masked_fill(mask == 0, -100)
    return torch.utils.data.TensorDataset(ids, mask, labels)


def nll_and_tokens(model: nn.Module, batch: Any) -> dict[str, torch.Tensor]:
    """Per document: its summed next-token NLL and its number of predicted tokens."""
    ids, mask, labels = batch
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
    target = labels[:, 1:]
    nll = nn.functional.cross_entropy(logits.transpose(1, 2).float(), target,
                                      ignore_index=-100, reduction="none").sum(1)  # fmt: skip
    return {"nll": nll, "tokens": (target != -100).sum(1).float()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="runs/port-clm", help="checkpoints (resumed from)")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--out", help="save the final weights here (rank zero)")
    args = parser.parse_args(argv)

    with distributed.setup() as info:
        torch.manual_seed(0)
        config = GPT2Config(vocab_size=VOCAB, n_positions=LENGTH, n_embd=32, n_layer=2,
                            n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                            bos_token_id=0, eos_token_id=0)  # fmt: skip
        model = distributed.wrap(GPT2LMHeadModel(config))
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda u: 1 / (1 + 0.05 * u))
        # 152 documents, 4 per batch: 38 batches per epoch (of all processes together).
        per_rank = 4 // info.world_size if 4 % info.world_size == 0 else 4
        loader = distributed.loader(documents(152, seed=1), batch_size=per_rank, seed=0,
                                    num_workers=0)  # fmt: skip
        val = distributed.loader(documents(37, seed=2), batch_size=8, shuffle=False,
                                 num_workers=0)  # fmt: skip
        step = loopkit.step(model, optimizer, accumulate=4, scheduler=scheduler,
                            clip_grad_norm=1.0)  # fmt: skip
        ckpt = loopkit.Checkpointer(
            args.dir, model=model, optimizer=optimizer, scheduler=scheduler, step=step,
            loader=loader, keep=2,
        )  # fmt: skip
        stop = loopkit.until(step, max_epochs=args.epochs, checkpointer=ckpt)
        resumed = ckpt.resume()
        if resumed is not None and info.is_rank_zero:
            print(f"resumed from {resumed.name} at update {step.updates}", flush=True)
        for epoch in stop.epochs(loader):
            for ids, mask, labels in step.iterate(loader):
                with step as s:
                    # HF's loss: the mean NLL over this micro-batch's predicted tokens.
                    loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
                    s.backward(loss, weight=(labels[:, 1:] != -100).sum())
                ckpt.maybe_save(every=5)
                if stop.check():
                    break
            result = loopkit.evaluate(model, val, nll_and_tokens)
            if info.is_rank_zero:
                ppl = math.exp(result.ratio("nll", "tokens"))
                print(f"epoch {epoch}: {step.updates} updates, perplexity {ppl:.4f} "
                      f"over {result.samples} documents", flush=True)  # fmt: skip
        # A relaunch after the end runs no epoch: report from what exists before the loop.
        result = loopkit.evaluate(model, val, nll_and_tokens)
        if info.is_rank_zero:
            print(f"finished: {step.updates} updates ({stop.reason}); perplexity "
                  f"{math.exp(result.ratio('nll', 'tokens')):.6f}", flush=True)  # fmt: skip
            if args.out:
                inner = getattr(model, "module", model)
                torch.save({k: v.detach().clone() for k, v in inner.state_dict().items()},
                           args.out)  # fmt: skip


if __name__ == "__main__":
    main()
