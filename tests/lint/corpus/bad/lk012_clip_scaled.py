# expect: LK012
"""fp16 with a GradScaler, clipped before unscaling (minGPT-ddp's trainer)."""
import torch


def train_step(model, optimizer, scaler, x, y):
    optimizer.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.float16):
        loss = torch.nn.functional.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # <- LK012
    scaler.step(optimizer)
    scaler.update()
