# expect: LK014
"""nanoGPT's estimate_loss: one host read per evaluation batch."""
import torch


@torch.no_grad()
def estimate_loss(model, get_batch, eval_iters: int = 200):
    out = {}
    model.eval()
    for split in ["train", "val"]:
        losses = torch.zeros(eval_iters)
        for k in range(eval_iters):
            x, y = get_batch(split)
            _, loss = model(x.to("cuda"), y.to("cuda"))
            losses[k] = loss.item()  # <- LK014
        out[split] = losses.mean()
    model.train()
    return out
