"""``python -m omnishm ...`` is the ``omnishm`` console script."""

from __future__ import annotations

import sys

from omnishm.cli import main

if __name__ == "__main__":
    sys.exit(main())
