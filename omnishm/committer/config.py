"""Command-line options of the committer and endpoint policy.

Shared by ``python -m omnishm.committer`` and ``omnishm committer``. The
knobs themselves (flags, ``OMNISHM_*`` variables, TOML keys, checks) live in
``omnishm.config``; the parser here resolves them at parse time, so
``build_parser().parse_args(argv)`` returns final values with the precedence
flags > environment > file > defaults, or exits 2 naming the bad value.
Nothing here imports numpy or zmq, so a refused start (bad endpoint, name in use) is cheap.
"""

from __future__ import annotations

import argparse
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from omnishm import config as knobs
from omnishm import paths
from omnishm.config import LOOPBACK_HOSTS, ConfigError, check_endpoint  # noqa: F401 (re-exported)

EXIT_OK = 0
EXIT_REFUSED = 2
"""Committer exit codes: a clean stop (a signal during start-up included), and a refused start
(bad options, the cache name in use, an endpoint it cannot bind)."""

SCOPE = "committer"


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
    metrics_port: int = 0
    metrics_host: str = "127.0.0.1"
    spawned_by: int = 0
    """pid of the client process that autostarted this committer, 0 when not autostarted. Not its parent:
    autostart detaches it (``client/committer_process.py``)."""
    spawned_by_start: str = ""
    """That process's start time (``liveness.proc_identity``) when the client passed one: the committer then
    tells that very process from a later one under the same pid. Without it, only a parent is recognised."""
    parent_pid: int = 0
    """``exit_with_parent``: the parent whose end stops this process (the loop sees another parent:
    ``server.Committer.run``), as ``--parent-pid`` names it, else the parent it had when its options were read;
    0: none watched."""

    @property
    def ipc_path(self) -> Path | None:
        """Filesystem path of an ``ipc://`` endpoint (None for tcp)."""
        return paths.ipc_path(self.endpoint)


class CommitterArgumentParser(argparse.ArgumentParser):
    """``parse_args`` resolves every knob (flags > ``OMNISHM_*`` > ``--config``/``$OMNISHM_CONFIG`` > defaults).

    The namespace it returns has one attribute per committer knob holding the
    final, checked value, plus ``sources`` (knob -> where it came from). A bad
    value exits 2 through ``error`` with a message naming knob, source and rule.
    """

    def parse_args(self, args=None, namespace=None):  # type: ignore[override]
        ns = super().parse_args(args, namespace)
        try:
            resolved = knobs.resolve(SCOPE, knobs.flags_from_args(ns, SCOPE), config_file=ns.config)
        except ConfigError as exc:
            self.error(str(exc))
        for name, value in resolved.values.items():
            setattr(ns, name, value)
        ns.sources = resolved.sources
        return ns


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the committer's options to ``parser`` (one per committer knob, plus ``--config``)."""
    knobs.add_arguments(parser, SCOPE)
    # Internal, set by a client's autostart (client/committer_process.py), not a knob: an autostarted
    # committer no client attached to exits once the process that started it is gone.
    parser.add_argument("--spawned-by", type=_spawner, default=(0, ""), metavar="PID[:START]", help=argparse.SUPPRESS)
    # With --exit-with-parent, the launcher's own pid: a parent that died before the options were read (the
    # interpreter's start and imports, about a second) is then caught too; getppid() there is init's already.
    parser.add_argument("--parent-pid", type=_pid, default=0, metavar="PID",
                        help="with --exit-with-parent: the pid of the process that starts this committer, which must "
                             "be its parent (default: its parent when its options are read)")
    return parser


def _pid(text: str) -> int:
    if not text.isdigit() or int(text) <= 0:
        raise argparse.ArgumentTypeError(f"expected a pid (a positive number), got {text!r}")
    return int(text)


def _spawner(text: str) -> tuple[int, str]:
    """``--spawned-by PID[:START]``: the autostarting client's pid and, when given, its start time."""
    pid, _, start = text.partition(":")
    if not pid.isdigit() or (start and not start.isdigit()):
        raise argparse.ArgumentTypeError(f"expected PID or PID:START (digits), got {text!r}")
    return int(pid), start


def build_parser() -> argparse.ArgumentParser:
    parser = CommitterArgumentParser(
        prog="python -m omnishm.committer",
        description="omnishm committer: owns a cache's shared-memory segments and applies step writes. "
                    "Every option can also be set as OMNISHM_<OPTION> or as a key in a TOML file "
                    "(--config / OMNISHM_CONFIG); flags win over the environment, which wins over the file.")
    return add_arguments(parser)


def config_from_args(args: argparse.Namespace, runtime_dir: Path) -> CommitterConfig:
    """Build the config from a namespace of ``build_parser`` (runtime_dir already ensured). Raises ValueError.

    Values were checked when parsed; this fills the endpoint default and checks
    that ``prometheus_client`` is importable when metrics were asked for.
    """
    endpoint = check_endpoint(args.endpoint or paths.ipc_endpoint(runtime_dir, args.name))
    spawned_by, spawned_by_start = getattr(args, "spawned_by", None) or (0, "")
    if args.metrics_port:
        from omnishm.committer.metrics import require_prometheus

        require_prometheus()
    # An autostarted committer's parent is the shell that detached it, gone at once: it watches its client.
    watch = getattr(args, "exit_with_parent", False) and not spawned_by
    parent_pid = (getattr(args, "parent_pid", 0) or os.getppid()) if watch else 0
    return CommitterConfig(name=args.name, runtime_dir=runtime_dir, endpoint=endpoint,
                           heartbeat_s=float(args.heartbeat_s),
                           heartbeat_timeout_s=float(args.heartbeat_timeout_s),
                           exit_when_idle=bool(args.exit_when_idle), prefault=bool(args.prefault),
                           log_level=args.log_level, metrics_port=int(args.metrics_port),
                           metrics_host=args.metrics_host, spawned_by=spawned_by, spawned_by_start=spawned_by_start,
                           parent_pid=parent_pid)


def setup_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s")
