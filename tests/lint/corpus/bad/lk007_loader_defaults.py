# expect: LK007
"""DataLoaders on their defaults: batches are decoded in the main process."""
import torch
from torch.utils.data import DataLoader, Dataset
from torchvision.io import read_image


class ImageFolderDataset(Dataset):
    def __init__(self, files, labels) -> None:
        self.files, self.labels = files, labels

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i):
        return read_image(self.files[i]).float() / 255, self.labels[i]


def loaders(train_files, train_labels, val_files, val_labels):
    device = torch.device("cuda")
    train = DataLoader(  # <- LK007
        ImageFolderDataset(train_files, train_labels), batch_size=64, shuffle=True
    )
    val = DataLoader(ImageFolderDataset(val_files, val_labels), 256, False, None, None, 0)  # <- LK007
    test = torch.utils.data.DataLoader(  # <- LK007
        ImageFolderDataset(val_files, val_labels), batch_size=256
    )
    return train, val, test, device
