"""The loopkit port of accelerate_cv.py: the same training, the same numbers.

docs/migrate/accelerate.md shows the two side by side; the tests run both and compare them.
"""

import argparse
import math
import os

import torch
from torch import nn
from torch.utils.data import TensorDataset

import loopkit
from loopkit import distributed


def get_datasets(seed):
    """Images of 4 classes (a pattern per class, plus noise): the Pets data set's stand-in."""
    g = torch.Generator().manual_seed(seed)
    patterns = torch.randn(4, 3, 8, 8, generator=g)

    def images(n):
        labels = torch.randint(0, 4, (n,), generator=g)
        return TensorDataset(patterns[labels] + torch.randn(n, 3, 8, 8, generator=g), labels)

    return images(256), images(100)


def create_model(num_classes):
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(16 * 4, num_classes),
    )  # fmt: skip


def accuracy(model, batch):
    """One value per sample (evaluate sums them exactly, each sample once)."""
    images, labels = batch
    return {"accuracy": (model(images).argmax(dim=-1) == labels).float()}


def training_function(config, args):
    # Join the launcher's process group (none single-process); leaving it ends the run.
    with distributed.setup() as info:
        lr, num_epochs, seed = config["lr"], config["num_epochs"], config["seed"]
        accumulate = config["gradient_accumulation_steps"]
        torch.manual_seed(seed)  # the model's initialization; the loader seeds each batch
        train_dataset, eval_dataset = get_datasets(seed)
        train_dataloader = distributed.loader(train_dataset, batch_size=config["batch_size"],
                                              seed=seed, num_workers=0)  # fmt: skip
        eval_dataloader = distributed.loader(eval_dataset, batch_size=32, shuffle=False,
                                             num_workers=0)  # fmt: skip
        model = distributed.wrap(create_model(num_classes=4))
        optimizer = torch.optim.AdamW(params=model.parameters(), lr=lr)
        # len() is this process's batches, and the scheduler steps once per update.
        num_updates = math.ceil(len(train_dataloader) / accumulate) * num_epochs
        lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda u: 1 - u / num_updates)
        step = loopkit.step(
            model, optimizer, precision=args.mixed_precision, accumulate=accumulate,
            clip_grad_norm=1.0, scheduler=lr_scheduler,
        )  # fmt: skip

        ckpt = loopkit.Checkpointer(
            args.output_dir, model=model, optimizer=optimizer, scheduler=lr_scheduler,
            step=step, loader=train_dataloader,
        )  # fmt: skip
        stop = loopkit.until(step, max_epochs=num_epochs, checkpointer=ckpt)
        resumed = ckpt.resume()  # the newest checkpoint in output_dir, if there is one
        if resumed is not None and info.is_rank_zero:
            print(f"Resumed from checkpoint: {resumed}")

        for epoch in stop.epochs(train_dataloader):  # a resumed run continues its epoch
            for images, labels in step.iterate(train_dataloader):
                with step as s:
                    outputs = model(images)
                    loss = nn.functional.cross_entropy(outputs, labels)
                    s.backward(loss)
                ckpt.maybe_save(every=args.checkpointing_steps)
                if stop.check():
                    break

            result = loopkit.evaluate(model, eval_dataloader, accuracy, step=step)
            if info.is_rank_zero:
                print(f"epoch {epoch}: accuracy {100 * result['accuracy']:.2f}")

        # epochs() saved the end state; its weights, buffers included, as one state_dict.
        if info.is_rank_zero:
            weights = loopkit.export_weights(ckpt.checkpoints()[-1])
            torch.save(weights, os.path.join(args.output_dir, "model.pt"))


def main():
    parser = argparse.ArgumentParser(description="Simple example of training script.")
    parser.add_argument("--mixed_precision", default="fp32", choices=["fp32", "fp16", "bf16"])
    parser.add_argument("--checkpointing_steps", type=int, default=4, help="updates per save")
    parser.add_argument("--output_dir", default="runs/loopkit_cv", help="resumed from if there")
    args = parser.parse_args()
    config = {"lr": 1e-2, "num_epochs": 3, "seed": 42, "batch_size": 16,
              "gradient_accumulation_steps": 2}  # fmt: skip
    training_function(config, args)


if __name__ == "__main__":
    main()
