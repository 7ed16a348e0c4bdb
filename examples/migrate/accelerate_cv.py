"""Accelerate's examples/cv_example.py, with checkpointing.py's resume and
gradient_accumulation.py's accumulation, on synthetic images a CPU trains in seconds.

docs/migrate/accelerate.md shows it beside its loopkit port, loopkit_cv.py; the tests run both.
"""

import argparse
import os

import torch
from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.utils import set_seed
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


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


def training_function(config, args):
    # Initialize accelerator
    accelerator = Accelerator(
        cpu=args.cpu,
        mixed_precision=args.mixed_precision,
        gradient_accumulation_steps=config["gradient_accumulation_steps"],
        # The shuffled order from (seed, epoch): a resume sees the same batches.
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
    )
    lr, num_epochs, seed = config["lr"], config["num_epochs"], config["seed"]
    set_seed(seed)
    train_dataset, eval_dataset = get_datasets(seed)
    train_dataloader = DataLoader(train_dataset, shuffle=True, batch_size=config["batch_size"])
    eval_dataloader = DataLoader(eval_dataset, shuffle=False, batch_size=32)
    model = create_model(num_classes=4).to(accelerator.device)
    optimizer = torch.optim.AdamW(params=model.parameters(), lr=lr)
    # Total updates from the loader before prepare(): all processes' batches.
    num_updates = len(train_dataloader) * num_epochs // accelerator.gradient_accumulation_steps
    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda u: 1 - u / num_updates)

    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
        model, optimizer, train_dataloader, eval_dataloader, lr_scheduler
    )

    overall_step = 0  # updates
    starting_epoch, resume_step = 0, None
    if args.resume_from_checkpoint:
        accelerator.print(f"Resumed from checkpoint: {args.resume_from_checkpoint}")
        accelerator.load_state(args.resume_from_checkpoint)
        path = os.path.basename(args.resume_from_checkpoint)
        overall_step = int(path.replace("step_", ""))
        # Updates -> batches: exact only when len(train_dataloader) % accumulation == 0.
        batches = overall_step * accelerator.gradient_accumulation_steps
        starting_epoch, resume_step = divmod(batches, len(train_dataloader))

    for epoch in range(starting_epoch, num_epochs):
        model.train()
        if epoch == starting_epoch and resume_step:
            active_dataloader = accelerator.skip_first_batches(train_dataloader, resume_step)
        else:
            active_dataloader = train_dataloader
        # Without it a resumed run replays epoch 0's order (the loader counts from 0 again).
        active_dataloader.set_epoch(epoch)
        for images, labels in active_dataloader:
            with accelerator.accumulate(model):
                outputs = model(images)
                loss = nn.functional.cross_entropy(outputs, labels)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                overall_step += 1
                if overall_step % args.checkpointing_steps == 0:
                    output_dir = os.path.join(args.output_dir, f"step_{overall_step}")
                    accelerator.save_state(output_dir)

        model.eval()
        accurate, num_elems = 0, 0
        for images, labels in eval_dataloader:
            with torch.no_grad():
                predictions = model(images).argmax(dim=-1)
            predictions, references = accelerator.gather_for_metrics((predictions, labels))
            accurate += (predictions == references).long().sum()
            num_elems += references.shape[0]
        eval_metric = accurate.item() / num_elems
        # Use accelerator.print to print only on the main process.
        accelerator.print(f"epoch {epoch}: accuracy {100 * eval_metric:.2f}")

    accelerator.wait_for_everyone()
    unwrapped_model = accelerator.unwrap_model(model)
    accelerator.save(unwrapped_model.state_dict(), os.path.join(args.output_dir, "model.pt"))
    accelerator.end_training()


def main():
    parser = argparse.ArgumentParser(description="Simple example of training script.")
    parser.add_argument("--mixed_precision", default="no", choices=["no", "fp16", "bf16"])
    parser.add_argument("--cpu", action="store_true", help="If passed, will train on the CPU.")
    parser.add_argument("--checkpointing_steps", type=int, default=4, help="updates per save")
    parser.add_argument("--output_dir", default="runs/accelerate_cv")
    parser.add_argument("--resume_from_checkpoint", help="a step_<N> folder to continue from")
    args = parser.parse_args()
    config = {"lr": 1e-2, "num_epochs": 3, "seed": 42, "batch_size": 16,
              "gradient_accumulation_steps": 2}  # fmt: skip
    training_function(config, args)


if __name__ == "__main__":
    main()
