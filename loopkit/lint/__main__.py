"""``python -m loopkit.lint PATH...``."""

import sys

from ._cli import main

sys.exit(main())
