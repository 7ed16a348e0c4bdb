# expect: LK007, LK011
"""Shuffled loaders with workers and no generator, in a script that resumes: the data order
follows the global RNG, so a resumed run cannot replay it."""
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset


class Jitter(Dataset):
    def __init__(self, data: np.ndarray) -> None:
        self.data = data

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i):
        noise = np.random.normal(0, 0.1, size=self.data[i].shape)
        return torch.from_numpy(self.data[i] + noise).float()


def make(data: np.ndarray):
    train = DataLoader(Jitter(data), batch_size=32, shuffle=True, num_workers=8)  # <- LK007, LK011
    aug = DataLoader(  # <- LK011
        Jitter(data), batch_size=32, shuffle=True, num_workers=4, pin_memory=True
    )
    return train, aug, torch.device("cuda")


def resume(model, optimizer, path: str) -> int:
    checkpoint = torch.load(path)
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    return checkpoint["epoch"]
