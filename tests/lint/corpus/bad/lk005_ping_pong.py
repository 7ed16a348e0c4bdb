# expect: LK005
"""Feature extraction that sends every batch to the host for numpy and back again."""
import numpy as np
import torch


@torch.inference_mode()
def extract(backbone, loader):
    feats = []
    for images, _ in loader:
        images = images.cuda(non_blocking=True)
        f = backbone(images)
        f = f.cpu()
        f = f / np.linalg.norm(f.numpy(), axis=1, keepdims=True)
        f = f.cuda()  # <- LK005
        feats.append(torch.from_numpy(f.cpu().numpy()).cuda())  # <- LK005
    return torch.cat(feats)
