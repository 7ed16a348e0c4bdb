# expect: LK002
"""nanoGPT's shape: backward in an inner micro-step loop, the update and the sync outside it."""
import torch

gradient_accumulation_steps = 8
log_interval = 10
max_iters = 5000


def train(model, get_batch, optimizer, scaler, ctx):
    iter_num = 0
    while True:
        for micro_step in range(gradient_accumulation_steps):
            X, Y = get_batch("train")
            with ctx:
                logits, loss = model(X, Y)
                loss = loss / gradient_accumulation_steps
            scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        lossf = loss.item() * gradient_accumulation_steps  # <- LK002
        if iter_num % log_interval == 0:
            print(f"iter {iter_num}: loss {lossf:.4f}, grad scale {scaler.get_scale()}")
        iter_num += 1
        if iter_num > max_iters:
            break


DEVICE = "cuda"  # the loop runs on a GPU: each read-back waits for it
