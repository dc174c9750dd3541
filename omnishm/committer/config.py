"""Command-line options of the committer and endpoint policy.

Shared by ``python -m omnishm.committer`` and ``omnishm committer``. Nothing
here imports torch, so a refused start (bad endpoint, name in use) is cheap.
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

LOOPBACK_HOSTS = ("127.0.0.1", "::1", "localhost")


@dataclass(frozen=True)
class CommitterConfig:
    """Validated committer settings (plain value; built by ``config_from_args``)."""

    name: str
    runtime_dir: Path
    endpoint: str
    heartbeat_s: float
    heartbeat_timeout_s: float
    exit_when_idle: bool
    prefault: bool
    log_level: str

    @property
    def ipc_path(self) -> Path | None:
        """Filesystem path of an ``ipc://`` endpoint (None for tcp)."""
        if self.endpoint.startswith("ipc://"):
            return Path(self.endpoint[len("ipc://"):])
        return None


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the committer's options to ``parser`` (also used by ``omnishm committer``)."""
    parser.add_argument("--name", default="default", help="cache name (default: %(default)s)")
    parser.add_argument("--runtime-dir", default=None,
                        help="0700 directory for the socket and lock file "
                             "(default: $OMNISHM_RUNTIME_DIR, $XDG_RUNTIME_DIR/omnishm or /tmp/omnishm-UID)")
    parser.add_argument("--endpoint", default=None,
                        help="ZeroMQ endpoint (default ipc://RUNTIME_DIR/NAME.sock); tcp only on loopback")
    parser.add_argument("--heartbeat-s", type=float, default=1.0,
                        help="heartbeat interval clients are told to use (default: %(default)s)")
    parser.add_argument("--heartbeat-timeout-s", type=float, default=10.0,
                        help="reap a client silent this long (default: %(default)s)")
    parser.add_argument("--exit-when-idle", action="store_true",
                        help="exit 0 once the last writer/reader left (after at least one attached)")
    parser.add_argument("--prefault", action="store_true",
                        help="fault every pool page in at creation (first writes do not fault)")
    parser.add_argument("--log-level", default="INFO",
                        choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"])
    return parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m omnishm.committer",
        description="omnishm committer: owns a cache's shared-memory segments and applies step writes.")
    return add_arguments(parser)


def check_endpoint(endpoint: str) -> str:
    """Return ``endpoint`` if allowed: ``ipc://PATH`` or ``tcp://`` on a loopback host.

    Raises ValueError naming the endpoint and the rule otherwise (the pool is
    readable by anyone who can talk to the committer, so never a routable address).
    """
    if endpoint.startswith("ipc://"):
        if len(endpoint) <= len("ipc://"):
            raise ValueError(f"endpoint {endpoint!r} has no socket path")
        return endpoint
    if endpoint.startswith("tcp://"):
        parts = urlsplit(endpoint)
        try:
            host, port = parts.hostname, parts.port
        except ValueError as exc:
            raise ValueError(f"endpoint {endpoint!r}: bad port ({exc})") from None
        if host not in LOOPBACK_HOSTS:
            raise ValueError(f"endpoint {endpoint!r} refused: tcp is allowed only on loopback "
                             f"({', '.join(LOOPBACK_HOSTS)}), never on {host!r}")
        if port is None:
            raise ValueError(f"endpoint {endpoint!r} has no port")
        return endpoint
    raise ValueError(f"endpoint {endpoint!r} refused: use ipc://PATH or tcp://127.0.0.1:PORT")


def default_endpoint(runtime_dir: Path, name: str) -> str:
    return f"ipc://{Path(runtime_dir) / f'{name}.sock'}"


def config_from_args(args: argparse.Namespace, runtime_dir: Path) -> CommitterConfig:
    """Validate parsed options (runtime_dir already ensured). Raises ValueError."""
    if args.heartbeat_s <= 0 or args.heartbeat_timeout_s <= 0:
        raise ValueError("--heartbeat-s and --heartbeat-timeout-s must be positive")
    endpoint = check_endpoint(args.endpoint or default_endpoint(runtime_dir, args.name))
    return CommitterConfig(name=args.name, runtime_dir=runtime_dir, endpoint=endpoint,
                           heartbeat_s=float(args.heartbeat_s),
                           heartbeat_timeout_s=float(args.heartbeat_timeout_s),
                           exit_when_idle=bool(args.exit_when_idle), prefault=bool(args.prefault),
                           log_level=args.log_level)


def setup_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s")
