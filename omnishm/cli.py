"""``omnishm`` command line: committer, status, ping, cleanup (and subcommands others register).

``status`` and ``ping`` speak the wire protocol as an ``admin`` client and do
not import torch, so they answer fast. Exit codes: 0 ok, 1 no committer
answered (or it refused us), 2 bad usage / committer refused to start.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shlex
import stat
import sys
import uuid
from pathlib import Path
from typing import Callable

from omnishm import paths
from omnishm import config as knobs  # standard library only

# Subcommands that live in other modules: name -> (module, help). The module is
# imported only when its subcommand runs; it provides ``cli_main(args) -> int``
# and optionally ``add_arguments(parser)``. E.g. "demo": ("omnishm.demo", "run the demo").
EXTERNAL_COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("omnishm.demo.main", "simulated TP engine sharing one embedded committer; checks every row"),
    "bench": ("omnishm.bench", "benchmarks: each figure next to its reference measured in the same run"),
}


class CommitterUnavailable(RuntimeError):
    """No committer answered in time, or it refused the admin session."""


def _runtime_dir(arg: str | None) -> Path:
    if arg:
        return Path(arg)
    return paths.default_runtime_dir()


def _cleanup_command(name: str, runtime_dir: Path) -> str:
    """The ``omnishm cleanup`` command that reaches ``runtime_dir``: named unless it is the default one (the
    advice without it, followed as printed after a committer of another dir died, removed nothing there, and
    the next ping gave it again: review, stop 54)."""
    if Path(runtime_dir) == paths.default_runtime_dir():
        return f"omnishm cleanup --name {shlex.quote(name)}"
    return f"omnishm cleanup --name {shlex.quote(name)} --runtime-dir {shlex.quote(str(runtime_dir))}"


TARGET_KNOBS = ("name", "runtime_dir", "endpoint")


def resolve_target(args: argparse.Namespace) -> tuple[str, str, Path]:
    """(cache name, endpoint, runtime dir) from flags > ``OMNISHM_*`` > config file > defaults. Raises
    ConfigError.

    Same runtime-dir and socket rules as everywhere (``omnishm.paths``), without importing torch.
    """

    flags = {k: getattr(args, k, None) for k in TARGET_KNOBS}
    # As for a manager (``config.manager_connection``): an explicit --name without --endpoint means that
    # cache's own socket, not an OMNISHM_ENDPOINT of another cache (review, stop 56: ping --name B asked A).
    names = TARGET_KNOBS if flags["name"] is None or flags["endpoint"] is not None else ("name", "runtime_dir")
    r = knobs.resolve("both", flags, config_file=getattr(args, "config", None), names=names)
    name, endpoint = r["name"], r.values.get("endpoint")
    runtime_dir = Path(r["runtime_dir"]) if r["runtime_dir"] else paths.default_runtime_dir()
    if not endpoint:
        endpoint = paths.ipc_endpoint(runtime_dir, name)
    return name, endpoint, runtime_dir


def admin_request(name: str, endpoint: str, request_factory: Callable[[int], object] | None,
                  timeout_s: float, runtime_dir: Path | None = None) -> object:
    """Attach as admin, send ``request_factory(rid)`` (if any), say goodbye; returns the reply.

    Raises CommitterUnavailable when nothing answers within ``timeout_s`` (overall), and at once when
    ``endpoint`` is the cache's own socket in ``runtime_dir`` (where its lock lives) and nothing holds
    that lock (a crashed committer's socket), or when an ipc socket fails a client's check
    (``paths.check_socket_path``: another user's socket or directory).
    """
    import time

    import msgspec
    import zmq

    from omnishm import liveness, protocol

    if endpoint.startswith("ipc://"):
        path = Path(endpoint[len("ipc://"):])
        try:
            mode: int | None = path.lstat().st_mode
        except FileNotFoundError:
            mode = None
        except PermissionError as exc:  # another user's runtime dir (0700): a traceback said so before
            raise CommitterUnavailable(f"cannot reach the socket of cache {name!r} at {path}: {exc.strerror} (a "
                                       f"directory of another user? each user's committers are their own)") from None
        except OSError as exc:  # a file where a directory should be, a symlink loop, a name too long
            raise CommitterUnavailable(f"cannot reach the socket of cache {name!r} at {path}: "
                                       f"{exc.strerror or exc}") from None
        if mode is not None and stat.S_ISLNK(mode):
            try:
                mode = path.stat().st_mode  # a link to a socket: clients connect through it (review, stop 51)
            except OSError:
                pass  # dangling, or a loop: not a socket
        if mode is not None and not stat.S_ISSOCK(mode):
            # No committer binds there, and none removes it: cleanup's advice below did nothing (review, stop 51).
            raise CommitterUnavailable(f"no committer for cache {name!r}: {path} is not a socket, and omnishm never "
                                       f"replaces or removes it; remove it yourself, or pass another --endpoint or "
                                       f"--runtime-dir")
        if not path.exists():
            held = liveness.CacheLock.holder(liveness.lock_path(runtime_dir, name)) if runtime_dir is not None else None
            if held is not None and liveness.cache_is_live(runtime_dir, name):  # started with another --endpoint
                raise CommitterUnavailable(f"the committer of cache {name!r} (pid {held[1]}) does not serve {endpoint} "
                                           f"(socket {path} does not exist): pass the --endpoint it was started with")
            raise CommitterUnavailable(f"no committer for cache {name!r}: socket {path} does not exist")
        # The cache's own socket, with nobody holding the lock beside it: a crashed committer's (trap 4).
        if runtime_dir is not None and path == paths.socket_path(runtime_dir, name) \
                and not liveness.cache_is_live(runtime_dir, name):
            raise CommitterUnavailable(f"no committer for cache {name!r}: socket {path} is left over from one that "
                                       f"is gone (nothing holds the cache lock); `{_cleanup_command(name, runtime_dir)}` "
                                       f"removes what it left")
        try:
            # A client's own check (``CommitterLink``): in a shared sticky directory another user may have
            # bound the name, and a ping answered there said a committer ran when ours did not (review).
            paths.check_socket_path(path)
        except PermissionError as exc:
            raise CommitterUnavailable(f"not asking the socket of cache {name!r}: {exc}") from None
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if endpoint.startswith("tcp://["):  # ::1: ZeroMQ connects to an IPv6 address only with ZMQ_IPV6
        sock.setsockopt(zmq.IPV6, 1)
    deadline = time.monotonic() + timeout_s

    def call(msg) -> object:
        sock.send(protocol.encode(msg))
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not sock.poll(int(remaining * 1000), zmq.POLLIN):
            # The lock holder is the one asked when the endpoint is its cache's own socket, or a committer holds
            # the endpoint's socket lock (one started with --endpoint; docs audit, stop 48: it was told "no
            # committer" there, with no pid).
            asked = runtime_dir is not None and (endpoint == paths.ipc_endpoint(runtime_dir, name)
                                                 or liveness.endpoint_served(endpoint))
            held = liveness.CacheLock.holder(liveness.lock_path(runtime_dir, name)) if asked else None
            if held is not None and liveness.cache_is_live(runtime_dir, name):  # alive, but stopped or swamped
                raise CommitterUnavailable(
                    f"the committer of cache {name!r} (pid {held[1]}) holds its lock but did not answer on {endpoint} "
                    f"within {timeout_s}s: stopped (SIGSTOP), or busy; its log says which, and `kill -USR1 "
                    f"{held[1]}` writes its threads' stacks there")
            raise CommitterUnavailable(f"no committer for cache {name!r} answered on {endpoint} within {timeout_s}s")
        try:
            return protocol.reply_decoder.decode(sock.recv())
        except msgspec.MsgspecError as exc:  # another service at the endpoint, or another protocol's committer
            raise CommitterUnavailable(f"what answered on {endpoint} is not an omnishm committer of protocol "
                                       f"{protocol.PROTOCOL_VERSION} ({exc})") from None

    try:
        try:
            sock.connect(endpoint)
        except zmq.ZMQError as exc:  # a form ZeroMQ refuses (check_endpoint passes only the ones it takes)
            raise CommitterUnavailable(f"cannot connect to {endpoint}: {exc}") from None
        welcome = call(protocol.Hello(rid=1, protocol=protocol.PROTOCOL_VERSION, client_id=uuid.uuid4().hex,
                                      pid=os.getpid(), uid=os.geteuid(), role=protocol.ROLE_ADMIN, cache=name))
        if not isinstance(welcome, protocol.Welcome):
            raise CommitterUnavailable(f"committer for cache {name!r} refused the admin session: "
                                       f"{getattr(welcome, 'reason', None) or getattr(welcome, 'message', welcome)}")
        reply = call(request_factory(2)) if request_factory is not None else welcome
        try:
            call(protocol.Goodbye(rid=3))
        except CommitterUnavailable:
            pass
        return reply
    finally:
        sock.close()


def _mib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"


def format_status(st: dict) -> str:
    """The human view of a StatusReply's dict: header, keys table, clients table (sizes in MiB/GiB)."""
    lay = st.get("layout") or {}
    tp = st.get("throughput") or {}
    own = st.get("committer_memory") or {}
    lines = [
        f"cache {st['name']}  generation {st['generation']}  pid {st['pid']}  up {st['uptime_s']:.1f}s  "
        f"endpoint {st['endpoint']}",
        f"layout: {lay.get('num_blocks', '-')} blocks x {lay.get('block_size', '-')} = {lay.get('num_slots', '-')} "
        f"slots   writer epoch {st['writer_epoch']}   segments {_mib(st['segment_bytes'])}",
        f"writes: {st['steps_applied']} steps, {st['rows_written']} rows ({_mib(st['bytes_written'])}), "
        f"{st['rows_skipped']} skipped, {st['steps_failed']} failed steps   queue depth {st['queue_depth']}   "
        + (f"non-temporal copies from {nt} B" if (nt := st.get("nontemporal_threshold")) else
           "glibc's non-temporal threshold"),
        f"recent: {tp.get('rows_per_s', 0.0):.1f} rows/s, {tp.get('bytes_per_s', 0.0) / 1e6:.2f} MB/s "
        f"over the last {tp.get('window_s', 0.0):.1f}s   committer rss "
        f"{_mib(own['rss_bytes']) if 'rss_bytes' in own else '-'}, shared "
        f"{_mib(own['shared_bytes']) if 'shared_bytes' in own else '-'}"
        + (f"   metrics {st['metrics_endpoint']}" if st.get("metrics_endpoint") else ""),
    ]
    for role, counters in sorted((st.get("client_counters") or {}).items()):
        lines.append(f"{role} counters: " + ", ".join(f"{k} {v:g}" for k, v in sorted(counters.items())))
    if st.get("rejected") or st.get("decode_errors"):
        lines.append(f"rejected: {st.get('rejected')}   decode errors: {st.get('decode_errors')}")
    lines.append("")
    lines.append(f"{'key':<24} {'dtype':<9} {'width':>6} {'mirror':>12} {'committed':>10} {'share':>7}")
    for k in st["keys"]:
        lines.append(f"{k['name']:<24} {k['dtype']:<9} {k['width']:>6} {_mib(k['pool_bytes']):>12} "
                     f"{k['committed_rows']:>10} {100 * k['committed_share']:>6.1f}%")
    lines.append("")
    lines.append(f"{'client':<34} {'role':<7} {'pid':>8} {'seen ago':>9} {'rss':>12} {'shared':>12}")
    for c in st["clients"]:
        rss = _mib(c["rss_bytes"]) if "rss_bytes" in c else "-"
        shared = _mib(c["shared_bytes"]) if "shared_bytes" in c else "-"
        lines.append(f"{c['client_id']:<34} {c['role']:<7} {c['pid']:>8} {c['last_seen_s_ago']:>8.1f}s "
                     f"{rss:>12} {shared:>12}")
    return "\n".join(lines)


def cmd_status(args: argparse.Namespace) -> int:
    from omnishm import protocol
    from omnishm.config import ConfigError

    try:
        name, endpoint, runtime_dir = resolve_target(args)
    except ConfigError as exc:
        print(f"omnishm status: {exc}", file=sys.stderr)
        return 2
    try:
        reply = admin_request(name, endpoint, lambda rid: protocol.StatusRequest(rid=rid), args.timeout_s,
                              runtime_dir)
    except CommitterUnavailable as exc:
        print(f"omnishm status: {exc}", file=sys.stderr)
        return 1
    if not isinstance(reply, protocol.StatusReply):
        print(f"omnishm status: unexpected reply {reply!r}", file=sys.stderr)
        return 1
    print(json.dumps(reply.status, indent=2, sort_keys=True) if args.json else format_status(reply.status))
    return 0


def cmd_ping(args: argparse.Namespace) -> int:
    """Exit 0 when the committer welcomes an admin session within ``--timeout-s``, 1 when not, 2 on bad usage."""
    import time

    from omnishm.config import ConfigError

    try:
        name, endpoint, runtime_dir = resolve_target(args)
    except ConfigError as exc:
        print(f"omnishm ping: {exc}", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    try:
        welcome = admin_request(name, endpoint, None, args.timeout_s, runtime_dir)
    except CommitterUnavailable as exc:
        print(f"omnishm ping: {exc}", file=sys.stderr)
        return 1
    print(f"cache {name}: committer pid {welcome.committer_pid} generation {welcome.generation} answered "
          f"in {1000 * (time.monotonic() - t0):.1f} ms")
    return 0


def cmd_cleanup(args: argparse.Namespace) -> int:
    from omnishm import orphans, shm

    try:  # the runtime dir by the same rules as the committer's: flag > OMNISHM_* > config file > default
        r = knobs.resolve("both", {"runtime_dir": args.runtime_dir}, config_file=args.config, names=("runtime_dir",))
    except knobs.ConfigError as exc:
        print(f"omnishm cleanup: {exc}", file=sys.stderr)
        return 2
    if args.name is not None:
        try:  # it names files in the runtime dir: "../x" would remove x.sock and x.lock elsewhere
            shm.check_cache_name(args.name)
        except ValueError as exc:
            print(f"omnishm cleanup: --name: {exc}", file=sys.stderr)
            return 2
    runtime_dir = _runtime_dir(r["runtime_dir"])
    try:
        removed = orphans.sweep(runtime_dir, args.name, force=args.force)
    except PermissionError as exc:  # another user's runtime dir: a traceback said so before
        print(f"omnishm cleanup: {exc.filename or r['runtime_dir']}: {exc.strerror or exc} (a directory of another "
              f"user? cleanup removes only what is ours)", file=sys.stderr)
        return 1
    except OSError as exc:  # a file where the directory should be, a symlink loop, a name too long
        print(f"omnishm cleanup: {exc.filename or r['runtime_dir']}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    for name in removed:
        print(f"removed {name}")
    print(f"{len(removed)} orphaned object(s) removed" + (f" for cache {args.name}" if args.name else ""))
    kept = shm.list_segments(args.name) if args.name is not None else []
    if kept:  # it said nothing of them, as if the cache were gone (review, stop 56)
        print(f"kept {len(kept)} segment(s) of cache {args.name}: its committer serves them, or attached clients "
              f"wait to resume with a restarted one" + ("" if args.force else " (--force removes those)"))
    if os.path.lexists(runtime_dir) and not runtime_dir.is_dir():
        # The sweep passes over a runtime dir it cannot list (the segments are swept still), and this said
        # success where ping and the committer refuse the same value (review, stop 54).
        print(f"omnishm cleanup: runtime dir {runtime_dir} is not a directory: its sockets and lock files were "
              f"not looked at", file=sys.stderr)
        return 1
    return 0


def cmd_committer(args: argparse.Namespace) -> int:
    from omnishm.committer import main as committer_main

    return committer_main(args.committer_argv)


def _add_target(p: argparse.ArgumentParser) -> None:
    p.add_argument("--name", default=None, help="cache name (env OMNISHM_NAME; default: default)")
    p.add_argument("--runtime-dir", default=None, help="env OMNISHM_RUNTIME_DIR")
    p.add_argument("--endpoint", default=None,
                   help="committer endpoint (env OMNISHM_ENDPOINT; default ipc://RUNTIME_DIR/NAME.sock)")
    p.add_argument("--config", metavar="FILE", default=None, help="TOML file of knobs (default: $OMNISHM_CONFIG)")
    p.add_argument("--timeout-s", type=knobs.seconds_argument, default=3.0,
                   help="give up after this many seconds (default: %(default)s)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="omnishm", description="omnishm: shared-memory omni prefix cache")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("committer", help="run a committer in the foreground", add_help=False)
    p.set_defaults(func=cmd_committer)
    p = sub.add_parser("status", help="print a committer's state")
    _add_target(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_status)
    p = sub.add_parser("ping", help="exit 0 when the committer answers")
    _add_target(p)
    p.set_defaults(func=cmd_ping)
    p = sub.add_parser("cleanup", help="remove segments and files no live committer owns")
    p.add_argument("--name", default=None, help="only this cache (default: all)")
    p.add_argument("--runtime-dir", default=None, help="env OMNISHM_RUNTIME_DIR")
    p.add_argument("--config", metavar="FILE", default=None, help="TOML file of knobs (default: $OMNISHM_CONFIG)")
    p.add_argument("--force", action="store_true",
                   help="also remove segments that clients of a dead committer still map (they then cannot resume)")
    p.set_defaults(func=cmd_cleanup)
    for name, (_module, help_text) in EXTERNAL_COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)  # listed in --help; parsed by run_external
    return parser


def run_external(name: str, argv: list[str]) -> int:
    """Import the subcommand's module now (not at every ``omnishm`` start) and run it."""
    import signal

    from omnishm.committer.early_stop import EarlyStop  # standard library only

    module, help_text = EXTERNAL_COMMANDS[name]
    # The module imports torch (seconds): a Ctrl-C or SIGTERM then stops it cleanly. Only those two: the
    # command's own handler (``early_stop.InterruptOnce``) takes the same two once it runs. Kept in place until
    # then, and handed to it: the demo imported torch after this was gone, and a signal there killed it with the
    # default action or was lost in the import (review, stop 54).
    early = EarlyStop((signal.SIGTERM, signal.SIGINT))
    try:
        mod = importlib.import_module(module)
        if early.reason:
            print(f"omnishm {name}: stopped ({early.reason}) before it started", file=sys.stderr)
            return 130
        parser = argparse.ArgumentParser(prog=f"omnishm {name}", description=help_text)
        if hasattr(mod, "add_arguments"):
            mod.add_arguments(parser)
        return int(mod.cli_main(parser.parse_args(argv), early=early) or 0)
    finally:
        early.restore()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "committer":
        # Everything after "committer" belongs to the committer's own parser (same options).
        args = argparse.Namespace(committer_argv=argv[1:])
        return cmd_committer(args)
    if argv and argv[0] in EXTERNAL_COMMANDS:
        return run_external(argv[0], argv[1:])
    args = build_parser().parse_args(argv)
    try:
        code = int(args.func(args) or 0)
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        # The reader of our output went away (``omnishm status | head``): not an error worth a traceback.
        # Point stdout at /dev/null so the interpreter's final flush does not raise again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
