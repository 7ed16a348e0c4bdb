# expect: LK019
"""Half-ported: a loopkit step entered inside a plain loop over the loader."""
import loopkit


def train(model, loader, optimizer, loss_fn, epochs: int = 3):
    step = loopkit.step(model, optimizer, accumulate=4)
    for _ in range(epochs):
        for x, y in loader:  # <- LK019
            with step as s:
                s.backward(loss_fn(model(x), y))
