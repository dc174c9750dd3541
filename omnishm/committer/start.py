"""Starting a committer process: options, the cache lock, adoption or sweep, bind, run, exit code.

``main`` refuses to start (exit 2) on bad options, a second committer for the
same cache (the lock file names the holder) or an endpoint it cannot bind. It
adopts the segments of a cache whose clients are still attached
(``committer/meta.py``) instead of sweeping them, so those clients resume; any
other leftovers of a previous committer are swept. On a clean stop it unlinks
every segment it made and removes its autostart log (``client/committer_process.py``),
unless it logged a warning (``_Warned``); a launched committer removes the log of an autostarted one
that lost the lock to it.
SIGUSR1 writes every thread's Python stack to its log and it goes on serving
(``_enable_stack_dumps``).
"""

from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import signal
import stat
import sys
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import zmq

from omnishm import cpus, liveness, orphans, paths, shm, versions
from omnishm.committer import meta
from omnishm.committer.config import (
    EXIT_OK,
    EXIT_REFUSED,
    CommitterConfig,
    build_parser,
    check_endpoint,
    config_from_args,
    setup_logging,
)
from omnishm.committer.early_stop import EarlyStop

if TYPE_CHECKING:
    from omnishm.committer.pool import CachePool
    from omnishm.committer.server import Committer

logger = logging.getLogger("omnishm.committer")


def _lock_holder(runtime_dir, name: str) -> str:
    held = liveness.CacheLock.holder(liveness.lock_path(runtime_dir, name))
    return f"pid {held[1]}" if held is not None else "unknown pid"


def adopt_live_cache(cfg: CommitterConfig) -> tuple[CachePool | None, liveness.GenerationOwner | None]:
    """The pool of a previous committer of this cache whose clients are still attached, and its owner lock.

    ``(None, None)`` when there is none. Called with the cache lock held,
    before the orphan sweep. A generation with attached clients
    (``meta.clients_attached``) is adopted when this committer gets its owner
    lock first (another committer, from another runtime dir, may be adopting
    it too: nothing of it is touched before the lock) and its metadata and
    segments check out; otherwise it is logged and left to the sweep, and its
    clients' resumes are refused with the reason.
    """
    from omnishm.committer.pool import CachePool

    live = meta.live_generations(cfg.name)
    for gen in live:
        owner = liveness.GenerationOwner.acquire(cfg.name, gen, runtime_dir=cfg.runtime_dir)
        if owner is None:
            logger.info("committer %s: generation %s is being adopted by another committer", cfg.name, gen)
            continue
        try:
            pool = CachePool.adopt(cfg.name, gen, prefault=cfg.prefault)
        except Exception as exc:  # whatever is wrong with it, this committer must still start
            owner.release(unlink=False)  # the sweep that follows removes the generation, owner segment too
            logger.error("committer %s: clients are still attached to generation %s but it cannot be adopted: %s; "
                         "sweeping it (those clients will fail with a clear error)", cfg.name, gen, exc,
                         exc_info=not isinstance(exc, (meta.MetaError, KeyError, TypeError, ValueError)))
            continue
        logger.info("committer %s: adopted live generation %s (%d key(s), %d writer(s) expected to resume, "
                    "writer epoch %d)%s", cfg.name, gen, len(pool.keys), len(pool.writers), pool.max_epoch,
                    f"; other live generations {[g for g in live if g != gen]} are swept" if len(live) > 1 else "")
        return pool, owner
    return None, None


def _sweep_dead_caches(runtime_dir: Path, name: str) -> None:
    """Remove what dead caches of other names left behind (``orphans.sweep(foreign_dirs=False)``).

    A cache whose committer and clients were all SIGKILLed is swept by the next start of its own
    name; under a name never started again (renamed, a test's unique name) it held /dev/shm until
    someone ran ``omnishm cleanup``. What the sweep keeps is in its docstring. Called once, at
    start-up, with this committer's own lock and owner held; a failure is logged and the start
    goes on.
    """
    try:
        orphans.sweep(runtime_dir, foreign_dirs=False)  # logs what it removed
    except OSError as exc:  # someone else's leftovers must not stop this start
        logger.warning("committer %s: could not sweep dead caches of other names: %s", name, exc)


def main(argv: list[str] | None = None, early: EarlyStop | None = None, *,
         args: argparse.Namespace | None = None) -> int:
    """Run a committer in the foreground. Returns 0 on a clean stop (a signal during start-up included),
    2 when it refuses to start.

    ``early``: the start-up signal catcher, installed by ``omnishm.committer.main`` before this module
    was imported; one is installed here when the caller brought none. Restored on return.
    ``args``: ``argv`` already parsed by ``build_parser`` (a config file is read once).
    """
    early = early or EarlyStop()
    undo_dumps = None
    warned = _Warned()
    logging.getLogger("omnishm").addHandler(warned)
    try:
        args = args if args is not None else build_parser().parse_args(argv)
        setup_logging(args.log_level)
        if os.environ.get("OMNISHM_AUTOSTART_LOG"):
            # Started by a rank (client/committer_process.py), whose NUMA binding it inherited: the pool must
            # not land on that one rank's node (omnishm/cpus.py). Before any thread starts: the policy is a
            # thread's, and threads inherit it. A committer you launch keeps yours (numactl).
            cpus.default_memory_policy()
        undo_dumps = _enable_stack_dumps()
        versions.warn_if_weakly_ordered(logger)
        return _start(args, early, warned)
    finally:
        logging.getLogger("omnishm").removeHandler(warned)
        if undo_dumps is not None:
            undo_dumps()
        early.restore()


class _Warned(logging.Handler):
    """Notes that this committer logged a warning or worse: its autostart log is then kept after a clean stop
    too (``_drop_autostart_log``), since it says something an operator will look for (a stall, a reply
    dropped, a stop that took the cache from attached clients). Any thread; it only sets a flag."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.seen = False

    def emit(self, record: logging.LogRecord) -> None:
        self.seen = True


def _enable_stack_dumps() -> Callable[[], None] | None:
    """``kill -USR1 PID`` writes the stack of every thread to stderr (the committer's log) and the committer goes
    on serving: the way to see where a committer that stalls or stops answering stands. A fatal signal (SIGSEGV,
    SIGABRT, ...) writes them too before the process dies. Both are ``faulthandler``'s, run in C: they need
    neither the GIL nor the loop. Main thread; skipped when stderr is not a file. Returns what undoes it, for a
    ``main`` that returns into a process that lives on (a test calling it in-process), or None."""
    try:
        stderr = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is an OSError and a ValueError
        return None
    was_enabled = faulthandler.is_enabled()
    if not was_enabled:
        faulthandler.enable(file=stderr, all_threads=True)
    faulthandler.register(signal.SIGUSR1, file=stderr, all_threads=True, chain=False)

    def undo() -> None:
        faulthandler.unregister(signal.SIGUSR1)
        if not was_enabled:
            faulthandler.disable()

    return undo


def _start(args: argparse.Namespace, early: EarlyStop, warned: _Warned) -> int:
    try:
        shm.check_cache_name(args.name)
        # The endpoint first: a socket path too long to bind left the runtime dir made for it (review, stop 54).
        check_endpoint(args.endpoint or paths.ipc_endpoint(Path(args.runtime_dir) if args.runtime_dir else None,
                                                           args.name))
        runtime_dir = paths.ensure_runtime_dir(args.runtime_dir)
        cfg = config_from_args(args, runtime_dir)
    except (ValueError, PermissionError) as exc:  # PermissionError: ours, naming the dir and the rule
        print(f"omnishm committer: {exc}", file=sys.stderr)
        return EXIT_REFUSED
    except OSError as exc:  # a runtime dir it cannot create: under a file, on a read-only filesystem
        print(f"omnishm committer: cannot use runtime dir {args.runtime_dir or paths.default_runtime_dir()}: "
              f"{exc.strerror or exc}", file=sys.stderr)
        return EXIT_REFUSED
    # Imported only now: a refused start (bad option or name) answers without numpy's and zmq's import. The
    # client that autostarted this committer may be gone before the lock is taken (a rank killed right after its
    # autostart): the server knows it by pid and start time (--spawned-by PID:START), not as its parent.
    from omnishm.committer import server

    generation = uuid.uuid4().hex[:8]
    if early.reason:  # stopped before anything was made: nothing to clean up but an autostart log
        logger.info("committer %s stopped (%s) before it started", cfg.name, early.reason)
        try:
            lock = liveness.CacheLock.acquire(runtime_dir, cfg.name, generation)
        except OSError:  # a lock file not ours (a symlink, another user's): nothing of ours to clean up there
            lock = None
        if lock is not None:  # else the log is a running committer's too (autostarts of one name share it)
            sock_lock = None
            try:
                _drop_autostart_log(runtime_dir, cfg.name, EXIT_OK, warned.seen)
                sock_lock = _lock_socket(cfg, runtime_dir, generation)
                _remove_stale_socket(cfg)  # a killed committer's would else outlive its lock file, which sweeps go by
            except (_SocketTaken, OSError):
                pass  # another committer's, or no socket could be there: nothing stale to remove
            finally:
                if sock_lock is not None:
                    sock_lock.release(remove=True)
                lock.release(remove=True)
        return EXIT_OK
    try:
        lock = liveness.CacheLock.acquire(runtime_dir, cfg.name, generation)
    except PermissionError as exc:  # ours: a symlink or another user's file at the lock path, named with the rule
        # Refused as the socket's lock file is (exit 2, one line); it was a traceback with exit 1, which a
        # supervisor or the autostart took for a crash, not a refusal (review, stop 54).
        print(f"omnishm committer: {exc}", file=sys.stderr)
        return EXIT_REFUSED
    except OSError as exc:
        print(f"omnishm committer: cannot take the cache lock {liveness.lock_path(runtime_dir, cfg.name)}: "
              f"{exc.strerror or exc}", file=sys.stderr)
        return EXIT_REFUSED
    if lock is None:
        print(f"omnishm committer: cache {cfg.name!r} already has a running committer "
              f"({_lock_holder(runtime_dir, cfg.name)}, lock file {liveness.lock_path(runtime_dir, cfg.name)}); "
              f"refusing to start a second one", file=sys.stderr)
        return EXIT_REFUSED
    _reopen_autostart_log(runtime_dir, cfg.name)
    committer: Committer | None = None
    adopted: CachePool | None = None
    owner: liveness.GenerationOwner | None = None
    sock_lock: liveness.CacheLock | None = None
    served = False
    code: int | None = None
    try:
        try:
            sock_lock = _lock_socket(cfg, runtime_dir, generation)
        except _SocketTaken as exc:
            print(f"omnishm committer: endpoint {cfg.endpoint} belongs to a running committer ({exc}, lock file "
                  f"{liveness.socket_lock_path(cfg.ipc_path)}); refusing to take its socket over", file=sys.stderr)
            code = EXIT_REFUSED
            return code
        except OSError as exc:  # the endpoint's directory is missing or not writable: it could not be bound either
            print(f"omnishm committer: cannot bind {cfg.endpoint}: {exc.strerror or exc}", file=sys.stderr)
            code = EXIT_REFUSED
            return code
        adopted, owner = adopt_live_cache(cfg)
        serving = adopted.generation if adopted is not None else generation
        if owner is None:
            # a fresh generation: nobody else knows it
            owner = liveness.GenerationOwner.acquire(cfg.name, serving, runtime_dir=runtime_dir)
        if owner is None:
            print(f"omnishm committer: generation {serving} of cache {cfg.name!r} is held by another process; "
                  f"refusing to start", file=sys.stderr)
            return EXIT_REFUSED
        swept = orphans.sweep(runtime_dir, cfg.name, keep_generation=serving, assume_dead=True)
        if swept:
            logger.info("committer %s: removed %d segment(s) of a previous committer", cfg.name, len(swept))
        _sweep_dead_caches(runtime_dir, cfg.name)
        refusal = _remove_stale_socket(cfg)  # another cache's committer, one of another runtime dir, a user's file
        if refusal is not None:
            print(f"omnishm committer: {refusal}", file=sys.stderr)
            return EXIT_REFUSED
        committer = server.Committer(cfg, generation, pool=adopted)
        committer.bind()
        try:
            committer.obs.start_http()
        except OSError as exc:  # port taken or host not bindable: refuse to start rather than run blind
            print(f"omnishm committer: cannot serve metrics on {cfg.metrics_host}:{cfg.metrics_port}: {exc}",
                  file=sys.stderr)
            code = EXIT_REFUSED
        else:
            served = True
            code = committer.run(early_stop=early)
    except zmq.ZMQError as exc:
        print(f"omnishm committer: cannot bind {cfg.endpoint}: {exc}", file=sys.stderr)
        code = EXIT_REFUSED
    finally:
        attached = committer.sessions.data_clients() if committer is not None else 0
        # An adopted cache this committer never served still has clients waiting to resume: it is
        # left for the next start to adopt again (an unlink here would lose their unacknowledged writes).
        leave = adopted is not None and not served
        removed = committer.close(unlink=not leave) if committer is not None else []
        if owner is not None and owner.release(unlink=not leave):
            removed = [*removed, owner.name]
        try:
            if leave:
                logger.warning("committer %s refused to start; the adopted generation %s is left for the next "
                               "committer to adopt", cfg.name, adopted.generation)
            if committer is not None and attached:  # its clients lose the cache: worth a warning; the log is kept
                logger.warning("committer %s stopped (%s) with %d client(s) attached, which lose the cache: %d "
                               "segment(s) unlinked", cfg.name, committer.stop_reason or "error", attached,
                               len(removed))
            elif committer is not None:
                logger.info("committer %s stopped (%s): %d segment(s) unlinked", cfg.name,
                            committer.stop_reason or "error", len(removed))
            if code is not None:  # else an exception is on its way to the log, which is kept
                # Under the lock: the next committer of the name reopens the log once it holds the lock.
                _drop_autostart_log(runtime_dir, cfg.name, code, warned.seen)
        finally:
            if sock_lock is not None:  # after close: the socket goes under its lock
                sock_lock.release(remove=True)
            lock.release(remove=True)
    return code


class _SocketTaken(Exception):
    """The lock of an explicit endpoint's socket is held by another process (the holder is the message)."""


def _lock_socket(cfg: CommitterConfig, runtime_dir: Path, generation: str) -> liveness.CacheLock | None:
    """The caller holds the cache lock: take the lock of the ipc endpoint's socket (``liveness.socket_lock_path``).

    The cache's default socket too: the cache lock alone left it open to a committer of another cache given
    the same path as its explicit endpoint, and the later of two such starts took the other's socket (review).
    None when the endpoint is not ipc. Raises ``_SocketTaken`` when another process holds it, OSError when the
    lock file cannot be made."""
    if cfg.ipc_path is None:
        return None
    path = liveness.socket_lock_path(cfg.ipc_path)
    lock = liveness.CacheLock.at(path, generation)
    if lock is None:
        held = liveness.CacheLock.holder(path)
        raise _SocketTaken(f"generation {held[0]}, pid {held[1]}" if held else "holder unknown")
    return lock


def _remove_stale_socket(cfg: CommitterConfig) -> str | None:
    """The caller holds the cache lock: unlink the ipc endpoint's socket file when it is stale (trap 4).
    None when the path is free now, else why it is left alone: a live process serves it (an explicit
    endpoint that another cache's committer, or one of another runtime dir, was given too), or it is not a
    socket (``paths.socket_in_use``: never a user's file)."""
    if cfg.ipc_path is None:
        return None
    try:
        mode = os.lstat(cfg.ipc_path).st_mode  # a link is not ours to replace either, whatever it names
    except FileNotFoundError:
        return None
    if not stat.S_ISSOCK(mode):
        return f"{cfg.ipc_path} is not a socket; refusing to replace it"
    if paths.socket_in_use(cfg.ipc_path):
        return f"endpoint {cfg.endpoint} is served by a live process; refusing to take its socket over"
    cfg.ipc_path.unlink(missing_ok=True)
    return None


def _autostart_log(runtime_dir: Path, name: str) -> Path | None:
    """The autostart log this committer writes to (its stdout and stderr), if a client autostarted it."""
    path = os.environ.get("OMNISHM_AUTOSTART_LOG")
    if not path or Path(path) != Path(runtime_dir) / f"{name}.autostart.log":
        return None
    return Path(path)


def _reopen_autostart_log(runtime_dir: Path, name: str) -> None:
    """Once this committer holds the cache lock: its autostart log must be the file at the log's path again.

    Every autostart of a name writes into the same file, and a committer of the name that stops cleanly
    removes it (``_drop_autostart_log``, under the lock), maybe while this one was starting with the file
    as its stderr. What this one logs from now on goes to a file an operator can find.
    """
    path = _autostart_log(runtime_dir, name)
    if path is None or liveness.still_names(path, 2):
        return
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    except OSError as exc:
        logger.warning("committer %s: cannot reopen its autostart log %s: %s", name, path, exc)
        return
    try:
        os.dup2(fd, 1)
        os.dup2(fd, 2)
    finally:
        os.close(fd)


def _drop_autostart_log(runtime_dir: Path, name: str, code: int, warned: bool = False) -> None:
    """At a clean stop, the name's autostart log goes. An embedded committer's own log is kept when it did
    not stop cleanly or logged a warning (it says why). A launched committer (no autostart log of its own)
    removes one all the same at a clean stop (code 0): it is the log of a committer a client autostarted
    that lost the lock to this one, and no later stop of this name would remove it (review, 2026-12-06).
    The caller holds the cache lock: no other committer of the name is running, and the next one reopens
    the log once it holds the lock (``_reopen_autostart_log``)."""
    own = _autostart_log(runtime_dir, name)
    path = own if own is not None else Path(runtime_dir) / f"{name}.autostart.log"
    if code != 0 or (warned and own is not None):
        return
    try:
        path.unlink()
    except FileNotFoundError:
        pass
