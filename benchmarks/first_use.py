"""First use: seconds from ``import torch`` to a built training step and to its first update.

Each contender runs in a fresh process, the same tiny model and SGD optimizer; the clock
starts once ``import torch`` has returned (what every contender pays alike) and stops when
the step object is built, then when the first window has become an update:

- ``plain``: the hand loop (zero_grad, forward, backward, optimizer.step);
- ``loopkit``: ``import loopkit``, ``loopkit.step(model, optimizer, accumulate=2)``;
- ``accelerate``: ``Accelerator(gradient_accumulation_steps=2)`` and ``prepare``.

torch's optimizers import ``torch._dynamo`` (which loads ``torch.distributed.fsdp``) on
their first use, so a plain loop pays about a second there too: the column that says what a
library costs is its time minus the plain loop's. Prints a table (``--json`` for rows);
median of ``--runs`` processes.

    python benchmarks/first_use.py [--runs 5] [--quick] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

_PRELUDE = """
import time, torch
t0 = time.perf_counter()
model = torch.nn.Linear(32, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
batches = [torch.randn(8, 32) for _ in range(2)]
"""
_BODIES = {
    "plain": """
t1 = time.perf_counter()
for x in batches:
    (model(x).pow(2).mean() / 2).backward()
opt.step()
opt.zero_grad(set_to_none=True)
""",
    "loopkit": """
import loopkit
step = loopkit.step(model, opt, accumulate=2)
t1 = time.perf_counter()
for x in batches:
    with step as s:
        s.backward(model(x).pow(2).mean())
assert step.updates == 1
""",
    "accelerate": """
from accelerate import Accelerator
acc = Accelerator(gradient_accumulation_steps=2, cpu=True)
model, opt = acc.prepare(model, opt)
t1 = time.perf_counter()
for x in batches:
    with acc.accumulate(model):
        acc.backward(model(x).pow(2).mean())
        opt.step()
        opt.zero_grad()
""",
}
_REPORT = "\nprint(t1 - t0, time.perf_counter() - t0)\n"


def _once(name: str) -> tuple[float, float]:
    proc = subprocess.run(
        [sys.executable, "-c", _PRELUDE + _BODIES[name] + _REPORT],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed: {proc.stderr[-1000:]}")
    built, first = (float(v) for v in proc.stdout.split()[-2:])
    return built, first


def measure(runs: int) -> list[dict[str, float | str]]:
    """One row per contender: median seconds to built and to first update, and over plain."""
    rows: list[dict[str, float | str]] = []
    for name in _BODIES:
        try:
            times = [_once(name) for _ in range(runs)]
        except RuntimeError as err:
            if name == "accelerate" and "ModuleNotFoundError" in str(err):
                continue  # the accelerate extra is not installed
            raise
        rows.append({
            "contender": name,
            "to_built_s": statistics.median(t[0] for t in times),
            "to_first_update_s": statistics.median(t[1] for t in times),
        })  # fmt: skip
    plain = float(rows[0]["to_first_update_s"])
    for row in rows:
        row["over_plain_s"] = float(row["to_first_update_s"]) - plain
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="one run each")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = measure(1 if args.quick else args.runs)
    if args.json:
        print(json.dumps(rows))
        return
    print(f"{'contender':<12}{'to built (s)':>14}{'to 1st update (s)':>19}{'over plain (s)':>16}")
    for r in rows:
        print(f"{r['contender']:<12}{r['to_built_s']:>14.3f}{r['to_first_update_s']:>19.3f}"
              f"{r['over_plain_s']:>16.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
