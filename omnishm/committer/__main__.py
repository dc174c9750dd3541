"""``python -m omnishm.committer [options]``: run a committer in the foreground."""

from __future__ import annotations

import sys

from omnishm.committer import main

if __name__ == "__main__":
    sys.exit(main())
