"""Plot the overhead ratio of every contender to the hand-written loop (a PNG).

python benchmarks/overhead.py --json > overhead.json
python benchmarks/plot.py overhead.json docs/overhead.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rows", type=Path, help="JSON printed by overhead.py --json")
    parser.add_argument("png", type=Path)
    args = parser.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in json.loads(args.rows.read_text()) if r["ratio"] is not None]
    groups = list(dict.fromkeys((r["model"], r["precision"]) for r in rows))
    contenders = list(dict.fromkeys(r["contender"] for r in rows))
    width = 0.8 / len(contenders)
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for i, name in enumerate(contenders):
        values = [
            next(
                (
                    r["ratio"]
                    for r in rows
                    if (r["model"], r["precision"]) == g and r["contender"] == name
                ),
                0.0,
            )
            for g in groups
        ]
        xs = [j + (i - (len(contenders) - 1) / 2) * width for j in range(len(groups))]
        bars = ax.bar(xs, values, width, label=name)
        ax.bar_label(bars, fmt="%.2f", fontsize=6, padding=1)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.axhline(1.05, color="grey", linewidth=0.8, linestyle="--", label="loopkit's bar (1.05x)")
    ax.set_xticks(range(len(groups)), [f"{m} model\n{p}" for m, p in groups])
    ax.set_ylabel("time per micro-step / hand-written")
    ax.set_title("Per-step overhead over a hand-written loop (CPU, 1 thread, accumulation 4)")
    ax.set_ylim(0.8, max(r["ratio"] for r in rows) * 1.12)
    ax.legend(fontsize=8, ncol=3, loc="upper right")
    fig.tight_layout()
    args.png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.png, dpi=120)


if __name__ == "__main__":
    main()
