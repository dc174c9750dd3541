"""The omnishm committer daemon: owns a cache's shared-memory segments and applies step writes.

``python -m omnishm.committer`` / ``omnishm committer`` / ``scripts/launch_committer.sh``.
Modules: ``start`` (process start, lock, adoption, exit codes), ``config`` (options,
endpoint policy), ``server`` (ROUTER loop, dispatch, signals), ``attach`` (Hello, resume), ``pool`` (segments),
``apply`` (``apply_step``), ``stores`` (non-temporal pool writes), ``early_stop`` (signals during
start-up), ``meta`` (restart metadata), ``sessions`` (clients, liveness), ``metrics``.
Importing this package is cheap; ``main`` imports the server lazily.
"""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    """Run a committer in the foreground; see ``omnishm.committer.start.main``.

    Main thread. The start-up signal catcher goes in first: importing the
    server pulls in numpy and zmq (a few hundred ms on a busy host), and a
    SIGTERM in that window must stop the committer with exit 0 like any other,
    not kill it. The committer never imports torch (``protocol.DTYPE_ITEMSIZE``). Once its options are
    parsed, a process started as the committer alone (``stores.is_entry_point``) re-executes itself once
    for non-temporal pool writes (``stores``).
    """
    from omnishm.committer.early_stop import EarlyStop

    early = EarlyStop()
    try:
        import os

        from omnishm.committer.config import build_parser
        from omnishm.committer.stores import reexec_with_threshold
        from omnishm.config import CONFIG_ENV

        # Parsed once (a --config FILE may be a pipe), before the heavy imports, which a new image would
        # do again; a bad option exits 2 here.
        args = build_parser().parse_args(argv)
        reexec_with_threshold(args.nontemporal_threshold, early.signals, early,
                              config_file=args.config or os.environ.get(CONFIG_ENV) or None)
        from omnishm.committer.start import main as _main
    except BaseException:
        early.restore()
        raise
    return _main(argv, early, args=args)


__all__ = ["main"]
