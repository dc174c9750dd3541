"""The omnishm committer daemon: owns a cache's shared-memory segments and applies step writes.

``python -m omnishm.committer`` / ``omnishm committer`` / ``scripts/launch_committer.sh``.
Modules: ``start`` (process start, lock, adoption, exit codes), ``config`` (options,
endpoint policy), ``server`` (ROUTER loop, dispatch, signals), ``attach`` (Hello, resume), ``pool`` (segments),
``apply`` (``apply_step``), ``meta`` (restart metadata), ``sessions`` (clients,
liveness), ``metrics``.
Importing this package is cheap; ``main`` imports the server lazily.
"""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    """Run a committer in the foreground; see ``omnishm.committer.start.main``."""
    from omnishm.committer.start import main as _main

    return _main(argv)


__all__ = ["main"]
