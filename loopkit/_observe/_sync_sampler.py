"""The doctor's host-sync counts on a few sampled steps, inside each and in the code after it.

Counting every op would slow the loop the doctor measures, so only the sampled steps are
counted: by the CUDA driver on a GPU, elsewhere by the ops that would stall one.
"""

from __future__ import annotations

from collections import Counter

import torch

from ._cuda_sync_warnings import CudaSyncCounter
from ._host_syncs import count_host_syncs


class SyncSampler:
    """Counts host syncs on the sampled steps, inside each and in the user's code after it.

    A sampled step's counter runs from its start to the next step's start (or the loader's
    next batch), so a ``loss.item()`` logged after the step counts too: "between steps".
    It counts between steps only while the doctor also iterates the loader, so that a
    next batch (or the loader's end) always stops it; otherwise the step alone is counted.
    """

    def __init__(self, at: frozenset[int], every: int | None) -> None:
        self.at, self.every = at, every
        self.user: Counter[str] = Counter()
        self.expected: Counter[str] = Counter()
        self.inside: Counter[str] = Counter()  # the user's syncs inside the step, by operation
        self.between: Counter[str] = Counter()  # ... and after it, before the next
        self.lines: Counter[tuple[str, str]] = Counter()  # (file:line, "inside"/"between")
        self.steps = 0
        self._counter: count_host_syncs | CudaSyncCounter | None = None
        self._at_exit: tuple[Counter[str], Counter[str]] | None = None  # user ops, lines

    def start(self, number: int, cuda: bool, optimizer: torch.optim.Optimizer | None) -> None:
        """Close the previous step's count; start counting if step ``number`` is sampled."""
        self.stop_between()
        if not (number in self.at or (self.every and number % self.every == 0)):
            return
        # On CUDA the driver sees every sync; elsewhere the ops that would stall a GPU.
        counter: count_host_syncs | CudaSyncCounter = (
            CudaSyncCounter()
            if cuda
            else count_host_syncs(ignore=_host_resident(optimizer), locate=True)
        )
        counter.__enter__()
        self._counter = counter

    def stop(self, keep_counting: bool) -> None:
        """The step ended: what was counted is "inside"; keep counting the code after it if
        ``keep_counting`` (the next batch will stop it), else stop now."""
        counter = self._counter
        if counter is None:
            return
        self._at_exit = (Counter(counter.user_events), _lines(counter))
        if not keep_counting:
            self.stop_between()

    def stop_between(self) -> None:
        """Stop the count left running after a step (a no-op if none is)."""
        counter, self._counter = self._counter, None
        if counter is None:
            return
        counter.__exit__(None, None, None)
        user, lines = Counter(counter.user_events), _lines(counter)
        inside, lines_inside = self._at_exit or (user, lines)
        self._at_exit = None
        self.user.update(user)
        self.expected.update(counter.expected)
        self.inside.update(inside)
        self.between.update(user - inside)
        self.lines.update({(where, "inside"): n for where, n in lines_inside.items()})
        self.lines.update({(where, "between"): n for where, n in (lines - lines_inside).items()})
        self.steps += 1


def _lines(counter: count_host_syncs | CudaSyncCounter) -> Counter[str]:
    return Counter(getattr(counter, "lines", {}))


def _host_resident(opt: torch.optim.Optimizer | None) -> frozenset[int]:
    # Optimizers keep their step counters on the host even in a GPU run (unless
    # capturable) and read them with .item(): no device sync there, so not counted.
    if opt is None:
        return frozenset()
    return frozenset(
        id(v)
        for state in opt.state.values()
        for k, v in state.items()
        if k == "step" and isinstance(v, torch.Tensor) and v.device.type == "cpu"
    )
