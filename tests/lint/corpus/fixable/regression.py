"""A CPU-runnable regression loop with the habits --fix rewrites (LK004, LK010): its output
must not change when they are fixed (tests/lint/test_lint_fix.py runs both copies)."""
import torch

torch.manual_seed(0)
device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).to(device)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
data = [(torch.randn(16, 4), torch.randn(16, 1)) for _ in range(8)]

for epoch in range(3):
    for x, y in data:
        x, y = x.to(device), y.to(device)
        weights = torch.ones(x.shape[0], 1).to(device)
        offset = torch.full((1,), 0.5).to(device)
        optimizer.zero_grad(set_to_none=False)
        loss = ((model(x) + offset - y) ** 2 * weights).mean()
        loss.backward()
        optimizer.step()
    print(f"epoch {epoch} loss {loss.detach().cpu().tolist()!r}")
print([round(p.detach().sum().item(), 10) for p in model.parameters()])
