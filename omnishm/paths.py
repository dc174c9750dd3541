"""Where a cache's files live: the runtime dir, its socket, its default endpoint.

The one place for these rules. Torch-free, so the CLI's admin commands and the
configuration code use it without importing torch; ``omnishm.shm`` re-exports it.
"""

from __future__ import annotations

import os
from pathlib import Path


def default_runtime_dir() -> Path:
    """``$OMNISHM_RUNTIME_DIR``, else ``$XDG_RUNTIME_DIR/omnishm``, else ``/tmp/omnishm-<uid>``."""
    env = os.environ.get("OMNISHM_RUNTIME_DIR")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg:
        return Path(xdg) / "omnishm"
    return Path(f"/tmp/omnishm-{os.geteuid()}")


def socket_path(runtime_dir: Path, cache: str) -> Path:
    return Path(runtime_dir) / f"{cache}.sock"


def ipc_path(endpoint: str) -> Path | None:
    """Filesystem path of an ``ipc://`` endpoint (None for any other transport)."""
    return Path(endpoint[len("ipc://"):]) if endpoint.startswith("ipc://") else None


def ipc_endpoint(runtime_dir: Path | None, cache: str) -> str:
    """The default endpoint of ``cache``: its socket in ``runtime_dir`` (default: ``default_runtime_dir()``)."""
    return f"ipc://{socket_path(runtime_dir if runtime_dir is not None else default_runtime_dir(), cache)}"
