"""``python -m loopkit.export CHECKPOINT OUT [--ema [K]]``: a checkpoint's weights in one file."""

from __future__ import annotations

import sys

from ._checkpoint._export import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
