"""Shared fixtures: deterministic, single-threaded torch so results compare bit for bit."""

from __future__ import annotations

import pytest
import torch

torch.set_num_threads(1)

requires_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU: none on this machine"
)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
