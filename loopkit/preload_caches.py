"""``python -m loopkit.preload_caches list|prune``: find and remove ``loopkit.preload`` caches."""

from __future__ import annotations

import sys

from ._data._cache_admin import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
