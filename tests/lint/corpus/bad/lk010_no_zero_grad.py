# expect: LK010
"""Gradients are never reset: every step adds to all the previous ones."""
import torch

model = torch.nn.Linear(10, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10)
data = [(torch.randn(8, 10), torch.randn(8, 1)) for _ in range(100)]

for epoch in range(5):
    for x, y in data:
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()  # <- LK010
    scheduler.step()
