"""A tiny masked-token model trained on CPU: positions and masks built on the host and moved
each step, and a second zero_grad spelling; --fix must keep its output bit for bit."""
import torch
from torch import nn


class TinyLM(nn.Module):
    def __init__(self, vocab: int, dim: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(16, dim)
        self.out = nn.Linear(dim, vocab)

    def forward(self, tokens):
        positions = torch.arange(tokens.shape[1]).to(tokens.device)
        return self.out(self.embed(tokens) + self.pos(positions))


def main() -> None:
    torch.manual_seed(1)
    device = "cpu"
    model = TinyLM(11, 12).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    tokens = torch.randint(0, 11, (32, 16))
    for step in range(20):
        batch = tokens[(step * 4) % 32 : (step * 4) % 32 + 4].to(device)
        keep = torch.tensor([1.0, 0.0, 1.0, 1.0]).to(device)
        model.zero_grad(False)
        logits = model(batch)
        loss = nn.functional.cross_entropy(
            logits.reshape(-1, 11), batch.reshape(-1), reduction="none"
        ).reshape(4, 16).mean(1)
        (loss * keep).sum().backward()
        optimizer.step()
        if step % 5 == 0:
            print(step, loss.detach().tolist())


if __name__ == "__main__":
    main()
