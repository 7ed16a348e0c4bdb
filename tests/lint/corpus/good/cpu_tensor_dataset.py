"""A CPU-only run over in-memory tensors: workers and pinning would only add overhead."""  # clean: LK007
import torch
from torch import nn

torch.manual_seed(0)
inputs, targets = torch.randn(4096, 32), torch.randn(4096, 1)
data = torch.utils.data.TensorDataset(inputs, targets)
loader = torch.utils.data.DataLoader(data, batch_size=64, shuffle=True)
model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)

for x, y in loader:
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
