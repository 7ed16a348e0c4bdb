"""Plot a CSVSink file: each metric against the optimizer-update axis (needs matplotlib).

python examples/quickstart.py --csv runs/quickstart.csv
python examples/plot_metrics.py runs/quickstart.csv docs/tracker_plot.png
"""

from __future__ import annotations

import argparse
import csv

import matplotlib

matplotlib.use("Agg")  # files only: no display needed
import matplotlib.pyplot as plt


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv_path")
    parser.add_argument("png_path")
    args = parser.parse_args(argv)
    with open(args.csv_path, newline="") as f:
        rows = list(csv.DictReader(f))
    axes = {"step", "epoch", "samples", "tokens"}
    metrics = [k for k in rows[0] if k not in axes]
    steps = [int(r["step"]) for r in rows]
    fig, plots = plt.subplots(1, len(metrics), figsize=(4 * len(metrics), 3), squeeze=False)
    for plot, name in zip(plots[0], metrics, strict=True):
        plot.plot(steps, [float(r[name]) for r in rows], marker="o")
        plot.set_xlabel("optimizer updates (the sinks' step)")
        plot.set_title(name)
    fig.tight_layout()
    fig.savefig(args.png_path, dpi=80)
    print(f"wrote {args.png_path}: {len(rows)} points of {', '.join(metrics)}")


if __name__ == "__main__":
    main()
