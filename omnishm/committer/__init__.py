"""The omnishm committer daemon: owns a cache's shared-memory segments and applies step writes.

``python -m omnishm.committer`` / ``omnishm committer`` / ``scripts/launch_committer.sh``.
Modules: ``config`` (options, endpoint policy), ``server`` (ROUTER loop, dispatch,
signals), ``pool`` (segments and ``apply_step``), ``sessions`` (clients, liveness).
Importing this package is cheap; ``main`` imports the server lazily.
"""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    """Run a committer in the foreground; see ``omnishm.committer.server.main``."""
    from omnishm.committer.server import main as _main

    return _main(argv)


__all__ = ["main"]
