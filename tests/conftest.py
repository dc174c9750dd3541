"""Shared fixtures: a private runtime dir, a leak check, committer subprocesses.

Every cache a test makes is named by ``unique_cache_name()`` (a per-session
prefix), so the leak check only judges this session's segments: other people's
omnishm processes on the same machine share /dev/shm and are left alone.
"""

from __future__ import annotations

import faulthandler
import itertools
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

# Before anything imports omnishm: committer subprocesses inherit this, so no
# test ever touches the user's runtime dir. mkdtemp makes it 0700.
RUNTIME_DIR = Path(tempfile.mkdtemp(prefix="omnishm-test-"))
os.environ["OMNISHM_RUNTIME_DIR"] = str(RUNTIME_DIR)
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from omnishm import orphans, paths, protocol, shm  # noqa: E402
from omnishm.liveness import CacheLock, lock_held  # noqa: E402

from helpers import RawClient  # noqa: E402
from manager_helpers import quick_config  # noqa: E402

SESSION_PREFIX = f"t{uuid.uuid4().hex[:6]}"
_counter = itertools.count()
SHARED_CACHES: set[str] = set()
"""Caches of module-scoped committers: their segments outlive single tests and are checked at their teardown."""
START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 15.0

# pytest-timeout (120 s, pyproject) fails a test whose call hangs, by a signal in the main thread; it does not
# bound that test's teardown afterwards, nor a hang in C code that never returns to Python. The watchdog below
# does: a test still running (setup, call and teardown) after HANG_LIMIT_S (``_hang_limit``) has every thread's
# stack written to HANG_DIR and its process ended (exit 1). Under xdist the controller prints those stacks in its
# summary (a worker's own stderr is captured, and lost with it) and the run goes on, red; a serial run (the vLLM
# tier) cannot print its own, and .ci/run prints what it left in HANG_DIR. Before it, stop 57's CI sat at 1,309
# of 1,320 tests until its 90-minute limit with nothing to tell where.
HANG_LIMIT_S = float(os.environ.get("OMNISHM_TEST_HANG_LIMIT_S", "300"))  # the environment: for its own test
if "OMNISHM_TEST_HANG_DIR" not in os.environ:  # the controller's (or a serial run's); xdist workers inherit it
    os.environ["OMNISHM_TEST_HANG_DIR"] = tempfile.mkdtemp(prefix="omnishm-hangs-")
HANG_DIR = Path(os.environ["OMNISHM_TEST_HANG_DIR"])
_hang_file = None
_hang_deadline: float | None = None


# scripts/test.sh runs the suite in two pytest-xdist workers, each a session with its own runtime dir. A committer
# that starts sweeps dead caches of other names host-wide, another runtime dir's too once nobody serves from it
# (``orphans.abandoned``). A test that SIGKILLs its whole cache on purpose leaves its dir served by nobody for a
# moment, and the other worker's next committer swept the segments the test was about to check. A cache lock held
# for the whole session keeps this session's dir served, as an engine host's dir is while anything runs there.
_DIR_ANCHOR = CacheLock.acquire(RUNTIME_DIR, f"{SESSION_PREFIX}-anchor", "session")
# The hang dir is the controller's (or a serial run's): its anchor tells a killed run's dir from a live one's.
_HANG_ANCHOR = (CacheLock.acquire(HANG_DIR, f"{SESSION_PREFIX}-anchor", "session")
                if "PYTEST_XDIST_WORKER" not in os.environ else None)
_DEAD_SESSION_AGE_S = 60.0


def _sweep_dead_sessions() -> list[Path]:
    """Remove what suite runs killed outright (no ``pytest_sessionfinish``) left in the temp dir. Their committers
    stopped with their parent (``--exit-with-parent``) and unlinked their segments; what a SIGKILLed committer left
    is swept by the next committer that starts (``orphans``). A dir goes only when it holds a session anchor that
    no process holds and that is older than ``_DEAD_SESSION_AGE_S`` (a session starting now holds its anchor a
    moment after making its dir):

    - a runtime dir (``omnishm-test-*``) whose only files are such anchors; one holding anything else is left for a
      person to look at;
    - a hang dir (``omnishm-hangs-*``) whose other files are the watchdog's per-process files (``PID.txt``) holding
      their header line only: a killed run's processes never unlinked theirs. One holding stacks (a serial run the
      watchdog ended: its header told a person to read them there) stays.

    Returns the dirs removed."""
    removed = []
    now = time.time()

    def dead_anchor(f: Path) -> bool:
        return f.name.endswith("-anchor.lock") and now - f.stat().st_mtime > _DEAD_SESSION_AGE_S and not lock_held(f)

    tmp = Path(tempfile.gettempdir())
    def header_only(f: Path) -> bool:
        return f.suffix == ".txt" and f.read_text(errors="replace").count("\n") <= 1

    for pattern, others_ok in (("omnishm-test-*", lambda f: False), ("omnishm-hangs-*", header_only)):
        for d in tmp.glob(pattern):
            try:
                files = list(d.iterdir()) if d not in (RUNTIME_DIR, HANG_DIR) and not d.is_symlink() else []
                anchors = [f for f in files if f.name.endswith("-anchor.lock")]
                dead = bool(anchors) and all(dead_anchor(f) for f in anchors) and all(
                    others_ok(f) for f in files if f not in anchors)
            except OSError:
                continue
            if dead:
                shutil.rmtree(d, ignore_errors=True)
                removed.append(d)
    return removed


_sweep_dead_sessions()


_ANY_SESSIONS_CACHE = re.compile(r"t[0-9a-f]{6}-")
"""What every session's ``unique_cache_name`` starts with: another session's caches are those that match and are
not ``_ours``."""


def unique_cache_name(tag: str = "c") -> str:
    return f"{SESSION_PREFIX}-{tag}{next(_counter)}"


def _ours(cache: str) -> bool:
    return cache.startswith(SESSION_PREFIX)


def pytest_ignore_collect(collection_path, config):
    """The real-vLLM tier runs on its own (tests/vllm_tier/run_tier.sh sets OMNISHM_VLLM_TIER=1).

    Its conftest sets process-wide environment (its own runtime dir) at import,
    which must not leak into the main suite's committers.
    """
    if collection_path.name == "vllm_tier" and os.environ.get("OMNISHM_VLLM_TIER") != "1":
        return True
    return None


def _hang_limit(item) -> float:
    """HANG_LIMIT_S, or twice the test's own pytest-timeout (its mark, else the ini's) where that is longer: the
    vLLM tier's engine tests allow themselves 300 and 420 s (review, stop 58: the watchdog ended them first)."""
    mark = item.get_closest_marker("timeout")
    own = (mark.args[0] if mark.args else mark.kwargs.get("timeout")) if mark is not None else None
    try:
        own = float(own if own is not None else item.config.getini("timeout") or 0)
    except (TypeError, ValueError):
        own = 0.0
    return max(HANG_LIMIT_S, 2 * own)


def _disarm() -> None:
    if _hang_deadline is not None:
        faulthandler.cancel_dump_traceback_later()


def _rearm() -> None:
    """The watchdog again, for what is left of the running test's limit (none armed between tests)."""
    if _hang_deadline is not None and _hang_file is not None:
        faulthandler.dump_traceback_later(max(0.1, _hang_deadline - time.monotonic()), exit=True, file=_hang_file)


# A forked child that arms or cancels faulthandler's timer (a normal interpreter exit cancels it) waits for good on
# the parent's watchdog thread, which it does not have (review, stop 58): the watchdog is off across a fork.
os.register_at_fork(before=_disarm, after_in_parent=_rearm)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Arms the hang watchdog (HANG_LIMIT_S) around one test's setup, call and teardown."""
    global _hang_file
    if _hang_file is None:
        _hang_file = open(HANG_DIR / f"{os.getpid()}.txt", "w")  # noqa: SIM115 - open for the whole session
    _hang_file.seek(0)
    _hang_file.truncate()
    limit = _hang_limit(item)
    _hang_file.write(f"{item.nodeid} was still running after {limit:.0f} s; every thread's stack:\n")
    _hang_file.flush()
    global _hang_deadline
    _hang_deadline = time.monotonic() + limit
    faulthandler.dump_traceback_later(limit, exit=True, file=_hang_file)
    try:
        yield
    finally:
        _hang_deadline = None
        faulthandler.cancel_dump_traceback_later()


@pytest.hookimpl(trylast=True)
def pytest_exception_interact(node, call, report):
    """pytest's faulthandler plugin cancels every pending dump when a test fails (for a debugger), which left
    the teardown after a pytest-timeout failure, the very case the watchdog is for, unwatched: re-armed here
    for what is left of the test's limit."""
    _rearm()


def pytest_sessionfinish(session, exitstatus):
    global _hang_file
    if _hang_file is not None:  # this process did not hang: its file says nothing
        _hang_file.close()
        os.unlink(_hang_file.name)
        _hang_file = None
    for anchor in (_DIR_ANCHOR, _HANG_ANCHOR):
        if anchor is not None:
            anchor.release()
    shutil.rmtree(RUNTIME_DIR, ignore_errors=True)


def pytest_report_header(config):
    return (f"hang watchdog: a test still running after {HANG_LIMIT_S:.0f} s ends its process, its stacks written "
            f"to {HANG_DIR} (under xdist printed at the end)")


def pytest_terminal_summary(terminalreporter):
    """The stacks of every process the hang watchdog ended (see HANG_LIMIT_S), then the dump dir goes."""
    if hasattr(terminalreporter.config, "workerinput"):
        return
    for dump in sorted(HANG_DIR.glob("*.txt")):
        terminalreporter.write_sep("=", f"hung test (process {dump.stem})")
        terminalreporter.write_line(dump.read_text(errors="replace"))
    shutil.rmtree(HANG_DIR, ignore_errors=True)


def _cache_of_file(name: str) -> str:
    """The cache a runtime-dir file belongs to: its name up to the first dot (cache names have none), so
    ``NAME.sock``, ``NAME.lock``, ``NAME.sock.lock`` and ``NAME.autostart.log`` are all NAME's (review,
    2026-12-06: splitting at the last dot missed the last two)."""
    return name.split(".", 1)[0]


@pytest.fixture(autouse=True)
def no_leaks():
    """Fail a test that leaves omnishm segments or runtime-dir files behind (and clean them up)."""
    before_segs = set(shm.list_segments())
    before_files = set(os.listdir(RUNTIME_DIR))
    yield
    leaked_segs = sorted(s for s in set(shm.list_segments()) - before_segs
                         if _ours(shm.parse_segment_name(s)[0]) and shm.parse_segment_name(s)[0] not in SHARED_CACHES)
    # After an interrupt pytest_sessionfinish may have removed the runtime dir before this teardown.
    now_files = set(os.listdir(RUNTIME_DIR)) if RUNTIME_DIR.is_dir() else set()
    leaked_files = sorted(f for f in now_files - before_files if _cache_of_file(f) not in SHARED_CACHES)
    for seg in leaked_segs:
        shm.unlink_segment(seg)
    for f in leaked_files:
        (RUNTIME_DIR / f).unlink(missing_ok=True)
    if leaked_segs or leaked_files:
        pytest.fail(f"test leaked omnishm segments {leaked_segs} / runtime files {leaked_files}")


@pytest.fixture(autouse=True)
def sweeps_spare_other_sessions(monkeypatch):
    """An in-process sweep of every cache (``orphans.sweep`` with no name, ``omnishm cleanup`` through
    ``cli.main``) does not see the caches of another session of this suite (the other xdist worker's).

    Such a sweep removed a generation the other worker had just SIGKILLed to check what its restart or its
    ``cleanup --name`` removes, and both tests failed: the one that swept counted 6 segments it did not make
    (review, stop 51). Names that are no session's (another program's, the tests' odd names) are still listed,
    so the tests of what a sweep leaves alone keep judging the product.
    """
    listed = orphans.list_segments

    def list_segments(cache: str | None = None) -> list[str]:
        names = listed(cache)
        if cache is not None:
            return names
        return [n for n in names if _ours(c := shm.parse_segment_name(n)[0]) or not _ANY_SESSIONS_CACHE.match(c)]

    monkeypatch.setattr(orphans, "list_segments", list_segments)


@dataclass
class CommitterHandle:
    name: str
    endpoint: str
    runtime_dir: Path
    proc: subprocess.Popen
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = STOP_TIMEOUT_S) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"committer {self.name} did not stop within {timeout_s}s:\n{self.log()}") from None

    def client(self) -> RawClient:
        return RawClient(self.endpoint, self.name)

    def status(self) -> dict:
        """The committer's status, through an admin session of its own."""
        admin = self.client()
        try:
            assert isinstance(admin.hello(protocol.ROLE_ADMIN), protocol.Welcome)
            return admin.status()
        finally:
            admin.goodbye()
            admin.close()


def wait_ready(handle: CommitterHandle, timeout_s: float = START_TIMEOUT_S) -> None:
    """Bounded wait until an admin Hello round trip succeeds (fails early if the process exits)."""
    client = handle.client()
    try:
        client.send(protocol.Hello(rid=1, protocol=protocol.PROTOCOL_VERSION, client_id=client.client_id,
                                   pid=os.getpid(), uid=os.geteuid(), role=protocol.ROLE_ADMIN, cache=handle.name))
        deadline = time.monotonic() + timeout_s
        while True:
            if client.sock.poll(100):
                reply = protocol.reply_decoder.decode(client.sock.recv())
                assert isinstance(reply, protocol.Welcome), reply
                assert isinstance(client.goodbye(), protocol.Bye)
                return
            if handle.proc.poll() is not None:
                raise AssertionError(f"committer {handle.name} exited with {handle.proc.returncode}:\n{handle.log()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"committer {handle.name} did not answer within {timeout_s}s:\n{handle.log()}")
    finally:
        client.close()


def start_committer(log_dir: Path, name: str | None = None, *extra: str, wait: bool = True,
                    python_args: tuple[str, ...] = ("-m", "omnishm.committer")) -> CommitterHandle:
    """A committer process for ``name``; ``python_args`` may run it through a script (``("-c", code)``)
    that patches it first, as long as that script ends in ``omnishm.committer.start.main``."""
    name = name or unique_cache_name()
    log_path = log_dir / f"{name}.{uuid.uuid4().hex[:6]}.log"
    with open(log_path, "wb") as log:
        # --exit-with-parent: a run killed outright (no teardown) leaves no committer, and so no segment, behind,
        # also one killed while the committer was still starting (--parent-pid).
        proc = subprocess.Popen([sys.executable, *python_args, "--name", name, "--runtime-dir", str(RUNTIME_DIR),
                                 "--exit-with-parent", "--parent-pid", str(os.getpid()), *extra],
                                stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    handle = CommitterHandle(name, paths.ipc_endpoint(RUNTIME_DIR, name), RUNTIME_DIR, proc, log_path)
    if wait:
        try:
            wait_ready(handle)
        except BaseException:
            # SIGTERM first: a committer still starting cleans up after itself (early_stop.EarlyStop); one
            # that does not stop in a few seconds is killed, and its leftovers fail the leak check.
            handle.proc.send_signal(signal.SIGTERM)
            try:
                handle.proc.wait(5.0)
            except subprocess.TimeoutExpired:
                handle.proc.kill()
                handle.proc.wait()
            raise
    return handle


def assert_clean_stop(handle: CommitterHandle, sig: int = signal.SIGTERM) -> None:
    """``sig`` (a stop signal: SIGTERM by default), exit 0, and nothing of that cache left in /dev/shm or the
    runtime dir."""
    rc = handle.stop(sig)
    assert rc == 0, f"committer {handle.name} exited {rc}:\n{handle.log()}"
    assert shm.list_segments(handle.name) == [], handle.log()
    left = [f for f in os.listdir(RUNTIME_DIR) if _cache_of_file(f) == handle.name]
    assert left == [], left


@pytest.fixture
def committer_factory(tmp_path_factory):
    """Start committers owned by one test; at teardown every one still running gets SIGTERM and must exit 0."""
    log_dir = tmp_path_factory.mktemp("committer-logs")
    started: list[CommitterHandle] = []

    def factory(*extra: str, name: str | None = None, wait: bool = True,
                python_args: tuple[str, ...] = ("-m", "omnishm.committer")) -> CommitterHandle:
        handle = start_committer(log_dir, name, *extra, wait=wait, python_args=python_args)
        started.append(handle)
        return handle

    yield factory
    # Every committer is stopped before the first failure is raised: one that left a file behind must not
    # leave the test's other committers running for good (review, 2026-12-06).
    failures: list[BaseException] = []
    for handle in started:
        if handle.proc.returncode is None and handle.proc.poll() is None:
            try:
                assert_clean_stop(handle)
            except BaseException as exc:  # noqa: BLE001 - raised below, after the others stopped
                failures.append(exc)
    if failures:
        raise failures[0]


@pytest.fixture(scope="module")
def committer(tmp_path_factory):
    """One committer shared by a module's tests (a start costs ~0.7 s of CPU here: numpy and zmq)."""
    handle = start_committer(tmp_path_factory.mktemp("committer-logs"), None, "--heartbeat-timeout-s", "60")
    SHARED_CACHES.add(handle.name)
    try:
        yield handle
    finally:
        try:
            assert_clean_stop(handle)
        finally:
            SHARED_CACHES.discard(handle.name)


@pytest.fixture
def mgr(committer):
    """Writer managers on the module's committer (``quick_config(**kw)``), all shut down at teardown."""
    from omnishm.client import OmniPrefixCacheManager

    made = []

    def make(policy=None, eager=False, **kw):
        m = OmniPrefixCacheManager(quick_config(**kw), cache=committer.name, autostart=False, eager=eager)
        if policy is not None:
            m.register_policy(policy)
        made.append(m)
        return m

    yield make
    failures: list[BaseException] = []
    for m in made:  # each one, even past a failed shutdown: a writer left attached fails the module's later tests
        try:
            m.shutdown()
        except BaseException as exc:  # noqa: BLE001 - raised below, after the others shut down
            failures.append(exc)
    if failures:
        raise failures[0]
